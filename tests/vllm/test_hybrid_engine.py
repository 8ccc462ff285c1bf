"""Engine tests of TpuSyncConnector with a hybrid model: real vLLM engines (CPU backend, greedy)
on the tiny sliding-window Llama (``build_tiny_hybrid.py --kind sliding``: layer 0 sliding
window of 48 tokens, layer 1 full attention), for which vLLM's hybrid allocator makes two KV
cache groups with their own block tables. P/D (producer + consumer engine) and host-tier
offload (store, then load in a second pass) are token-identical to a plain engine, and the
handed-off block ids are per group (the sliding group only its window's blocks).

The tiny granite-4.0-h style Mamba2 hybrid (``build_tiny_hybrid.py --kind granite``: layer 0
Mamba2, layer 1 attention; vLLM makes a ``MambaSpec`` state group and a full-attention group of
block size 64): P/D is token-identical to a plain engine. The producer prefills the prompt less
its last token and hands off the attention blocks and the state slot; the consumer computes the
last prompt token from that state. Offload is refused at start for this model (docs/vllm.md).

Kept short: two prompts, 8 new tokens. What vLLM's CPU backend runs and what the connector
moves is in docs/vllm.md ("Hybrid models").
"""

import os

import pytest
from tpu_sync.vllm._api import reports_failed_recving

from conftest import SLIDING_WINDOW
from test_cluster_engines import etcd  # noqa: F401  (fixture)
from test_engine import BACKEND, Engines, cached, cached_by, toks

WINDOW = SLIDING_WINDOW
BS = 32
# 107 tokens: the window [60, 107) spans blocks 1..3; 70 tokens: [23, 70) spans blocks 0..2;
# 80 tokens: [33, 80) spans blocks 1..2. A layer-wise consumer computes from token 96, 64, 64
# (block-aligned, short of the last token): the windows of 96 and 64 tokens start in the
# producer's first held block for 107 and 70 tokens, but that of 64 ([17, 64), block 0) is
# before the producer's window of 80 tokens: that request is pulled whole.
LENS = (107, 70, 80)
LAYERWISE_FROM = (96, 64, None)
PROMPTS = [[(i * 131 + 17 * k) % 1000 + 3 for i in range(n)] for k, n in enumerate(LENS)]
MAX_TOKENS = 8
SHM = f"tpusync-vllm-hybrid-{os.getpid()}"

pytestmark = pytest.mark.skipif(BACKEND == "ref", reason="the reference backends move uniform caches only")


@pytest.fixture(scope="module")
def sliding_model(workdir):
    from conftest import model

    return model(workdir, "tiny-sliding")


@pytest.fixture(scope="module")
def engines(workdir, sliding_model):
    e = Engines(workdir, sliding_model)
    e.spec = lambda **kw: dict(model=sliding_model, prompts=PROMPTS, max_tokens=MAX_TOKENS, **kw)
    return e


@pytest.fixture(scope="module")
def plain(engines):
    res = engines.run("hybrid_plain", engines.spec())
    assert all(len(t) == MAX_TOKENS for t in toks(res))
    assert len({tuple(t) for t in toks(res)}) == len(PROMPTS), "the model must not be degenerate"
    return res


def test_hybrid_pd_decode_matches_plain(engines, plain):
    hold = os.path.join(engines.dir, "hybrid_pd.hold")
    if os.path.exists(hold):
        os.remove(hold)
    prod = engines.start("hybrid_pd_producer", engines.spec(
        remote_decode=True, hold_file=hold, connector=dict(kv_role="kv_producer", extra=dict(lease_s=120.0))))
    cons = engines.start("hybrid_pd_consumer", engines.spec(
        params_file=prod.out, connector=dict(kv_role="kv_consumer", policy="fail", extra=dict(pull_timeout_s=60.0))))
    try:
        c = engines.finish(cons)
    finally:
        open(hold, "w").close()
    p = engines.finish(prod)
    assert [t[:1] for t in toks(plain)] == toks(p)
    params = [o["kv_transfer_params"] for o in p["runs"][0]["outputs"]]
    # Two groups: the sliding window's blocks (3 of 4 for 107 tokens, 3 of 3 for 70, 2 of 3
    # for 80), every block of the full-attention group.
    assert [[len(g) for g in x["remote_block_ids"]] for x in params] == [[3, 4], [3, 3], [2, 3]], params
    assert [g["sliding_window"] for g in params[0]["remote_geometry"]["groups"]] == [WINDOW, None]
    assert p["worker_stats"]["registered"] == len(LENS)
    assert toks(c) == toks(plain)
    m = c["metrics"]
    assert cached_by(m, "p2p") == sum(LENS), m
    assert c["worker_stats"]["pulls_done"] == len(LENS) and c["worker_stats"]["pulls_failed"] == 0


def test_hybrid_offload_second_pass_hits_host_tier(engines, plain):
    res, want = offload_twice(engines, plain, "hybrid_offload", SHM)
    assert cached(res, 0) == [0] * len(LENS)
    assert res["worker_stats"]["saved_blocks"] == sum(n // BS for n in LENS)
    assert res["worker_stats"]["loaded_blocks"] == sum(want) // BS
    assert res["scheduler_stats"]["failed_loads"] == 0


def run_twice_with_tier(engines, plain, tag, shm, **extra):
    """One engine with the host tier (segment ``shm``, removed after) running the prompts twice,
    both passes token-identical to plain. Returns the result."""
    try:
        res = engines.run(tag, engines.spec(repeat=2, connector=dict(
            kv_role="kv_both", policy="recompute", extra=dict(shm_name=shm, host_capacity_bytes=64 << 20, **extra))))
    finally:
        import tpu_sync

        try:
            tpu_sync.remove_segment(shm, force=True)
        except Exception:
            pass
    assert toks(res, 0) == toks(plain) and toks(res, 1) == toks(plain)
    return res


def offload_twice(engines, plain, tag, shm, **extra):
    """:func:`run_twice_with_tier`, the second pass's cached tokens the host tier's (every full
    block before the last prompt token). Returns (result, cached tokens per prompt)."""
    res = run_twice_with_tier(engines, plain, tag, shm, **extra)
    want = [(n - 1) // BS * BS for n in LENS]
    assert cached(res, 1) == want
    return res, want


#: vLLM 0.29 (vLLM-TorchTPU's base) has no failed_recving, and its scheduler raises on load
#: errors of a model with several KV cache groups (docs/vllm.md, "Hybrid models").
needs_failed_recving = pytest.mark.skipif(not reports_failed_recving(),
                                          reason="this vLLM cannot take a hybrid model's load failures")


@needs_failed_recving
def test_hybrid_failed_host_tier_loads_are_recomputed(engines, plain):
    """Host-tier loads that fail (every read of the tier fails: ``ref_backends.FailingReadsTier``)
    with two KV cache groups: vLLM 0.32 refuses block-level load errors from such a model (its
    block ids are per group), so the connector answers these loads as asynchronous and reports
    a failure by request (``failed_recving``); vLLM recomputes them. Both passes are
    token-identical to plain, and the engine keeps serving."""
    res = run_twice_with_tier(engines, plain, "hybrid_offload_failing", SHM + "-failing",
                              host_tier="ref_backends:FailingReadsTier")
    # Every request of the second pass hit the tier (each full block before its last token) and
    # failed its load.
    assert res["worker_stats"]["failed_loads"] == len(LENS), res["worker_stats"]
    assert res["worker_stats"]["loaded_blocks"] == 0
    assert res["scheduler_stats"]["failed_loads"] == len(LENS), res["scheduler_stats"]
    assert res["scheduler_stats"]["host_hit_tokens"] == sum((n - 1) // BS * BS for n in LENS)


@needs_failed_recving
def test_hybrid_pd_failed_pull_is_recomputed(engines, plain):
    """A P/D pull that fails (the producer has exited and closed its endpoints) with two KV cache
    groups and ``kv_load_failure_policy`` recompute: reported by request (``failed_recving``;
    vLLM 0.32 refuses block-level load errors from such a model), recomputed by the consumer,
    token-identical to plain."""
    hold = os.path.join(engines.dir, "hybrid_pd_gone.hold")
    open(hold, "w").close()  # the producer does not wait for the consumer: it exits at once
    p = engines.run("hybrid_pd_gone_producer", engines.spec(
        remote_decode=True, hold_file=hold, connector=dict(kv_role="kv_producer", extra=dict(lease_s=120.0))))
    c = engines.run("hybrid_pd_gone_consumer", engines.spec(
        params_file=os.path.join(engines.dir, "hybrid_pd_gone_producer.json"),
        connector=dict(kv_role="kv_consumer", policy="recompute", extra=dict(pull_timeout_s=10.0))))
    assert all(o["kv_transfer_params"] for o in p["runs"][0]["outputs"])
    assert toks(c) == toks(plain)
    assert c["worker_stats"]["pulls_failed"] == len(LENS) and c["worker_stats"]["pulls_done"] == 0, c["worker_stats"]
    # (vLLM's own cached-tokens metric counts the answered hits before the pulls fail.)
    assert c["scheduler_stats"]["p2p_failed_tokens"] == sum(LENS), c["scheduler_stats"]
    assert c["scheduler_stats"]["p2p_tokens"] == 0, c["scheduler_stats"]


def test_hybrid_second_engine_loads_the_first_engines_prefixes(engines, plain, etcd):
    """The cluster tier with two KV cache groups: engine A (host tier, cluster on) serves the
    prompts and publishes its blocks; engine B (an empty tier of its own) serves the same
    prompts and loads their prefixes from A (a peer of its layout: each entry holds a block
    position of every group) through host memory, writing each group's blocks (the sliding
    group only those it holds). Same cached tokens as a local host-tier hit, token-identical to
    plain; B stores what it fetched."""
    from test_cluster_engines import cluster_spec, serving_engine_a

    with serving_engine_a(engines, plain, etcd, "hybrid_cluster_a", "hybrid-a", sum(n // BS for n in LENS)):
        res_b = engines.run("hybrid_cluster_b", cluster_spec(engines, etcd, "hybrid-b"))
        want = [(n - 1) // BS * BS for n in LENS]
        assert cached(res_b) == want, "engine B must load A's prefixes as host-tier hits"
        assert toks(res_b) == toks(plain)
        assert res_b["tier_stats"]["remote_blocks"] == sum(want) // BS
        assert res_b["tier_stats"]["remote_loads"] == len(LENS)
        assert res_b["worker_stats"]["loaded_blocks"] == sum(want) // BS
        assert res_b["scheduler_stats"]["failed_loads"] == 0


#: bytes per element of the torch dtypes the CPU engines' KV caches use
ELEM = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4}


def _layer_block_bytes(st):
    n = 1
    for d in st["shape"][1:]:
        n *= int(d)
    return n * ELEM[st["dtype"]]


def test_hybrid_pd_through_torch_copies_matches_plain(engines, plain):
    """Two KV cache groups with both sides' tensors reached through torch's own copies
    (``torch_backend`` ``framework-copy``, what vLLM-TorchTPU's torch_tpu tensors get): the
    producer stages each layer at its own group's held blocks only (the sliding layer 3, 3, 2
    blocks, the full one 4, 3, 3), the consumer copies each pulled block into its own group's
    layer. Token-identical to plain."""
    extra = dict(torch_backend="framework-copy", torch_copy_api="torch")
    p, c = engines.pd("hybrid_pd_copy", engines.spec(connector=dict(kv_role="kv_producer", extra=dict(
        lease_s=120.0, **extra))), engines.spec(connector=dict(kv_role="kv_consumer", policy="fail", extra=dict(
            pull_timeout_s=60.0, **extra))))
    assert [t[:1] for t in toks(plain)] == toks(p)
    params = [o["kv_transfer_params"] for o in p["runs"][0]["outputs"]]
    assert [[len(g) for g in x["remote_block_ids"]] for x in params] == [[3, 4], [3, 3], [2, 3]], params
    assert p["worker_stats"]["registered"] == len(LENS) and p["worker_stats"]["register_failed"] == 0
    assert toks(c) == toks(plain)
    assert c["worker_stats"]["pulls_done"] == len(LENS) and c["worker_stats"]["pulls_failed"] == 0
    assert cached_by(c["metrics"], "p2p") == sum(LENS), c["metrics"]
    ps, cs = p["adapter_stats"], c["adapter_stats"]
    for st in (ps, cs):
        assert (st["backend"], st["copy_api"]) == ("framework-copy", "torch"), st
    bb = _layer_block_bytes(ps)
    # Staged: each layer's own group's held blocks, nothing of the other group's.
    assert (ps["stages"], ps["d2h_bytes"]) == (len(LENS), (3 + 4 + 3 + 3 + 2 + 3) * bb), ps
    # Committed: the same layer-blocks into the consumer's tensors (one commit per pull), after
    # staging the blocks a pull writes in part: each group's last (every prompt ends inside a
    # block) and the sliding group's first where the window vLLM reads starts inside one (the
    # window of the recomputed token T - 1, tokens T - 48 on: 59 and 22, not 32 for T = 80), so
    # their other token slots come back unchanged.
    assert (cs["commits"], cs["h2d_bytes"]) == (len(LENS), ps["d2h_bytes"]), cs
    assert (cs["stages"], cs["d2h_bytes"]) == (len(LENS), (2 * len(LENS) + 2) * bb), cs


def test_hybrid_offload_through_torch_copies_matches_plain(engines, plain):
    """The host tier with two KV cache groups over tensors reached through torch's copies: the
    first pass saves (each layer staged at its own group's blocks), the second loads (each
    group's blocks copied into its own layers, the sliding group's null blocks skipped); both
    passes token-identical to plain."""
    res, want = offload_twice(engines, plain, "hybrid_offload_copy", SHM + "-copy", torch_backend="framework-copy")
    saved, loaded = sum(n // BS for n in LENS), sum(want) // BS
    assert res["worker_stats"]["saved_blocks"] == saved and res["worker_stats"]["loaded_blocks"] == loaded
    assert res["scheduler_stats"]["failed_loads"] == 0
    st = res["adapter_stats"]
    assert st["backend"] == "framework-copy" and st["d2h_bytes"] > 0 and st["h2d_bytes"] > 0, st


def test_hybrid_layerwise_pd_matches_plain(engines, plain):
    """Layer-wise P/D with two KV cache groups: the producer registers each group's held blocks
    before the prefill's forward and publishes each layer as vLLM saves it; the consumer reads
    each layer (of its group's blocks) as it arrives, or pulls a request whole when its first
    computed token's window is not among the producer's blocks (on vLLM 0.29; on vLLM 0.32 it
    pulls every request whole and asynchronously: ``scheduler.sync_layerwise``).
    Token-identical to plain."""
    hold = os.path.join(engines.dir, "hybrid_pdl.hold")
    if os.path.exists(hold):
        os.remove(hold)
    prod = engines.start("hybrid_pdl_producer", engines.spec(
        remote_decode=True, hold_file=hold,
        connector=dict(kv_role="kv_producer", extra=dict(lease_s=120.0, layerwise=True))))
    cons = engines.start("hybrid_pdl_consumer", engines.spec(
        params_file=prod.out,
        connector=dict(kv_role="kv_consumer", policy="fail", extra=dict(pull_timeout_s=60.0, layerwise=True))))
    try:
        c = engines.finish(cons)
    finally:
        open(hold, "w").close()
    p = engines.finish(prod)
    assert [t[:1] for t in toks(plain)] == toks(p)
    assert p["worker_stats"]["layerwise_registered"] == len(LENS), p["worker_stats"]
    assert p["worker_stats"]["registered"] == len(LENS) and p["worker_stats"]["register_failed"] == 0
    assert p["scheduler_stats"]["handed_off"] == len(LENS)
    assert toks(c) == toks(plain)
    ws, ss = c["worker_stats"], c["scheduler_stats"]
    if reports_failed_recving():
        # vLLM 0.32 refuses block-level load errors of a model with groups: the consumer pulls
        # whole and asynchronously (a failure is reported by request).
        want = list(LENS)
        assert ws["layerwise_pulls"] == 0 and ss["layerwise_whole"] == 0, (ws, ss)
    else:
        want = [n if m is None else m for n, m in zip(LENS, LAYERWISE_FROM)]
        assert ws["layerwise_pulls"] == sum(m is not None for m in LAYERWISE_FROM), ws
        assert ss["layerwise_whole"] == sum(m is None for m in LAYERWISE_FROM), ss
    assert ws["pulls_done"] == len(LENS) and ws["pulls_failed"] == 0, ws
    assert cached_by(c["metrics"], "p2p") == sum(want), c["metrics"]
    assert ss["p2p_tokens"] == sum(want)


def test_hybrid_layerwise_offload_matches_plain(engines, plain):
    """Layer-wise host-tier loads with two KV cache groups: each layer written from its own
    group's block (the sliding group's null blocks skipped); second pass token-identical."""
    res, want = offload_twice(engines, plain, "hybrid_offload_lw", SHM + "-lw", layerwise=True)
    assert res["worker_stats"]["layerwise_loads"] == len(LENS)
    assert res["worker_stats"]["loaded_blocks"] == sum(want) // BS
    assert res["scheduler_stats"]["failed_loads"] == 0


def test_hybrid_pd_reshards_tp1_prefill_into_tp2_decode(engines, plain):
    """Two KV cache groups at different TP: a TP=1 prefill instance hands off to a TP=2 decode
    instance (two worker processes, one KV head each); each decode rank pulls its head slice of
    each group's held blocks. Token-identical to plain."""
    hold = os.path.join(engines.dir, "hybrid_pd_tp2.hold")
    if os.path.exists(hold):
        os.remove(hold)
    # The TP=2 consumer (two worker processes) may take minutes to start on a loaded machine:
    # the producer serves until the consumer is done.
    prod = engines.start("hybrid_pd_tp1_producer", engines.spec(
        remote_decode=True, hold_file=hold, hold_s=900,
        connector=dict(kv_role="kv_producer", extra=dict(lease_s=900.0, decode_tp_size=2))))
    engines_env = dict(engines.env)
    engines.env = dict(engines_env, VLLM_CPU_OMP_THREADS_BIND="0|1")
    try:
        cons = engines.start("hybrid_pd_tp2_consumer", engines.spec(
            tp=2, params_file=prod.out,
            connector=dict(kv_role="kv_consumer", policy="fail", extra=dict(pull_timeout_s=60.0))))
    finally:
        engines.env = engines_env
    try:
        c = engines.finish(cons)
    finally:
        open(hold, "w").close()
    p = engines.finish(prod)
    params = [o["kv_transfer_params"] for o in p["runs"][0]["outputs"]]
    assert all(x["tp_size"] == 1 for x in params)
    assert [[len(g) for g in x["remote_block_ids"]] for x in params] == [[3, 4], [3, 3], [2, 3]], params
    assert toks(c) == toks(plain)
    m = c["metrics"]
    assert cached_by(m, "p2p") == sum(LENS), m
    assert m["vllm:prompt_tokens_by_source{source=external_kv_transfer}"] == sum(LENS), m


# A system prompt of 3 blocks shared by three requests. The first (106 tokens) is pulled whole:
# the consumer's sliding group then holds blocks 1..3 (its window [59, 106)) and both groups
# cache blocks 0..2's tokens (the sliding group blocks 1 and 2, all that the window of a hit of
# 96 tokens, [49, 96), reads), so the next two hit 96 tokens in the local prefix cache.
SYSTEM = [(i * 53 + 7) % 1000 + 3 for i in range(3 * BS)]
SHARED_LENS = (106, 136, 160)
SHARED_PROMPTS = [SYSTEM + [(i * 71 + 41 * k) % 1000 + 5 for i in range(n - len(SYSTEM))]
                  for k, n in enumerate(SHARED_LENS)]
SHARED_WAVES = [[0], [1, 2]]


def _shared_spec(engines, **kw):
    s = engines.spec(**kw)
    s["prompts"] = SHARED_PROMPTS
    return s


def test_hybrid_pd_shared_system_prompt_pulls_only_the_uncached_blocks(engines):
    """A decode instance with prefix caching whose requests share a system prompt, with two KV
    cache groups (sliding window + full attention): the first request is pulled whole, the next
    two hit the system prompt's 3 blocks in the local prefix cache (in both groups) and pull
    only the tokens after it, each group into its own blocks from block 3 on (the placement's
    ``first_token``). Token-identical to a plain engine with prefix caching; the bytes received
    are exactly those of the uncomputed blocks of each group: the sliding group of 136 tokens
    needs blocks 2..4 of its window [89, 136) and pulls 3..4 (block 2 is the hit's), the full
    group blocks 3..4 of 5."""
    plain = engines.run("hybrid_plain_shared", _shared_spec(engines, prefix_caching=True, waves=SHARED_WAVES))
    assert len({tuple(t) for t in toks(plain)}) == len(SHARED_PROMPTS)
    assert cached(plain) == [0, len(SYSTEM), len(SYSTEM)], cached(plain)
    p, c = engines.pd("hybrid_pd_shared", _shared_spec(engines, connector=dict(
        kv_role="kv_producer", extra=dict(lease_s=120.0))), _shared_spec(
            engines, prefix_caching=True, waves=SHARED_WAVES,
            connector=dict(kv_role="kv_consumer", policy="fail", extra=dict(pull_timeout_s=60.0))))
    assert toks(c) == toks(plain)
    hit = len(SYSTEM)
    st = c["scheduler_stats"]
    assert st["p2p_partial"] == 2 and st["p2p_local_hit_tokens"] == 2 * hit, st
    assert st["rejects"] == 0 and st["refused_params"] == 0 and st["window_local"] == 0, st
    assert c["worker_stats"]["pulls_done"] == 3 and c["worker_stats"]["pulls_failed"] == 0
    m = c["metrics"]
    lens = SHARED_LENS
    assert cached_by(m, "p2p") == lens[0] + (lens[1] - hit) + (lens[2] - hit), m
    # Layer-blocks pulled (one layer per group; CPU blocks move whole): 106 tokens whole, the
    # sliding group's window blocks 1..3 and the full group's 0..3; after the hit, blocks 3..4
    # of each group for 136 and for 160 tokens (the sliding window of 160, [113, 160), starts
    # in block 3 anyway).
    params = [o["kv_transfer_params"] for o in p["runs"][0]["outputs"]]
    assert [[len(g) for g in x["remote_block_ids"]] for x in params] == [[3, 4], [3, 5], [2, 5]], params
    geo = params[0]["remote_geometry"]
    elem = {"f32": 4, "bf16": 2, "f16": 2}[geo["dtype"]]
    bb = 2 * geo["num_kv_heads"] * geo["head_dim"] * geo["block_size"] * elem
    assert m["vllm:tpu_sync_bytes_transferred"] == (7 + 4 + 4) * bb, (m["vllm:tpu_sync_bytes_transferred"], bb)


def test_hybrid_offload_after_a_device_prefix_hit_loads_only_the_rest(engines):
    """The host tier behind the device prefix cache with two KV cache groups, requests sharing
    the 3-block system prompt: a first engine computes and saves every full prompt block (the
    system prompt's once); a restarted engine (warm /dev/shm tier) loads the first request's 3
    blocks from the tier, and for the other two, whose system prompt then hits the device prefix
    cache in both groups, only the block after it (block 3 of every group). Token-identical to a
    plain engine with prefix caching."""
    shm = SHM + "-shared"
    spec = _shared_spec(engines, prefix_caching=True, waves=SHARED_WAVES, connector=dict(
        kv_role="kv_both", policy="recompute", extra=dict(shm_name=shm, host_capacity_bytes=64 << 20)))
    try:
        plain = engines.run("hybrid_offload_shared_plain", _shared_spec(engines, prefix_caching=True,
                                                                         waves=SHARED_WAVES))
        first = engines.run("hybrid_offload_shared_1", spec)
        second = engines.run("hybrid_offload_shared_2", spec)
    finally:
        import tpu_sync

        try:
            tpu_sync.remove_segment(shm, force=True)
        except Exception:
            pass
    assert toks(first) == toks(plain) and toks(second) == toks(plain)
    hit = len(SYSTEM)
    lens = SHARED_LENS
    assert first["scheduler_stats"]["host_hit_tokens"] == 0
    assert first["worker_stats"]["saved_blocks"] == lens[0] // BS + sum(n // BS - hit // BS for n in lens[1:])
    # Every full block short of the last prompt token: 96 tokens of 106; 128 of 136 and 160,
    # less the device hit of 96.
    want = [96, 32, 32]
    s = second["scheduler_stats"]
    assert s["host_hit_tokens"] == sum(want) and s["failed_loads"] == 0, s
    assert second["worker_stats"]["loaded_blocks"] == sum(want) // BS
    assert cached(second) == [want[0], hit + want[1], hit + want[2]], cached(second)
    assert cached_by(second["metrics"], "host") == sum(want), second["metrics"]


# Prompt lengths T where the window of the recomputed last prompt token (position T - 1, after
# a whole-prompt load vLLM sets num_computed_tokens = T - 1) starts one block before the
# producer's window of T tokens: (T + 1 - 48) % 32 == 0 for 79 and 111 (windows [31, 79) and
# [63, 111) start in blocks 0 and 1; the producer of 79/111 tokens holds blocks from 1 / 2).
# 100 is off that boundary (both windows start in block 1).
EDGE_LENS = (79, 111, 100)
EDGE_PROMPTS = [[(i * 137 + 29 * k) % 1000 + 5 for i in range(n)] for k, n in enumerate(EDGE_LENS)]


def _edge_spec(engines, **kw):
    s = engines.spec(**kw)
    s["prompts"] = EDGE_PROMPTS
    return s


@pytest.fixture(scope="module")
def edge_plain(engines):
    res = engines.run("hybrid_edge_plain", _edge_spec(engines, logprobs=True))
    assert all(len(t) == MAX_TOKENS for t in toks(res))
    assert len({tuple(t) for t in toks(res)}) == len(EDGE_PROMPTS), "the model must not be degenerate"
    return res


def test_hybrid_pd_window_boundary_matches_plain(engines, edge_plain):
    """Whole-request P/D at prompt lengths where the recomputed last prompt token's window
    reaches one block further back than the producer's held blocks of the whole prompt: the
    consumer prefills those locally and matches a plain engine token for token and in each
    token's logprob."""
    hold = os.path.join(engines.dir, "hybrid_pd_edge.hold")
    if os.path.exists(hold):
        os.remove(hold)
    prod = engines.start("hybrid_pd_edge_producer", _edge_spec(
        engines, remote_decode=True, hold_file=hold, connector=dict(kv_role="kv_producer", extra=dict(lease_s=120.0))))
    cons = engines.start("hybrid_pd_edge_consumer", _edge_spec(
        engines, params_file=prod.out, logprobs=True,
        connector=dict(kv_role="kv_consumer", policy="fail", extra=dict(pull_timeout_s=60.0))))
    try:
        c = engines.finish(cons)
    finally:
        open(hold, "w").close()
    p = engines.finish(prod)
    assert [t[:1] for t in toks(edge_plain)] == toks(p)
    params = [o["kv_transfer_params"] for o in p["runs"][0]["outputs"]]
    # The sliding group's held blocks of T tokens: [T + 1 - 48, T) (blocks 1..2 of 79, 2..3 of
    # 111, 1..3 of 100; vLLM freed the block before them before request_finished).
    assert [x["remote_num_tokens"] for x in params] == list(EDGE_LENS)
    assert [[len(g) for g in x["remote_block_ids"]] for x in params] == [[2, 3], [2, 4], [3, 4]], params
    assert toks(c) == toks(edge_plain)
    # The greedy tokens of the tiny model survive a missing window block (pulled whole, token
    # T - 1 read zeros from vLLM's null block: logprobs measured off by 1e-2 at 79 tokens and
    # 1.5e-4 at 111), the logprobs do not: each sampled token's logprob as the plain engine's.
    lp = [o["logprobs"] for o in c["runs"][0]["outputs"]]
    want = [o["logprobs"] for o in edge_plain["runs"][0]["outputs"]]
    assert all(len(x) == MAX_TOKENS for x in lp)
    diffs = [max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(lp, want)]
    assert max(diffs) <= 1e-5, diffs
    # 79 and 111 tokens are prefilled locally (the producer is told), 100 pulled.
    assert c["scheduler_stats"]["window_local"] == 2, c["scheduler_stats"]
    assert c["worker_stats"]["pulls_done"] == 1 and c["worker_stats"]["pulls_failed"] == 0
    assert c["worker_stats"]["rejects_sent"] == 2, c["worker_stats"]
    assert cached_by(c["metrics"], "p2p") == 100, c["metrics"]


# ---- Mamba2 hybrid (state group + full attention) --------------------------------------------

#: vLLM raises the attention block size to 64 so an attention page holds a Mamba state page.
GRANITE_BS = 64
#: 107 tokens: the producer computes 106 (2 blocks), the consumer the 107th; 64: 63 in 1 block.
GRANITE_LENS = (107, 64)
GRANITE_PROMPTS = [[(i * 97 + 29 * k) % 1000 + 3 for i in range(n)] for k, n in enumerate(GRANITE_LENS)]


@pytest.fixture(scope="module")
def granite_engines(workdir):
    from conftest import model

    path = model(workdir, "tiny-granite")
    e = Engines(workdir, path)
    e.spec = lambda **kw: dict(model=path, prompts=GRANITE_PROMPTS, max_tokens=MAX_TOKENS, **kw)
    return e


@pytest.fixture(scope="module")
def granite_plain(granite_engines):
    res = granite_engines.run("granite_plain", granite_engines.spec())
    assert all(len(t) == MAX_TOKENS for t in toks(res))
    assert len({tuple(t) for t in toks(res)}) == len(GRANITE_PROMPTS), "the model must not be degenerate"
    return res


def test_mamba_hybrid_pd_decode_matches_plain(granite_engines, granite_plain):
    e = granite_engines
    hold = os.path.join(e.dir, "granite_pd.hold")
    if os.path.exists(hold):
        os.remove(hold)
    prod = e.start("granite_pd_producer", e.spec(
        remote_decode=True, hold_file=hold, connector=dict(kv_role="kv_producer", extra=dict(lease_s=120.0))))
    cons = e.start("granite_pd_consumer", e.spec(
        params_file=prod.out, connector=dict(kv_role="kv_consumer", policy="fail", extra=dict(pull_timeout_s=60.0))))
    try:
        c = e.finish(cons)
    finally:
        open(hold, "w").close()
    p = e.finish(prod)
    params = [o["kv_transfer_params"] for o in p["runs"][0]["outputs"]]
    # The producer computed each prompt less its last token: one state slot, and the attention
    # blocks of n - 1 tokens.
    assert [x["remote_num_tokens"] for x in params] == [n - 1 for n in GRANITE_LENS], params
    assert [[len(g) for g in x["remote_block_ids"]] for x in params] == [
        [1, -(-(n - 1) // GRANITE_BS)] for n in GRANITE_LENS], params
    assert [g["kind"] for g in params[0]["remote_geometry"]["groups"]] == ["state", "attention"]
    assert p["scheduler_stats"]["state_truncated"] == len(GRANITE_LENS)
    assert p["worker_stats"]["registered"] == len(GRANITE_LENS)
    # The consumer: token-identical to a plain engine.
    assert toks(c) == toks(granite_plain)
    m = c["metrics"]
    assert cached_by(m, "p2p") == sum(n - 1 for n in GRANITE_LENS), m
    assert c["worker_stats"]["pulls_done"] == len(GRANITE_LENS) and c["worker_stats"]["pulls_failed"] == 0
    assert c["scheduler_stats"]["refused_params"] == 0


def test_mamba_hybrid_pd_through_torch_copies_matches_plain(granite_engines, granite_plain):
    """The Mamba2 hybrid's P/D with both sides' KV reached through torch's own copies
    (``torch_backend`` ``framework-copy``, what vLLM-TorchTPU's tensors get): the state slot
    through a host mirror of the state layer (``tpu_sync.torch_kv.StateKv``), the attention
    blocks through the attention layer's. Token-identical to plain."""
    e = granite_engines
    extra = dict(torch_backend="framework-copy", torch_copy_api="torch")
    p, c = e.pd("granite_pd_copy", e.spec(connector=dict(kv_role="kv_producer", extra=dict(lease_s=120.0, **extra))),
                e.spec(connector=dict(kv_role="kv_consumer", policy="fail", extra=dict(pull_timeout_s=60.0, **extra))))
    for st in (p["adapter_stats"], c["adapter_stats"]):
        assert (st["backend"], st["copy_api"]) == ("framework-copy", "torch"), st
    assert p["worker_stats"]["registered"] == len(GRANITE_LENS) and p["worker_stats"]["register_failed"] == 0
    assert toks(c) == toks(granite_plain)
    assert c["worker_stats"]["pulls_done"] == len(GRANITE_LENS) and c["worker_stats"]["pulls_failed"] == 0
    assert cached_by(c["metrics"], "p2p") == sum(n - 1 for n in GRANITE_LENS), c["metrics"]
    # Committed on the consumer: per request one commit of each part (the attention layer's
    # blocks, the state layer's slot).
    assert c["adapter_stats"]["commits"] == 2 * len(GRANITE_LENS), c["adapter_stats"]


def _granite_pd_across_tp(e, tag, prod_tp, cons_tp, **extra):
    """A Mamba2 hybrid P/D pair at two TP sizes (the TP=2 engine pinned one OpenMP thread per
    worker; ``extra`` connector settings on both sides); returns (producer, consumer) OUT."""
    hold = os.path.join(e.dir, tag + ".hold")
    if os.path.exists(hold):
        os.remove(hold)
    env0 = e.env
    tp2 = dict(env0, VLLM_CPU_OMP_THREADS_BIND="0|1")
    try:
        # The producer serves until the consumer is done (a TP=2 engine may take minutes to
        # start on a loaded machine).
        e.env = tp2 if prod_tp == 2 else env0
        prod = e.start(tag + "_producer", e.spec(
            tp=prod_tp, remote_decode=True, hold_file=hold, hold_s=900,
            connector=dict(kv_role="kv_producer", extra=dict(lease_s=900.0, decode_tp_size=cons_tp, **extra))))
        e.env = tp2 if cons_tp == 2 else env0
        cons = e.start(tag + "_consumer", e.spec(
            tp=cons_tp, params_file=prod.out,
            connector=dict(kv_role="kv_consumer", policy="fail", extra=dict(pull_timeout_s=60.0, **extra))))
    finally:
        e.env = env0
    return e.finish_pair(prod, cons, hold)


#: The tiny granite's state per TP rank (f32): the convolution state's 3 rows of the rank's
#: x channels (4 heads x 64 over TP), B and C (one group of 16: on every rank), then the SSM
#: state (4 heads x 64 x 16 over TP).
def _granite_state_bytes(tp):
    return (3 * (4 * 64 // tp + 16 + 16) + 4 // tp * 64 * 16) * 4


#: One attention block (64 tokens) of one of the tiny granite's 2 KV heads (head_dim 32, f32,
#: K and V): the CPU blocks move as head slices.
GRANITE_HEAD_BLOCK = 64 * 2 * 32 * 4


@pytest.mark.parametrize("prod_tp,cons_tp,backend", [(1, 2, None), (2, 1, None), (1, 2, "framework-copy")])
def test_mamba_hybrid_pd_reshards_the_state_across_tp(granite_engines, granite_plain, prod_tp, cons_tp, backend):
    """The Mamba2 hybrid's state moves between engines of different TP: each decode rank gets
    its share of every part of the state (the convolution state's x channels of its heads, the
    B and C channels of the one group every rank holds, the SSM state of its heads), from the
    producer rank(s) holding them, as vLLM's weight loader splits them
    (``compat.mamba_state_split``); also with both sides' KV reached through torch's copies
    (``framework-copy``, what vLLM-TorchTPU's tensors get: each rank's state through a host
    mirror). Token-identical to plain; the bytes received are exactly the decode ranks' state
    shares and attention head slices."""
    e = granite_engines
    extra = dict(torch_backend=backend, torch_copy_api="torch") if backend else {}
    p, c = _granite_pd_across_tp(e, f"granite_pd_tp{prod_tp}{cons_tp}{'_copy' if backend else ''}", prod_tp, cons_tp,
                                 **extra)
    if backend:
        assert p["adapter_stats"]["backend"] == backend, p["adapter_stats"]
    params = [o["kv_transfer_params"] for o in p["runs"][0]["outputs"]]
    assert all(x["tp_size"] == prod_tp for x in params), params
    state = params[0]["remote_geometry"]["groups"][0]["state"]
    assert [[(s["heads"], s["head_elems"]) for s in comp["segments"]] for comp in state["components"]] == [
        [(4, 64), (1, 16), (1, 16)], [(4, 64 * 16)]], state
    assert toks(c) == toks(granite_plain)
    m = c["metrics"]
    assert cached_by(m, "p2p") == sum(n - 1 for n in GRANITE_LENS), m
    assert c["scheduler_stats"]["refused_params"] == 0 and c["scheduler_stats"]["rejects"] == 0
    blocks = sum(-(-(n - 1) // GRANITE_BS) for n in GRANITE_LENS)
    # Summed over the decode ranks: every rank its state share per request (B and C once per
    # rank) and its head slice of each attention block (both heads over the ranks).
    want = len(GRANITE_LENS) * cons_tp * _granite_state_bytes(cons_tp) + blocks * 2 * GRANITE_HEAD_BLOCK
    assert m["vllm:tpu_sync_bytes_transferred"] == want, (m["vllm:tpu_sync_bytes_transferred"], want)
