#!/usr/bin/env bash
# TPU check of tpu-sync (issue 25, item 5): ON A TPU VM ONLY. Never run it elsewhere: it loads
# libtpu, whose start-up queries the cloud metadata server (docs/tpu.md). It refuses to start
# unless the machine has TPU chips (/dev/accel* or /dev/vfio/<n>) or TPU_SYNC_TPU_VM=1 says so.
#
# What it runs, each step logged to $OUT (or a temp dir) and summarised in summary.txt:
#   1. `tpu-sync info` through libtpu's PJRT C API: API version, platform, devices, memory
#      spaces, which capabilities the library found (raw buffers, DMA map, async H2D, views).
#   2. `tpu-sync bench d2h`, `bench h2d`: KV blocks between TPU HBM and pinned host memory through
#      the PJRT C API, against memcpy of the same bytes in the same run (the figures
#      docs/performance.md needs for a TPU).
#   3. P/D between two processes of this VM, each on its own chips (TPU_VISIBLE_CHIPS split in
#      halves), over TCP: `tpu-sync prefill` / `tpu-sync decode` with the TPU engines' RPA v3
#      layouts (`order=rpa3`, and `rpa3hd64` with llama-3.2-1b, head_dim 64), resharded between
#      block sizes, every element verified on the decode's device. On a TPU the buffers are
#      tiled: tpu-sync refuses tiled RPA v3 buffers today (the layout named in the error), so
#      this step is expected to report that refusal until tiled layouts are mapped; the script
#      records what libtpu reports as the buffers' layout either way.
#   4. The same P/D with the layouts of the GPU engines (`order=nhd`), which need no tiling map.
#
# Usage (on the TPU VM, from the repository root, with a Rust toolchain or a built binary):
#   pip install libtpu            # or set TPU_SYNC_PJRT_PLUGIN=/path/to/libtpu.so
#   cargo build --release -p tpu-sync-cli   # or set TPU_SYNC_BIN
#   bash benches/tpu/run.sh
# Environment: TPU_SYNC_PJRT_PLUGIN (libtpu.so), TPU_SYNC_BIN (the tpu-sync binary), OUT (output
# folder), TOKENS (default 4096), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ "${TPU_SYNC_TPU_VM:-}" != 1 ] && ! ls /dev/accel* >/dev/null 2>&1 && ! ls /dev/vfio/[0-9]* >/dev/null 2>&1; then
    echo "benches/tpu/run.sh: no TPU chips on this machine (/dev/accel*, /dev/vfio/N); refusing to load libtpu" >&2
    echo "(it is for a TPU VM only; set TPU_SYNC_TPU_VM=1 to override on one whose devices are elsewhere)" >&2
    exit 2
fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TOKENS=${TOKENS:-4096}
say() { echo "== $*" | tee -a "$OUT/summary.txt"; }

PLUGIN=${TPU_SYNC_PJRT_PLUGIN:-}
if [ -z "$PLUGIN" ]; then
    PLUGIN=$($PY -c 'import libtpu, os; print(os.path.join(os.path.dirname(libtpu.__file__), "libtpu.so"))' 2>/dev/null)
fi
if [ -z "$PLUGIN" ] || [ ! -f "$PLUGIN" ]; then
    echo "no libtpu.so (pip install libtpu, or set TPU_SYNC_PJRT_PLUGIN)" >&2
    exit 2
fi
export TPU_SYNC_PJRT_PLUGIN="$PLUGIN"
BIN=${TPU_SYNC_BIN:-target/release/tpu-sync}
if [ ! -x "$BIN" ]; then
    cargo build --release -p tpu-sync-cli || { echo "no $BIN and the build failed" >&2; exit 2; }
fi
say "plugin $PLUGIN, binary $BIN, output $OUT, $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"

run() { # name, command...: runs it, logs it, records pass/fail
    local name=$1
    shift
    if "$@" >"$OUT/$name.log" 2>&1; then
        say "$name: passed"
    else
        say "$name: FAILED (exit $?; last lines below, whole log in $name.log)"
        tail -n 5 "$OUT/$name.log" | sed 's/^/   /' | tee -a "$OUT/summary.txt"
    fi
}

# 1. What libtpu offers through the PJRT C API.
run info "$BIN" info
grep -Ei "api version|platform|devices|capabilit|memory" "$OUT/info.log" | head -20 | sed 's/^/   /' | tee -a "$OUT/summary.txt"
CHIPS=$(grep -ciE "^\s*device [0-9]+|TPU v|tpu_v" "$OUT/info.log" || true)

# 2. D2H and H2D against memcpy in the same run.
run bench-d2h "$BIN" bench d2h --no-progress
run bench-h2d "$BIN" bench h2d --no-progress
grep -E "ratio|GB/s|GiB/s" "$OUT/bench-d2h.log" "$OUT/bench-h2d.log" | tail -n 12 | sed 's/^/   /' | tee -a "$OUT/summary.txt"

# 3-4. P/D between two processes, each on half of the chips (one chip each on a 2-chip VM).
pd() { # name, prefill spec, decode spec, extra args...
    local name=$1 pspec=$2 dspec=$3
    shift 3
    local n=${CHIPS:-2}
    [ "$n" -ge 2 ] || n=2
    local half=$((n / 2))
    local pchips dchips
    pchips=$(seq -s, 0 $((half - 1)))
    dchips=$(seq -s, "$half" $((2 * half - 1)))
    local port=$((20000 + RANDOM % 20000))
    TPU_VISIBLE_CHIPS=$pchips TPU_PROCESS_BOUNDS=1,1,1 TPU_CHIPS_PER_PROCESS_BOUNDS=1,$half,1 TPU_PROCESS_PORT=8476 \
        "$BIN" prefill --tokens "$TOKENS" --prefill "$pspec" --decode "$dspec" --listen "127.0.0.1:$port" "$@" \
        >"$OUT/$name.prefill.log" 2>&1 &
    local ppid=$!
    sleep 5
    run "$name" env TPU_VISIBLE_CHIPS="$dchips" TPU_PROCESS_BOUNDS=1,1,1 TPU_CHIPS_PER_PROCESS_BOUNDS=1,$half,1 \
        TPU_PROCESS_PORT=8477 "$BIN" decode --tokens "$TOKENS" --prefill "$pspec" --decode "$dspec" \
        --connect "127.0.0.1:$port" "$@"
    wait "$ppid" || say "$name: the prefill process exited with $? (log: $name.prefill.log)"
}
pd pd-rpa3 "tp=1,block=64,order=rpa3" "tp=1,block=32,order=rpa3" --layers 8
pd pd-rpa3hd64 "tp=1,block=64,order=rpa3hd64" "tp=1,block=32,order=rpa3hd64" --preset llama-3.2-1b
pd pd-nhd "tp=1,block=64,order=nhd" "tp=1,block=32,order=nhd" --layers 8
grep -hiE "layout|tiled|T\(" "$OUT"/pd-*.log | sort -u | head -10 | sed 's/^/   /' | tee -a "$OUT/summary.txt"
say "done: $OUT/summary.txt"
