#!/usr/bin/env bash
# GPU check of the tpu-sync device layer, in ONE call on the lent GPU machine (NVIDIA H200 image
# 'cuda': Python with jax-cuda13-pjrt, whose xla_cuda_plugin.so is a real CUDA PJRT plugin, plus
# cupy, torch and nvcc; no Rust toolchain, no network).
#
# What it measures, for 32 layers x 64 KV blocks (4096 pieces of 32 KiB = 128 MiB, llama-3.1-8b
# NHD blocks, see gpu_copy.rs):
#   * tpu-sync through the CUDA PJRT plugin (target/gpu/gpu_copy): batched D2H with
#     PJRT_Buffer_CopyRawToHost per block into a pinned, PJRT_Client_DmaMap'ed host arena (paced
#     at the TPU Sync defaults, and unpaced); in-place H2D by the path the library probes; a view
#     (CreateViewOfDeviceBuffer) over a real device pointer;
#   * cudaMemcpyAsync of the same bytes between device and pinned host memory: the same 4096
#     pieces from a C loop (memcpy_baseline.cu, built with nvcc here), the same pieces from a
#     Python loop (cupy, or torch), and one contiguous 128 MiB copy (the DMA bound);
# and prints the ratios (tpu-sync time / cudaMemcpy time; 1.00 = cudaMemcpy speed).
#
# In-place H2D on the CUDA plugin: the plugin has no RawBuffer extension and its device memory is
# not host-addressable, so the library reports H2D as Unsupported (naming the plugin and the
# missing extension) instead of writing through the opaque device pointer with the CUDA runtime,
# which this CPU-built library does not link. The script prints that answer and the cudaMemcpy
# H2D baseline for reference; there is no tpu-sync H2D ratio on this plugin.
#
# and, with `build.sh --with-jax`, the JAX adapter on the GPU (jax_check.py, see there).
#
# Usage (from a session whose task has the GPU; the binary is built where cargo exists):
#   bash benches/gpu/build.sh [--with-jax]                      # here: target/gpu/
#   device tool: run command="bash benches/gpu/run.sh" carry=["target/gpu"] timeout_s=480
# Outputs go to $OUT (the device tool's output folder) or a temp dir: pjrt.txt, cupy.txt,
# native.txt, jax.txt, summary.json. Environment: ITERS (default 10), TPU_SYNC_GPU_BIN (binary),
# TPU_SYNC_PJRT_PLUGIN (plugin path), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
ITERS=${ITERS:-10}
PY=${PYTHON:-python3}
say() { echo "== $*"; }

# 1. The copy program.
BIN=${TPU_SYNC_GPU_BIN:-}
if [ -z "$BIN" ]; then
    if [ -x target/gpu/gpu_copy ]; then
        BIN=target/gpu/gpu_copy
    elif command -v cargo >/dev/null; then
        bash benches/gpu/build.sh && BIN=target/gpu/gpu_copy
    else
        echo "no target/gpu/gpu_copy and no cargo: run benches/gpu/build.sh where cargo exists and carry target/gpu" >&2
        exit 2
    fi
fi
say "binary: $BIN"

# 2. The CUDA PJRT plugin shipped by jax-cuda13-pjrt (or cuda12), and its CUDA libraries.
PLUGIN=${TPU_SYNC_PJRT_PLUGIN:-}
if [ -z "$PLUGIN" ]; then
    PLUGIN=$($PY - <<'PYEOF'
import importlib.util, os
for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        spec = None
    if spec and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            p = os.path.join(d, "xla_cuda_plugin.so")
            if os.path.isfile(p):
                print(p)
                raise SystemExit
PYEOF
)
fi
if [ -z "$PLUGIN" ] || [ ! -f "$PLUGIN" ]; then
    echo "no CUDA PJRT plugin found (pip package jax-cuda13-pjrt); set TPU_SYNC_PJRT_PLUGIN" >&2
    exit 2
fi
say "plugin: $PLUGIN"
NVLIBS=$($PY - <<'PYEOF'
import glob, os
try:
    import nvidia
    dirs = sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "*", "lib", "lib*.so*"))})
    print(":".join(dirs))
except Exception:
    pass
PYEOF
)
export LD_LIBRARY_PATH="${NVLIBS:+$NVLIBS:}${LD_LIBRARY_PATH:-}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/== gpu: /'

# 3. tpu-sync through the plugin.
say "tpu-sync gpu_copy (ITERS=$ITERS)"
timeout 300 "$BIN" --plugin "$PLUGIN" --iters "$ITERS" >"$OUT/pjrt.txt" 2>"$OUT/pjrt.err"
echo "   exit $?"
grep -v '^I0000\|^WARNING: All log' "$OUT/pjrt.err" | tail -n 25

# 4. cudaMemcpy baselines.
say "native cudaMemcpyAsync baseline (nvcc)"
if command -v nvcc >/dev/null; then
    if nvcc -O2 -o "$OUT/memcpy_baseline" benches/gpu/memcpy_baseline.cu 2>"$OUT/nvcc.err"; then
        timeout 120 "$OUT/memcpy_baseline" "$ITERS" >"$OUT/native.txt" 2>&1
        echo "   exit $?"
    else
        echo "   nvcc failed:"; tail -n 5 "$OUT/nvcc.err"
    fi
else
    echo "   no nvcc"
fi
say "cupy/torch cudaMemcpyAsync baseline"
timeout 180 $PY benches/gpu/baseline.py --iters "$ITERS" >"$OUT/cupy.txt" 2>"$OUT/cupy.err"
echo "   exit $?"; tail -n 3 "$OUT/cupy.err"

# 5. The JAX adapter on the GPU (benches/gpu/jax_check.py): P/D between two runners whose KV
# caches are CUDA jax.Arrays, through tpu_sync.jax_kv.JaxKv (framework-copy) and two endpoints,
# byte-exact, against JAX's own device_get/device_put of the same blocks. Needs the tpu_sync
# wheel and the XLA CPU PJRT plugin (its host views) in target/gpu (build.sh --with-jax).
if ls target/gpu/tpu_sync-*.whl >/dev/null 2>&1 && [ -f target/gpu/xla_cpu_pjrt.so.xz ]; then
    say "JAX adapter on the GPU"
    SITE=$(mktemp -d)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" target/gpu/*.whl &&
        $PY -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as f, open(sys.argv[2], "wb") as o:
    shutil.copyfileobj(f, o, 1 << 24)' target/gpu/xla_cpu_pjrt.so.xz "$SITE/xla_cpu_pjrt.so" &&
        PYTHONUNBUFFERED=1 PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" TPU_SYNC_PJRT_PLUGIN="$SITE/xla_cpu_pjrt.so" \
            timeout 240 $PY benches/gpu/jax_check.py --platform gpu --rounds "${JAX_ROUNDS:-5}" >"$OUT/jax.txt" 2>"$OUT/jax.err"
    echo "   exit $?"
    grep -v '^JAXCHECK' "$OUT/jax.txt"; grep -v '^I0000\|^WARNING: All log' "$OUT/jax.err" | tail -n 15
else
    say "JAX adapter: skipped (no target/gpu/tpu_sync-*.whl and xla_cpu_pjrt.so.xz; run build.sh --with-jax)"
fi

# 6. Ratios.
say "summary"
$PY - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
def line(path, tag):
    try:
        for l in open(os.path.join(out, path)):
            if l.startswith(tag + " "):
                return json.loads(l[len(tag) + 1:])
    except OSError:
        pass
    return None
p, n, c = line("pjrt.txt", "RESULT"), line("native.txt", "NATIVE"), line("cupy.txt", "BASELINE")
summary = {"tpu_sync": p, "native": n, "python": c, "jax": line("jax.txt", "JAXCHECK"), "ratios": {}}
if not p or "error" in p:
    print("tpu-sync run failed:", p)
else:
    gb = p["bytes"] / 1e9
    print(f"platform {p['platform']} {p['platform_version']}, PJRT API {p['api_version']}, layout {p['layout']}")
    print(f"D2H path: {p['d2h_path']}; host arena DMA: {p['dma']}")
    print(f"view of a device pointer: {p['view_check']}")
    print(f"{'':34}{'time ms':>10}{'GB/s':>9}")
    def row(name, s):
        if s:
            print(f"{name:34}{s * 1e3:10.3f}{gb / s:9.2f}")
    row("tpu-sync D2H (paced 16/64 MiB)", p["d2h_median_s"])
    row("tpu-sync D2H (unpaced)", p["d2h_unpaced_median_s"])
    for tag, b in (("native C loop", n), ("python loop", c)):
        if b and "error" not in b:
            row(f"cudaMemcpy D2H pieces, {tag}", b["pieces_d2h_s"])
            row(f"cudaMemcpy D2H contiguous ({tag})", b["contiguous_d2h_s"])
            row(f"cudaMemcpy H2D pieces, {tag}", b["pieces_h2d_s"])
            row(f"cudaMemcpy H2D contiguous ({tag})", b["contiguous_h2d_s"])
            r = summary["ratios"]
            r[f"d2h_vs_pieces_{tag}"] = p["d2h_median_s"] / b["pieces_d2h_s"]
            r[f"d2h_vs_contiguous_{tag}"] = p["d2h_median_s"] / b["contiguous_d2h_s"]
            if p.get("h2d_median_s"):
                r[f"h2d_vs_pieces_{tag}"] = p["h2d_median_s"] / b["pieces_h2d_s"]
    if p.get("h2d_median_s"):
        row("tpu-sync H2D in place", p["h2d_median_s"])
    else:
        print(f"tpu-sync in-place H2D: UNSUPPORTED on this plugin: {p.get('h2d_unsupported')}")
    print("ratios (tpu-sync time / cudaMemcpy time of the same bytes; 1.00 = cudaMemcpy speed):")
    for k, v in summary["ratios"].items():
        print(f"  {k:40}{v:6.2f}")
    # The same figures as a table for docs/performance.md ("GPU (CUDA PJRT plugin)"), as
    # throughput ratios (cudaMemcpy time / tpu-sync time: 1.00 = cudaMemcpy speed; target >= 0.9).
    gpu = "unknown GPU"
    try:
        import subprocess
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip() or gpu
    except Exception:
        pass
    print("--- paste into docs/performance.md ---")
    print(f"Measured by `benches/gpu/run.sh` on {gpu}, {p['platform']} {p['platform_version']}, PJRT API "
          f"{p['api_version']}, {p['bytes'] / (1 << 20):.0f} MiB per batch in 32 KiB KV blocks, median of {os.environ.get('ITERS', '10')}.")
    print()
    print("| copy | tpu-sync GB/s | cudaMemcpyAsync GB/s (same pieces, C loop) | contiguous GB/s | tpu-sync / cudaMemcpy pieces | tpu-sync / contiguous |")
    print("|---|---|---|---|---|---|")
    b = n if n and "error" not in n else (c if c and "error" not in c else None)
    def cells(t, pieces, contig):
        if not t or not b:
            return "- | - | - | - | -"
        return f"{gb / t:.1f} | {gb / pieces:.1f} | {gb / contig:.1f} | {pieces / t:.2f} | {contig / t:.2f}"
    if b:
        print(f"| D2H, paced (16 MiB chunks, 64 MiB in flight) | {cells(p['d2h_median_s'], b['pieces_d2h_s'], b['contiguous_d2h_s'])} |")
        print(f"| D2H, unpaced | {cells(p['d2h_unpaced_median_s'], b['pieces_d2h_s'], b['contiguous_d2h_s'])} |")
        if p.get("h2d_median_s"):
            print(f"| H2D in place | {cells(p['h2d_median_s'], b['pieces_h2d_s'], b['contiguous_h2d_s'])} |")
        else:
            print(f"| H2D in place | unsupported: {p.get('h2d_unsupported')} | {gb / b['pieces_h2d_s']:.1f} | {gb / b['contiguous_h2d_s']:.1f} | - | - |")
    print("--- end ---")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(f"(outputs in {out})")
PYEOF
