#!/usr/bin/env bash
# `make sanitize` (not part of `make test`): memory and thread checkers over what this toolchain
# and machine allow. See docs/security.md ("Sanitizers and leak checks") for what each step
# covers, its suppressions, and measured durations.
#
#   1. valgrind memcheck over every C ABI test and C example (built by `make test-c examples-c`):
#      no invalid reads or writes, no uninitialised values in decisions, no definite leaks.
#   2. valgrind memcheck over the Python package's tests (`make python`): no invalid reads or
#      writes, no definite leaks (uninitialised-value tracking off: see below).
#   3. AddressSanitizer + LeakSanitizer over the library's unit tests and the fault, validation
#      and store tests (RUSTC_BOOTSTRAP=1 on the stable toolchain; std itself is not
#      instrumented).
#   4. ThreadSanitizer over the concurrency tests: needs a nightly toolchain with rust-src (a
#      sound TSan build rebuilds std instrumented with -Zbuild-std); `rustup component add` is
#      tried, and without them the command is printed and the step skipped.
#   5. Miri over the pure modules (layout, planner, wire codec, store keys, index and checksums,
#      data patterns): undefined behaviour, out-of-bounds and alignment errors. Needs the nightly
#      `miri` component (tried as for TSan; skipped with the command printed otherwise).
#
# Environment: SANITIZE_STEPS (default "c python asan tsan miri"), VALGRIND (default valgrind),
# MIRI_CASES (proptest cases per property under Miri, default 4: Miri runs ~1000x slower).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
SUPP=$ROOT/scripts/sanitize/valgrind.supp
VALGRIND=${VALGRIND:-valgrind}
STEPS=${SANITIZE_STEPS:-c python asan tsan miri}
TARGET=x86_64-unknown-linux-gnu
LOGS=$ROOT/target/sanitize
mkdir -p "$LOGS"
fail=0

memcheck() { # name, command... (extra valgrind options in $VG_EXTRA)
  local name=$1
  shift
  local log=$LOGS/$name.valgrind.log
  local t0=$SECONDS
  # shellcheck disable=SC2086
  if "$VALGRIND" --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite \
    --error-exitcode=99 --num-callers=40 --suppressions="$SUPP" ${VG_EXTRA:-} "$@" \
    >"$log" 2>&1; then
    echo "  ok   $name ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY' "$log" | sed 's/^==[0-9]*== //')"
  else
    echo "  FAIL $name (rc $?): see $log"
    grep -E "Invalid|uninitialised|definitely lost|ERROR SUMMARY" "$log" | head -20 || true
    fail=1
  fi
}

# Whether the nightly toolchain has these components (installing them when rustup can).
have_nightly() {
  rustup toolchain list 2>/dev/null | grep -q nightly || return 1
  local c
  for c in "$@"; do
    rustup component list --installed --toolchain nightly 2>/dev/null | grep -q "^$c" ||
      timeout 300 rustup component add "$c" --toolchain nightly >/dev/null 2>&1 || return 1
  done
}

if [[ " $STEPS " == *" c "* ]]; then
  echo "== valgrind memcheck: C ABI tests and C examples"
  export RUST_BACKTRACE=0
  for b in "$ROOT"/target/c/*; do
    [[ -x $b ]] || continue
    memcheck "c-$(basename "$b")" "$b"
  done
fi

if [[ " $STEPS " == *" python "* ]]; then
  echo "== valgrind memcheck: Python tests (PYTHONMALLOC=malloc, --undef-value-errors=no)"
  # CPython 3.11's small-int cache reads a digit of every fresh int before it is set
  # (longobject.c maybe_small_long), which valgrind reports as hundreds of uninitialised-value
  # uses inside the interpreter; tracking is therefore off for this step. Step 1 runs the same
  # library with it on.
  cd bindings/python
  PYTHONMALLOC=malloc VG_EXTRA=--undef-value-errors=no \
    memcheck python-tests "$ROOT/.venv-py/bin/python" -m pytest -q -p no:cacheprovider tests
  cd "$ROOT"
fi

if [[ " $STEPS " == *" asan "* ]]; then
  echo "== AddressSanitizer + LeakSanitizer: library unit tests, fault, validation and store tests"
  export ASAN_OPTIONS=detect_leaks=1:detect_odr_violation=0:abort_on_error=0
  # The fault tests then skip their VmLck and /proc/self/maps accounting (ASan makes mlock a
  # no-op and maps its own regions); fds, sockets and threads are still checked.
  export TPU_SYNC_SANITIZER=asan
  # The validation and store tests are modules of the `integration` test binary, picked by a
  # filter of their own (a filter applies to every binary of one cargo invocation).
  asan_test() {
    RUSTC_BOOTSTRAP=1 RUSTFLAGS="-Zsanitizer=address -Cunsafe-allow-abi-mismatch=sanitizer" \
      cargo test --release --target $TARGET --target-dir target/asan "$@"
  }
  if { asan_test -p tpu-sync --lib -p tpu-sync-cli --test net_chaos &&
    asan_test -p tpu-sync-cli --test integration -- net_validation:: store_faults:: store_basic:: store_race::
  } >"$LOGS/asan.log" 2>&1; then
    echo "  ok   asan: $(grep -c '^test result: ok' "$LOGS/asan.log") test binaries, $(grep -oE '[0-9]+ passed' "$LOGS/asan.log" | awk '{s+=$1} END {print s}') tests"
  else
    echo "  FAIL asan: see $LOGS/asan.log"
    grep -E "ERROR: AddressSanitizer|ERROR: LeakSanitizer|SUMMARY|panicked|FAILED" "$LOGS/asan.log" | head -20 || true
    fail=1
  fi
fi

if [[ " $STEPS " == *" tsan "* ]]; then
  echo "== ThreadSanitizer"
  TSAN_ENV="RUSTFLAGS='-Zsanitizer=thread' RUSTDOCFLAGS='-Zsanitizer=thread'"
  TSAN_TEST="cargo +nightly test -Zbuild-std --release --target $TARGET --target-dir target/tsan"
  TSAN_CMD="$TSAN_ENV $TSAN_TEST -p tpu-sync --lib -p tpu-sync-cli --test net_chaos --test net_faults \
&& $TSAN_ENV $TSAN_TEST -p tpu-sync-cli --test integration -- net_transfer:: device_pacing:: store_race:: store_basic::"
  if have_nightly rust-src; then
    if eval "(export TPU_SYNC_SANITIZER=tsan TSAN_OPTIONS='halt_on_error=1 suppressions=$ROOT/scripts/sanitize/tsan.supp'; $TSAN_CMD)" >"$LOGS/tsan.log" 2>&1; then
      echo "  ok   tsan"
    else
      echo "  FAIL tsan: see $LOGS/tsan.log"
      fail=1
    fi
  else
    echo "  SKIPPED: no nightly toolchain with rust-src here. ThreadSanitizer is only sound with"
    echo "  std rebuilt instrumented (-Zbuild-std needs rust-src); without it every Mutex/Arc in std"
    echo "  is invisible to TSan and it reports false races. Where available, run:"
    echo "    $TSAN_CMD"
  fi
fi

if [[ " $STEPS " == *" miri "* ]]; then
  echo "== Miri: pure modules (layout, plan, wire, store key/index/checksum, pattern)"
  MIRI_FILTERS="layout:: plan:: wire:: store::key:: store::index:: store::checksum:: pattern::"
  MIRI_CMD="PROPTEST_CASES=${MIRI_CASES:-4} MIRIFLAGS=-Zmiri-disable-isolation cargo +nightly miri test -p tpu-sync --lib -- $MIRI_FILTERS"
  if have_nightly rust-src miri; then
    if eval "$MIRI_CMD" >"$LOGS/miri.log" 2>&1; then
      echo "  ok   miri: $(grep -oE '[0-9]+ passed' "$LOGS/miri.log" | tail -1) tests"
    else
      echo "  FAIL miri: see $LOGS/miri.log"
      grep -E "Undefined Behavior|error:|panicked|FAILED" "$LOGS/miri.log" | head -20 || true
      fail=1
    fi
  else
    echo "  SKIPPED: no nightly toolchain with the miri component here. Where available, run:"
    echo "    $MIRI_CMD"
  fi
fi

if [[ $fail -ne 0 ]]; then
  echo "sanitize: FAILED"
  exit 1
fi
echo "sanitize: all steps passed (logs in $LOGS)"
