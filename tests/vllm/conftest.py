"""Shared fixtures of the vLLM connector tests (run with the vLLM virtualenv: ``make e2e-vllm``).

Environment: ``TPU_SYNC_VLLM_WORKDIR`` (default ``target/vllm-e2e``) holds the tiny model (built
once), engine specs, outputs and logs. The vLLM and Hugging Face offline settings are forced here
so no test reaches the network.
"""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import zygote as fork_server  # noqa: E402  (tests/zygote.py: the engines' fork server)
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKDIR = os.environ.get("TPU_SYNC_VLLM_WORKDIR", os.path.join(ROOT, "target", "vllm-e2e"))

ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
os.environ.update(ENV)


#: The sliding window (tokens) of the tiny sliding-window Llama (``tiny-sliding``).
SLIDING_WINDOW = 48


def _model_commands(workdir: str) -> dict:
    """The tiny models of the suite under ``workdir``: name -> the builder's arguments. The two
    hybrids start from a copy of ``tiny-llama`` (``--base``: the same tokenizer and weights as a
    build of their own would give, without its 15 s)."""
    llama = os.path.join(workdir, "tiny-llama")
    hybrid = os.path.join(HERE, "build_tiny_hybrid.py")
    return {
        "tiny-llama": [os.path.join(HERE, "build_tiny_model.py"), llama, "--layers", "2", "--max-len", "4096"],
        "tiny-sliding": [hybrid, os.path.join(workdir, "tiny-sliding"), "--kind", "sliding", "--window",
                         str(SLIDING_WINDOW), "--base", llama],
        "tiny-granite": [hybrid, os.path.join(workdir, "tiny-granite"), "--kind", "granite", "--base", llama],
    }


def _built(path: str) -> bool:
    return os.path.exists(os.path.join(path, "config.json")) and os.path.exists(
        os.path.join(path, "model.safetensors"))


_prebuild = fork_server.Background()


def start_model_builds(workdir: str) -> None:
    """Starts building the tiny models that ``workdir`` lacks, one after the other in one
    background shell, while the session starts the engines' fork server (both mostly import torch
    and transformers, each on one core). :func:`model` waits for it."""
    if _prebuild.started:
        return
    todo = [cmd for name, cmd in _model_commands(workdir).items() if not _built(os.path.join(workdir, name))]
    if not todo:
        return
    import shlex

    _prebuild.start(["bash", "-c", " && ".join(shlex.join([sys.executable] + c) for c in todo)],
                    os.path.join(workdir, "models.log"), dict(os.environ, **ENV))


def model(workdir: str, name: str) -> str:
    """The path of the tiny model ``name`` (``tiny-llama``, ``tiny-sliding``, ``tiny-granite``),
    once the background builds ended; built here if they did not build it (their log is in
    ``models.log``: a failed build fails here again, in the foreground)."""
    _prebuild.wait()
    cmds = _model_commands(workdir)
    path = os.path.join(workdir, name)
    if not _built(path):
        if "--base" in cmds[name]:
            model(workdir, "tiny-llama")
        subprocess.run([sys.executable] + cmds[name], check=True, timeout=300, env=dict(os.environ, **ENV))
    return path


@pytest.fixture(scope="session")
def workdir() -> str:
    os.makedirs(WORKDIR, exist_ok=True)
    return WORKDIR


@pytest.fixture(scope="session")
def tiny_model(workdir) -> str:
    return model(workdir, "tiny-llama")


_server = fork_server.EarlyServer()


def _start_zygote(workdir: str) -> None:
    start_model_builds(workdir)
    if os.environ.get("TPU_SYNC_VLLM_ZYGOTE") != "0" and not os.environ.get(fork_server.ENV_SOCKET):
        _server.start(os.path.join(HERE, "run_engine.py"), workdir)


def pytest_sessionstart(session):
    """Before collection, when engine tests may run (:func:`zygote.wants_engines`): the fork
    server and the tiny models' builds start here, so their imports overlap collection's."""
    if fork_server.wants_engines(session.config):
        os.makedirs(WORKDIR, exist_ok=True)
        _start_zygote(WORKDIR)


def pytest_sessionfinish(session, exitstatus):
    _server.stop()


@pytest.fixture(scope="session", autouse=True)
def zygote(workdir):
    """The fork server of the engine processes (``tests/zygote.py`` serving ``run_engine.py``):
    imports torch and vLLM once, so that each engine run skips that import; its socket is in
    ``TPU_SYNC_ZYGOTE`` meanwhile. ``TPU_SYNC_VLLM_ZYGOTE=0`` turns it off (every engine then
    imports for itself). Started before collection where :func:`pytest_sessionstart` did, else
    here; the tiny models are built meanwhile (:func:`start_model_builds`)."""
    _start_zygote(workdir)
    yield os.environ.get(fork_server.ENV_SOCKET)
    _server.stop()


@pytest.fixture(scope="session", autouse=True)
def clean_vllm_shm():
    """Removes the ``/dev/shm/vllm_dist_*`` broadcast segments that vLLM's TP>1 workers leave
    behind when an engine is killed (as the producer-death test does), so repeated runs do not
    accumulate them. Only segments that appeared during this session and that no process maps
    are touched (`make test` runs another vLLM suite beside this one, whose live engines'
    segments must stay)."""
    def segments():
        try:
            return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_dist_")}
        except OSError:
            return set()

    def mapped():
        out = set()
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/maps") as f:
                    out.update(line.rsplit("/", 1)[-1].split()[0] for line in f if "/dev/shm/vllm_dist_" in line)
            except OSError:
                continue
        return out

    before = segments()
    yield
    for n in segments() - before - mapped():
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except OSError:
            pass
