#!/usr/bin/env bash
# Builds the GPU check's copy program (benches/gpu/gpu_copy.rs) where cargo exists and puts a
# stripped copy at target/gpu/gpu_copy, the folder to carry to a machine without Rust:
#   bash benches/gpu/build.sh [--with-jax]   # here
# --with-jax also puts the tpu_sync wheel (make python), cffi's wheel for Python 3.12 and the XLA CPU PJRT plugin, xz-compressed
# (its host views; about 38 MiB of the 64 MiB a device call carries), there for jax_check.py.
#   (device tool) run command="bash benches/gpu/run.sh" carry=["target/gpu"]
set -euo pipefail
cd "$(dirname "$0")/../.."
exe=$(cargo bench --bench gpu_copy --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_copy":
        print(m["executable"])')
[ -n "$exe" ] || { echo "build.sh: no gpu_copy executable built" >&2; exit 1; }
mkdir -p target/gpu
cp "$exe" target/gpu/gpu_copy
if command -v strip >/dev/null; then strip target/gpu/gpu_copy; fi
echo "built target/gpu/gpu_copy ($(du -h target/gpu/gpu_copy | cut -f1)) from $exe"
if [ "${1:-}" = "--with-jax" ]; then
    whl=$(ls -t target/wheels/tpu_sync-*.whl 2>/dev/null | head -n 1)
    [ -n "$whl" ] || make python
    whl=$(ls -t target/wheels/tpu_sync-*.whl | head -n 1)
    rm -f target/gpu/tpu_sync-*.whl target/gpu/cffi-*.whl
    cp "$whl" target/gpu/
    # tpu_sync's cffi bindings need cffi's _cffi_backend, which the GPU image lacks (Python 3.12).
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d target/gpu 'cffi>=1.17'

    plugin=${TPU_SYNC_PJRT_PLUGIN:-.deps/xla-cpu-pjrt/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so}
    [ -f "$plugin" ] || make plugin
    if [ ! -f target/gpu/xla_cpu_pjrt.so.xz ] || [ "$plugin" -nt target/gpu/xla_cpu_pjrt.so.xz ]; then
        xz -6 -T0 -k -c "$plugin" >target/gpu/xla_cpu_pjrt.so.xz
    fi
    echo "with $(basename "$whl") and xla_cpu_pjrt.so.xz ($(du -h target/gpu/xla_cpu_pjrt.so.xz | cut -f1))"
fi
