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


def build_model(path: str) -> str:
    """Builds the tiny model at ``path`` unless it is there (``tests/vllm/build_tiny_model.py``:
    2 layers, 2 KV heads of 32, random weights, a tokenizer trained on local text)."""
    if not os.path.exists(os.path.join(path, "config.json")):
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "vllm", "build_tiny_model.py"), path,
                        "--max-len", "2048"], check=True, timeout=300, env=dict(os.environ))
    return path


@pytest.fixture(scope="session")
def workdir() -> str:
    os.makedirs(WORKDIR, exist_ok=True)
    return WORKDIR


@pytest.fixture(scope="session")
def tiny_model(workdir) -> str:
    return build_model(os.path.join(workdir, "tiny-llama"))
