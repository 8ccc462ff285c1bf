#!/usr/bin/env bash
# tpu-sync against its peers, side by side, on this machine, loopback, in one window:
#   * tpu-sync: `tpu-sync bench net` (pull and push through net::Endpoint to/from a separate
#     process, and one raw TCP socket between the same processes as the baseline);
#   * Mooncake Transfer Engine over TCP (`transfer_engine_bench` from the PyPI wheel
#     mooncake-transfer-engine-non-cuda; P2P handshake, no metadata server; read and write,
#     batched, the tool's own throughput figure);
#   * NIXL over UCX/TCP (nixl-cu12 from PyPI, installed --no-deps: its Python API runs UCX over
#     TCP without torch; benches/peers/nixl_bench.py, read and write between two processes,
#     two progress configurations, the better one per size).
# Same sizes for all (64 KiB, 1 MiB, 16 MiB, 64 MiB), systems interleaved round-robin: each round
# runs every tool once, ROUNDS rounds, then the median over rounds is reported with min..max.
# Writes peers.md (the table, ratios against the best peer) and peers.svg (GB/s against size, one
# line per system) into OUT (default target/peers), and the raw results next to them.
#
# Not part of `make test`. Installs what it needs: Debian packages libibverbs1, libnl-3-200,
# libnl-route-3-200, librdmacm1, libnuma1 (Mooncake's libraries link them even for TCP), and a
# cached virtualenv .venv-peers (uv) with the two wheels and numpy.
#
# Environment: ROUNDS (default 3), SIZES (bytes, comma-separated), OUT, MOONCAKE_SECONDS (per
# size and operation, default 2), TRANSPORTS (tpu-sync transports, default tcp).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
ROUNDS=${ROUNDS:-3}
SIZES=${SIZES:-65536,1048576,16777216,67108864}
OUT=${OUT:-$root/target/peers}
MC_SECONDS=${MOONCAKE_SECONDS:-2}
TRANSPORTS=${TRANSPORTS:-tcp}
mkdir -p "$OUT"
say() { echo "== $*" >&2; }

# 1. Debian libraries (Mooncake's engine links RDMA and NUMA libraries even for TCP).
need=()
for p in libibverbs1 libnl-3-200 libnl-route-3-200 librdmacm1 libnuma1; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  say "apt-get install ${need[*]}"
  if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get install -y -q "${need[@]}" >&2 ||
    { $sudo apt-get update -q >&2 && $sudo apt-get install -y -q "${need[@]}" >&2; }
fi

# 2. The peers' virtualenv (cached).
venv="$root/.venv-peers"
py="$venv/bin/python"
if ! "$py" -c 'import mooncake, nixl_cu12, numpy' >/dev/null 2>&1; then
  say "creating $venv"
  uv="$("$root/scripts/bootstrap-python.sh")/bin/uv"
  "$uv" venv -q "$venv"
  "$uv" pip install -q --python "$py" mooncake-transfer-engine-non-cuda numpy
  "$uv" pip install -q --python "$py" --no-deps nixl-cu12
fi
site="$("$py" -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))')"
mc="$site/transfer_engine_bench"
[ -x "$mc" ] || { echo "no transfer_engine_bench in the mooncake wheel ($mc)" >&2; exit 1; }

# 3. tpu-sync.
if [ ! -x target/release/tpu-sync ] || [ -n "${REBUILD:-}" ]; then
  say "cargo build --release"
  cargo build --release -q
fi
tpu=target/release/tpu-sync

IFS=, read -r -a sizes <<<"$SIZES"
: >"$OUT/mooncake.jsonl"
: >"$OUT/nixl.jsonl"

mooncake_round() {
  local r=$1 log="$OUT/mooncake-target.log"
  "$mc" --mode=target --metadata_server=P2PHANDSHAKE --local_server_name=127.0.0.1 \
    --protocol=tcp --buffer_size=$((256 << 20)) --logtostderr >"$log" 2>&1 &
  local tpid=$!
  local port=""
  for _ in $(seq 100); do
    port=$(grep -o 'listening on 127.0.0.1:[0-9]*' "$log" | head -1 | cut -d: -f2 || true)
    [ -n "$port" ] && break
    sleep 0.1
  done
  if [ -z "$port" ]; then
    echo "mooncake target did not report its RPC port:" >&2; tail -5 "$log" >&2
    kill "$tpid" 2>/dev/null || true; wait "$tpid" 2>/dev/null || true
    return 1
  fi
  for n in "${sizes[@]}"; do
    # One batch of up to 128 blocks, at most 64 MiB, inside the 256 MiB buffer.
    local batch=$(( (64 << 20) / n ))
    [ "$batch" -lt 1 ] && batch=1
    [ "$batch" -gt 128 ] && batch=128
    for op in read write; do
      local line
      line=$("$mc" --mode=initiator --metadata_server=P2PHANDSHAKE --local_server_name=127.0.0.1 \
        --segment_id="127.0.0.1:$port" --protocol=tcp --operation=$op --block_size="$n" \
        --batch_size=$batch --threads=1 --buffer_size=$((256 << 20)) --duration="$MC_SECONDS" \
        --report_unit=GB --logtostderr 2>&1 | grep -o 'throughput [0-9.]* GB/s' | tail -1 || true)
      local gbps=${line#throughput }
      gbps=${gbps% GB/s}
      echo "{\"round\": $r, \"system\": \"mooncake_$op\", \"bytes\": $n, \"batch\": $batch, \"gbps\": ${gbps:-null}}" >>"$OUT/mooncake.jsonl"
    done
  done
  kill "$tpid" 2>/dev/null || true
  wait "$tpid" 2>/dev/null || true
}

nixl_round() {
  local r=$1
  # Two progress configurations (UCX over TCP is erratic on few, shared cores): the initiator
  # polls, the target either runs NIXL's progress thread or polls too.
  for cfg in "thread" "poll"; do
    local tt=1 tp=0
    [ "$cfg" = poll ] && { tt=0; tp=1; }
    local before want got
    before=$(wc -l <"$OUT/nixl.jsonl" 2>/dev/null || echo 0)
    want=$(($(echo "$SIZES" | tr ',' '\n' | wc -l) * 2))
    UCX_TLS=tcp UCX_NET_DEVICES=lo NIXL_BENCH_PROG_THREAD=0 NIXL_BENCH_TARGET_PROG_THREAD=$tt \
      NIXL_BENCH_POLL=$tp timeout 600 "$py" benches/peers/nixl_bench.py --sizes "$SIZES" \
      --rounds 3 2>"$OUT/nixl-$cfg.err" |
      "$py" -c "import json, sys
for l in sys.stdin:
    d = json.loads(l); d['round'] = $r; d['config'] = '$cfg'; print(json.dumps(d))" >>"$OUT/nixl.jsonl" ||
      {
        # NIXL 0.x over UCX/TCP can crash in its teardown after the last result was printed:
        # the results are kept; only a run that reported fewer sizes is a failure.
        got=$(($(wc -l <"$OUT/nixl.jsonl") - before))
        if [ "$got" -ge "$want" ]; then
          echo "nixl ($cfg) exited with an error after reporting all $got results (kept)" >&2
        else
          echo "nixl ($cfg) failed after $got of $want results:" >&2
          tail -5 "$OUT/nixl-$cfg.err" >&2
        fi
      }
  done
}

for r in $(seq "$ROUNDS"); do
  say "round $r/$ROUNDS (load $(cut -d' ' -f1 /proc/loadavg)): tpu-sync"
  "$tpu" bench net --sizes "$SIZES" --transports "$TRANSPORTS" --rounds 3 --no-progress \
    --json "$OUT/tpu-sync-$r.json" >"$OUT/tpu-sync-$r.txt"
  say "round $r/$ROUNDS: mooncake"
  mooncake_round "$r"
  say "round $r/$ROUNDS: nixl"
  nixl_round "$r"
done

# 4. One table and one plot.
"$py" - "$OUT" "$ROUNDS" <<'PYEOF'
import glob, json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
gb = {}  # (system, bytes) -> [GB/s per round]
for f in sorted(glob.glob(os.path.join(out, "tpu-sync-*.json"))):
    for row in json.load(open(f))["throughput"]:
        gb.setdefault(("tpu-sync " + row["system"], row["bytes"]), []).append(row["gbps"])
for l in open(os.path.join(out, "mooncake.jsonl")):
    d = json.loads(l)
    if d["gbps"] is not None:
        gb.setdefault(("mooncake " + d["system"].split("_")[1] + " (batched)", d["bytes"]), []).append(d["gbps"])
nixl = {}
for l in open(os.path.join(out, "nixl.jsonl")):
    d = json.loads(l)
    s = sorted(d["samples_s"])
    nixl.setdefault((d["system"], d["bytes"], d["round"]), []).append(d["bytes"] / s[len(s) // 2] / 1e9)
for (sys_, n, r), v in nixl.items():
    gb.setdefault(("nixl " + sys_.split("_")[1] + " (UCX-TCP, best config)", n), []).append(max(v))
sizes = sorted({n for (_, n) in gb})
systems = []
for (s, _) in gb:
    if s not in systems:
        systems.append(s)
order = lambda s: (0 if s.startswith("tpu-sync raw") else 1 if s.startswith("tpu-sync") else 2, s)
systems.sort(key=order)
def fmt(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
med = {k: statistics.median(v) for k, v in gb.items()}
peers = [s for s in systems if not s.startswith("tpu-sync")]
lines = ["| GB/s (median of %d rounds; min..max) | %s |" % (rounds, " | ".join(fmt(n) for n in sizes)),
         "|---|" + "---|" * len(sizes)]
for s in systems:
    cells = []
    for n in sizes:
        v = gb.get((s, n))
        cells.append("-" if not v else f"{statistics.median(v):.2f} ({min(v):.2f}..{max(v):.2f})")
    lines.append(f"| {s} | " + " | ".join(cells) + " |")
best = {n: max([med[(p, n)] for p in peers if (p, n) in med] or [float("nan")]) for n in sizes}
for s in systems:
    if s.startswith("tpu-sync") and "raw" not in s:
        cells = [f"{med[(s, n)] / best[n]:.2f}" if (s, n) in med and best[n] == best[n] else "-" for n in sizes]
        lines.append(f"| {s} / best peer | " + " | ".join(cells) + " |")
table = "\n".join(lines)
print(table)
open(os.path.join(out, "peers.md"), "w").write(table + "\n")
# A report in `tpu-sync bench --json` form, for `tpu-sync bench --replot` to draw.
rows = []
for s in systems:
    for n in sizes:
        v = gb.get((s, n))
        if not v:
            continue
        rows.append({"scenario": "peers", "system": s, "baseline": "tpu-sync raw_tcp",
                     "size_kind": "transfer", "size": n, "size_label": fmt(n), "bytes": n,
                     "rounds": len(v), "reps": 1, "min_s": n / max(v) / 1e9,
                     "median_s": n / statistics.median(v) / 1e9, "max_s": n / min(v) / 1e9,
                     "gbps": statistics.median(v), "gbps_min": min(v), "gbps_max": max(v),
                     "ratio": 0.0})
json.dump({"scenarios": [["peers", "tpu-sync vs Mooncake TE (TCP) vs NIXL (UCX over TCP), loopback, two processes each"]],
           "throughput": rows}, open(os.path.join(out, "peers.json"), "w"), indent=1)
PYEOF
"$tpu" bench all --replot "$OUT/peers.json" --plot "$OUT/peers.svg" >/dev/null
say "wrote $OUT/peers.md and $OUT/peers.svg"
