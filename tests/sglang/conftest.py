"""Shared fixtures of the SGLang tests (run with the SGLang virtualenv: ``make e2e-sglang``).

Environment: ``TPU_SYNC_SGLANG_WORKDIR`` (default ``target/sglang-e2e``) holds the tiny model
(built once), engine specs, outputs, logs and stats files. SGLang's CPU engine and the offline
Hugging Face settings are forced here (also for the engine processes, which inherit them), so
no test reaches the network. The CPU shim (``tests/sglang/shim``) is on ``sys.path`` through the
venv's ``.pth`` file (``scripts/install-sglang.sh``).
"""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKDIR = os.environ.get("TPU_SYNC_SGLANG_WORKDIR", os.path.join(ROOT, "target", "sglang-e2e"))

ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    # HiCache keeps 10 GiB of host RAM free by default; the shim lowers it on this test machine.
    "TPU_SYNC_SGLANG_HOST_RESERVE_BYTES": str(1 << 30),
    "TORCH_EXTENSIONS_DIR": os.path.join(WORKDIR, "torch_extensions"),
    "SGLANG_CACHE_DIR": os.path.join(WORKDIR, "sglang-cache"),
    # ninja (venv bin) for SGLang's JIT-compiled L3 hash extension
    "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
}
os.environ.update(ENV)
sys.path.insert(0, os.path.dirname(HERE))
import zygote as fork_server  # noqa: E402  (tests/zygote.py: the engines' fork server)


def _model_command(path: str) -> list:
    return [sys.executable, os.path.join(ROOT, "tests", "vllm", "build_tiny_model.py"), path, "--max-len", "2048"]


def _built(path: str) -> bool:
    return os.path.exists(os.path.join(path, "config.json")) and os.path.exists(
        os.path.join(path, "model.safetensors"))


_prebuild = fork_server.Background()


def build_model(path: str) -> str:
    """Builds the tiny model at ``path`` unless it is there (``tests/vllm/build_tiny_model.py``:
    2 layers, 2 KV heads of 32, random weights, a tokenizer trained on local text), after the
    build :func:`pytest_sessionstart` started in the background ended (a failed one fails here
    again, in the foreground)."""
    _prebuild.wait()
    if not _built(path):
        subprocess.run(_model_command(path), check=True, timeout=300, env=dict(os.environ))
    return path


_server = fork_server.EarlyServer()


def pytest_sessionstart(session):
    """Before collection, when engine tests may run (:func:`zygote.wants_engines`): the tiny
    model's build and the fork server start here, so that their imports overlap collection's."""
    if not fork_server.wants_engines(session.config):
        return
    os.makedirs(WORKDIR, exist_ok=True)
    path = os.path.join(WORKDIR, "tiny-llama")
    if not _built(path):
        _prebuild.start(_model_command(path), os.path.join(WORKDIR, "model.log"), dict(os.environ))
    if os.environ.get("TPU_SYNC_SGLANG_ZYGOTE") != "0":
        _server.start(os.path.join(HERE, "run_engine.py"), WORKDIR)


def pytest_sessionfinish(session, exitstatus):
    _server.stop()


@pytest.fixture(scope="session")
def workdir() -> str:
    os.makedirs(WORKDIR, exist_ok=True)
    return WORKDIR


@pytest.fixture(scope="session")
def tiny_model(workdir) -> str:
    return build_model(os.path.join(workdir, "tiny-llama"))


@pytest.fixture(scope="session")
def zygote(workdir):
    """The fork server of the engine processes (``tests/zygote.py`` serving ``run_engine.py``):
    imports torch and SGLang once, and each engine, forked from it, forks its scheduler and
    detokenizer processes too (``run_engine.zygote_child``), so that no engine process imports
    SGLang for itself. ``TPU_SYNC_SGLANG_ZYGOTE=0`` turns it off (every process then imports for
    itself, as SGLang starts them). Started before collection where :func:`pytest_sessionstart`
    did, else here."""
    if os.environ.get("TPU_SYNC_SGLANG_ZYGOTE") == "0":
        yield None
        return
    if not os.environ.get(fork_server.ENV_SOCKET):  # not started before collection
        _server.start(os.path.join(HERE, "run_engine.py"), workdir)
    yield os.environ.get(fork_server.ENV_SOCKET)
    _server.stop()


@pytest.fixture(scope="session")
def engines(workdir, tiny_model, zygote):
    """Every engine process of the run (:mod:`engines`); whatever is still running at the end of
    the session is killed."""
    import engines as eng

    e = eng.Engines(workdir, tiny_model)
    yield e
    e.kill_all()
    for prefix in (eng.SHM, eng.LINKER_SHM):
        eng.remove_segments(prefix)


@pytest.fixture(scope="session")
def launched(engines):
    """The first-phase engines, all started at once (:func:`engines.launch`)."""
    import engines as eng

    for prefix in (eng.SHM, eng.LINKER_SHM):
        eng.remove_segments(prefix)
    eng.launch(engines)
    return engines


@pytest.fixture(scope="session")
def restarted(launched):
    """The second-phase engines, started together once the first ``tpu_sync`` and ``linker``
    engines have finished: a page of ``A[1]`` is corrupted in each one's ``/dev/shm`` tier, then
    ``restart`` (HiCache + L3) and ``linker-restart`` re-attach their tiers."""
    import json

    import engines as eng

    e = launched
    ours, lk = e.finish("tpu_sync"), e.finish("linker")
    eng.corrupt_entry(f"{eng.SHM}-kv-tp0", ours["stats"]["storage"][0]["tiers"]["kv"]["namespace"],
                      2 * 2 * eng.PAGE * 2 * 32 * 4, eng.A[1], 3)
    eng.corrupt_entry(f"{eng.LINKER_SHM}-tp0", lk["stats"]["linker"][0]["tier"]["namespace"],
                      2 * 2 * eng.PAGE * 2 * 32 * 4, eng.A[1], 3)
    steps = [{"generate": [eng.A0X]}, {"generate": [eng.A[1]]}]
    # wait_complete: a prefetch from L3 is never cut short by SGLang's timeout (1 s + 0.25 s per
    # 1k tokens), which a loaded test machine can exceed: the test checks what was hit.
    e.start("restart", steps, env={"TPU_SYNC_HICACHE_IO": "1"},
            engine=dict(eng.HICACHE, hicache_storage_backend="dynamic", hicache_storage_prefetch_policy="wait_complete",
                        hicache_storage_backend_extra_config=json.dumps(eng.STORAGE)))
    e.start("linker-restart", steps, engine=eng.LINKER)
    return e
