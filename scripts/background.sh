#!/usr/bin/env bash
# A command run in the background while `make test` goes on, and waited for later (make runs each
# recipe line in a shell of its own, so a plain `&` and `wait` cannot span two lines).
#
#   background.sh start NAME CMD [ARG...]   starts CMD in its own process group; its output goes
#                                           to target/bg/NAME.log
#   background.sh until NAME REGEX          waits until a line of that log matches REGEX (an
#                                           extended regex), or the job ended
#   background.sh wait NAME [--quiet]       waits for the job, prints its log (unless --quiet
#                                           and it succeeded) and exits with its exit status
#   background.sh kill NAME                 kills the job's process group (if still running)
#
# Each job has a pid file and, once it ended, an exit-status file under target/bg/. A job that
# is still running when its `make` ends is not waited for by anyone: `make test` always waits
# for what it started.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$root/target/bg"
mkdir -p "$dir"
cmd="${1:-}"
name="${2:-}"
[ -n "$name" ] || { sed -n '2,14p' "$0" >&2; exit 2; }
log="$dir/$name.log"
pidf="$dir/$name.pid"
rcf="$dir/$name.rc"
running() { [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; }
case "$cmd" in
  start)
    shift 2
    [ $# -gt 0 ] || { echo "background.sh start $name: no command" >&2; exit 2; }
    if running; then
      echo "background job $name is already running (pid $(cat "$pidf"))" >&2
      exit 2
    fi
    rm -f "$rcf"
    # setsid: a process group of its own, so that `kill` ends every process of the job.
    setsid -w bash -c 'rc=0; "$@" || rc=$?; echo "$rc" > "'"$rcf"'"; exit "$rc"' bg "$@" \
      > "$log" 2>&1 < /dev/null &
    echo $! > "$pidf"
    echo "background job $name started (pid $!): $* (log: $log)" >&2
    ;;
  until)
    re="${3:?background.sh until NAME REGEX}"
    while running && ! grep -Eq -- "$re" "$log" 2>/dev/null; do sleep 0.2; done
    ;;
  wait)
    if [ ! -f "$pidf" ] && [ ! -f "$rcf" ]; then
      echo "background.sh wait: no job $name was started" >&2
      exit 2
    fi
    t0=$(date +%s)
    while running; do sleep 0.5; done
    rc="$(cat "$rcf" 2>/dev/null || echo 1)"
    if [ "$rc" != 0 ] || [ "${3:-}" != --quiet ]; then
      echo "==== background job $name (exit $rc, waited $(( $(date +%s) - t0 )) s): $log" >&2
      cat "$log"
      echo "==== end of background job $name" >&2
    fi
    rm -f "$pidf"
    exit "$rc"
    ;;
  kill)
    if running; then kill -KILL -- "-$(cat "$pidf")" 2>/dev/null || true; fi
    rm -f "$pidf"
    ;;
  *)
    sed -n '2,14p' "$0" >&2
    exit 2
    ;;
esac
