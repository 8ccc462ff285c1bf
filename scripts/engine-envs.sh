#!/usr/bin/env bash
# The engine test environments (.venv-vllm, .venv-vllm-0.29.0, .venv-sglang: scripts/install-vllm.sh and
# scripts/install-sglang.sh) installed in the background while `make test` builds and runs the
# Rust, C and Python suites: the installs are mostly downloads and unpacking, the build is CPU,
# so on a clean clone the two overlap instead of adding up.
#
#   engine-envs.sh start   starts the installs in the background (scripts/background.sh job
#                          engine-envs; log: target/bg/engine-envs.log)
#   engine-envs.sh wait    waits for them; prints the log's tail if they failed (the make
#                          targets vllm-env and sglang-env then run the same idempotent
#                          installers in the foreground, which retry and show the error)
#   engine-envs.sh install both installs in the foreground, timed (what the job runs)
#
# Both installers are idempotent (a stamp per venv), so a second start, or a start after a
# finished install, costs a few seconds. Needs .deps/tools (scripts/bootstrap-python.sh) made
# first: `make test` makes it through its `plugin` prerequisite before `start`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
case "${1:-}" in
  start)
    "$root/scripts/bootstrap-python.sh" >/dev/null
    "$root/scripts/background.sh" start engine-envs "$0" install
    ;;
  install)
    t0=$(date +%s)
    "$root/scripts/install-vllm.sh"
    t1=$(date +%s)
    VLLM_VERSION=0.29.0 "$root/scripts/install-vllm.sh"
    t2=$(date +%s)
    "$root/scripts/install-sglang.sh"
    echo "engine envs: vLLM $((t1 - t0)) s, vLLM 0.29 $((t2 - t1)) s, SGLang $(( $(date +%s) - t2 )) s"
    ;;
  wait)
    if ! "$root/scripts/background.sh" wait engine-envs --quiet > /dev/null; then
      echo "background install failed (retried in the foreground next); its log ends:" >&2
      tail -n 20 "$root/target/bg/engine-envs.log" >&2 || true
    fi
    ;;
  *)
    echo "usage: $0 start|wait|install" >&2
    exit 2
    ;;
esac
