# tpu-sync: the two commands of the README are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
PLUGIN := $(CURDIR)/.deps/xla-cpu-pjrt/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so
PJRT_INCLUDE := $(CURDIR)/.deps/xla-cpu-pjrt/xla_plugins/xla_cpu_pjrt/include
export TPU_SYNC_PJRT_PLUGIN ?= $(PLUGIN)
export TPU_SYNC_PJRT_INCLUDE ?= $(PJRT_INCLUDE)

.PHONY: all build plugin demo test test-rust lint bench bench-net netns-example clean

all: build

# The XLA CPU PJRT plugin from PyPI, installed into .deps/ (never by hand).
plugin: $(PLUGIN)
$(PLUGIN):
	./scripts/install-pjrt-plugin.sh

build: plugin
	$(CARGO) build --release --workspace

# The main job: llama-3.1-8b KV from a TP=2 x PCP=2 prefill (4 PJRT devices) to a TP=1 x DP=2
# decode (2 PJRT devices) in another process, over TCP, resharded, verified byte by byte.
demo: build
	./target/release/tpu-sync demo $(DEMO_ARGS)

test: plugin
	$(CARGO) build --release --workspace --all-targets
	$(CARGO) test --release --workspace
	./target/release/tpu-sync demo --tokens 512 --layers 4

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

bench: plugin
	$(CARGO) bench --bench device_copy

# Network data plane against one raw TCP socket, pull and push, TCP and QUIC (ratios printed).
bench-net:
	$(CARGO) bench --bench net

# Prefill and decode in two network namespaces (root; skipped otherwise).
netns-example: build
	./examples/netns/run.sh

clean:
	$(CARGO) clean
