#!/usr/bin/env bash
# Installs a real SGLang engine for the CPU-only tests of tpu_sync.sglang into a cached virtualenv
# (.venv-sglang): sglang 0.5.23 with the CPU overrides below, pytest, cffi, ninja (SGLang's L3
# lookup JIT-compiles a small C++ hash extension with torch.utils.cpp_extension), and the
# project's CPU test shim (tests/sglang/shim: a stand-in for the CUDA-only sgl_kernel package and
# three start-up patches), made importable in every process of the venv through a .pth file.
# uv comes from the project's tool venv (scripts/bootstrap-python.sh).
# Idempotent: a second run with the stamp present only re-links the shim.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${SGLANG_VENV:-$root/.venv-sglang}"
stamp="$venv/.tpu-sync-sglang-0.5.23"
shim="$root/tests/sglang/shim"

link_shim() {
  local site
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # Every interpreter of the venv (SGLang's spawned scheduler processes included) puts the shim
  # first on sys.path and runs its start-up patches (tests/sglang/shim/tpu_sync_sglang_cpu.py).
  printf '%s\nimport tpu_sync_sglang_cpu\n' "$shim" > "$site/00-tpu-sync-sglang-cpu.pth"
}

if [ -f "$stamp" ] && "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)" 2>/dev/null; then
  link_shim
  exit 0
fi
uv="$("$root/scripts/bootstrap-python.sh")/bin/uv"
overrides="$(mktemp)"
trap 'rm -f "$overrides"' EXIT
# sglang pins torch==2.14.1: PyPI's build is the CUDA one; it runs on CPU (its nvidia-* wheels are
# needed only to import), so torch stays as pinned. Dropped: kernel stacks the CPU engine
# (SGLANG_USE_CPU_ENGINE=1, torch_native attention) never loads, sglang-kernel itself (CUDA-only:
# `import sgl_kernel` fails without libcuda.so.1; replaced by the shim) and the audio stacks
# (text-only model; torchvision stays, sglang.srt.configs imports it at start-up).
cat > "$overrides" <<'OV'
sglang-kernel; sys_platform == "never"
flashinfer-python; sys_platform == "never"
flash-attn-4; sys_platform == "never"
humming-kernels; sys_platform == "never"
nvidia-cutlass-dsl; sys_platform == "never"
nvidia-mathdx; sys_platform == "never"
quack-kernels; sys_platform == "never"
sgl-deep-ep; sys_platform == "never"
sgl-deep-gemm; sys_platform == "never"
sgl-flash-mla; sys_platform == "never"
tilelang; sys_platform == "never"
nvshmem4py-cu13; sys_platform == "never"
torchaudio; sys_platform == "never"
torchcodec; sys_platform == "never"
OV
if [ ! -x "$venv/bin/python" ]; then
  "$uv" venv -q -p "$(command -v python3)" "$venv"
fi
"$uv" pip install -q --python "$venv/bin/python" sglang==0.5.23 --override "$overrides"
"$uv" pip install -q --python "$venv/bin/python" pytest cffi ninja numpy
link_shim
touch "$stamp"
echo "SGLang venv ready: $venv" >&2
