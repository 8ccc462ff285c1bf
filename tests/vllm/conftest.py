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


def build_model(path: str, layers: int = 2, max_len: int = 4096) -> str:
    """Builds the tiny model at ``path`` unless it is there."""
    if not os.path.exists(os.path.join(path, "config.json")):
        subprocess.run([sys.executable, os.path.join(HERE, "build_tiny_model.py"), path, "--layers", str(layers),
                        "--max-len", str(max_len)], check=True, timeout=300, env=dict(os.environ, **ENV))
    return path


@pytest.fixture(scope="session")
def workdir() -> str:
    os.makedirs(WORKDIR, exist_ok=True)
    return WORKDIR


@pytest.fixture(scope="session")
def tiny_model(workdir) -> str:
    return build_model(os.path.join(workdir, "tiny-llama"))


@pytest.fixture(scope="session", autouse=True)
def zygote(workdir):
    """The fork server of the engine processes (``tests/zygote.py`` serving ``run_engine.py``):
    imports torch and vLLM once, so that each engine run skips that import; its socket is in
    ``TPU_SYNC_ZYGOTE`` meanwhile. ``TPU_SYNC_VLLM_ZYGOTE=0`` turns it off (every engine then
    imports for itself)."""
    if os.environ.get("TPU_SYNC_VLLM_ZYGOTE") == "0":
        yield None
        return
    with fork_server.serving(os.path.join(HERE, "run_engine.py"), workdir) as path:
        yield path


@pytest.fixture(scope="session", autouse=True)
def clean_vllm_shm():
    """Removes the ``/dev/shm/vllm_dist_*`` broadcast segments that vLLM's TP>1 workers leave
    behind when an engine is killed (as the producer-death test does), so repeated runs do not
    accumulate them. Only segments that appeared during this session are touched."""
    def segments():
        try:
            return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_dist_")}
        except OSError:
            return set()

    before = segments()
    yield
    for n in segments() - before:
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except OSError:
            pass
