#!/usr/bin/env bash
# The engine test environments (.venv-vllm, .venv-sglang: scripts/install-vllm.sh and
# scripts/install-sglang.sh) installed in the background while `make test` builds and runs the
# Rust, C and Python suites: the installs are mostly downloads and unpacking, the build is CPU,
# so on a clean clone the two overlap instead of adding up.
#
#   engine-envs.sh start   starts the installs in the background (log: target/engine-envs.log)
#   engine-envs.sh wait    waits for them; prints the log's tail if they failed (the make
#                          targets vllm-env and sglang-env then run the same idempotent
#                          installers in the foreground, which retry and show the error)
#
# Both installers are idempotent (a stamp per venv), so a second start, or a start after a
# finished install, costs a few seconds. Needs .deps/tools (scripts/bootstrap-python.sh) made
# first: `make test` makes it through its `plugin` prerequisite before `start`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$root/target"
log="$dir/engine-envs.log"
pidf="$dir/engine-envs.pid"
rcf="$dir/engine-envs.rc"
mkdir -p "$dir"
case "${1:-}" in
  start)
    "$root/scripts/bootstrap-python.sh" >/dev/null
    rm -f "$rcf"
    (
      t0=$(date +%s)
      rc=0
      "$root/scripts/install-vllm.sh" || rc=$?
      t1=$(date +%s)
      [ "$rc" -ne 0 ] || "$root/scripts/install-sglang.sh" || rc=$?
      t2=$(date +%s)
      echo "engine envs: vLLM $((t1 - t0)) s, SGLang $((t2 - t1)) s, exit $rc"
      echo "$rc" > "$rcf"
    ) > "$log" 2>&1 < /dev/null &
    echo $! > "$pidf"
    echo "engine test environments installing in the background (pid $!, log $log)" >&2
    ;;
  wait)
    if [ -f "$pidf" ]; then
      pid="$(cat "$pidf")"
      t0=$(date +%s)
      while kill -0 "$pid" 2>/dev/null; do sleep 1; done
      rm -f "$pidf"
      echo "engine test environments: waited $(( $(date +%s) - t0 )) s; $(tail -n 1 "$log" 2>/dev/null)" >&2
      if [ "$(cat "$rcf" 2>/dev/null || echo 1)" != 0 ]; then
        echo "background install failed (retried in the foreground next); its log ends:" >&2
        tail -n 20 "$log" >&2 || true
      fi
    fi
    ;;
  *)
    echo "usage: $0 start|wait" >&2
    exit 2
    ;;
esac
