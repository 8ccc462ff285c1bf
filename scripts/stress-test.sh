#!/usr/bin/env bash
# Runs the Rust and Python suites ROUNDS times (default 5) while a CPU hog keeps every core busy
# (one busy loop per core at normal priority: the tests compete for the CPU as they would beside
# an engine's own threads), and reports each round. Exits non-zero if any round failed.
#
#   scripts/stress-test.sh [ROUNDS]        (or: make stress STRESS_ROUNDS=N)
#
# Environment: STRESS_HOGS (busy loops, default: the number of cores), STRESS_SUITES (default
# "rust python"; "rust" alone skips the Python suite). Logs go to target/stress/round-N-SUITE.log.
# Build first (`make test` or `make build python`); this script only runs tests.
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-${STRESS_ROUNDS:-5}}
HOGS=${STRESS_HOGS:-$(nproc)}
SUITES=${STRESS_SUITES:-rust python}
CARGO=${CARGO:-cargo}
OUT=target/stress
mkdir -p "$OUT"
export TPU_SYNC_PJRT_PLUGIN=${TPU_SYNC_PJRT_PLUGIN:-$PWD/.deps/xla-cpu-pjrt/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so}
export TPU_SYNC_PJRT_INCLUDE=${TPU_SYNC_PJRT_INCLUDE:-$PWD/.deps/xla-cpu-pjrt/xla_plugins/xla_cpu_pjrt/include}

pids=()
stop_hogs() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap stop_hogs EXIT
for _ in $(seq "$HOGS"); do
  ( while :; do :; done ) &
  pids+=("$!")
done
echo "stress: $ROUNDS rounds of [$SUITES] beside $HOGS busy loops on $(nproc) cores"

failed=0
for r in $(seq "$ROUNDS"); do
  for s in $SUITES; do
    log="$OUT/round-$r-$s.log"
    t0=$(date +%s)
    case $s in
      rust) $CARGO test --release --workspace >"$log" 2>&1 ;;
      python) (cd bindings/python && ../../.venv-py/bin/python -m pytest -q -p no:cacheprovider tests) >"$log" 2>&1 ;;
      *) echo "unknown suite $s" >"$log"; false ;;
    esac
    rc=$?
    t=$(( $(date +%s) - t0 ))
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    if [ $rc -eq 0 ]; then
      if [ "$s" = rust ]; then
        summary=$(awk '/^test result:/ {b++; p+=$4; f+=$6} END {printf "%d binaries, %d passed, %d failed", b, p, f}' "$log")
      else
        summary=$(grep -E "passed|failed" "$log" | tail -1)
      fi
      echo "round $r $s: ok in ${t}s (load $load) $summary"
    else
      failed=$((failed + 1))
      echo "round $r $s: FAILED (exit $rc) in ${t}s (load $load); log $log:"
      grep -E "^(test .* FAILED|FAILED|failures:|---- )|panicked|Error" "$log" | head -20 | sed 's/^/    /'
    fi
  done
done
if [ $failed -eq 0 ]; then
  echo "stress: $ROUNDS of $ROUNDS rounds passed"
else
  echo "stress: $failed suite runs failed over $ROUNDS rounds"
  exit 1
fi
