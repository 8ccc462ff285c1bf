"""The connector's KV cache groups (hybrid models) against vLLM's real classes: a
``KVCacheConfig`` with a sliding-window group and a full-attention group (as vLLM builds it for
the tiny sliding-window Llama, ``build_tiny_hybrid.py --kind sliding``), block ids per group in
``request_finished_all_groups`` / ``update_state_after_alloc`` / the metadata, bad group
counts and block-id lists refused, and the worker side moving real PJRT CPU buffers (zero-copy
views of torch tensors shaped as vLLM's CPU backend allocates them): P/D between two workers
over loopback TCP and host-tier store then load, byte-exact per group with every other block
unchanged."""

import dataclasses
import json
import time

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,  # noqa: E402
                                        SlidingWindowSpec)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from conftest import SLIDING_WINDOW  # noqa: E402
from test_connector import BS, request, sched_out, tokens, vllm_config  # noqa: E402
from tpu_sync.vllm.compat import KvGeometry  # noqa: E402
from tpu_sync.vllm.config import ConfigError, ConnectorConfig  # noqa: E402
from tpu_sync.vllm.metadata import RecvSpec, SendSpec, TierOp, TpuSyncHandshake, TpuSyncMetadata  # noqa: E402

NUM_BLOCKS = 24
WINDOW = SLIDING_WINDOW
L0, L1 = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
ATTN = dict(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)


def kv_cache_config(window=WINDOW, groups=None):
    if groups is None:
        groups = [KVCacheGroupSpec([L0], SlidingWindowSpec(sliding_window=window, **ATTN)),
                  KVCacheGroupSpec([L1], FullAttentionSpec(**ATTN))]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.fixture(scope="module")
def sliding_model(workdir):
    from conftest import model

    return model(workdir, "tiny-sliding")


@pytest.fixture(scope="module")
def configs(sliding_model):
    return {r: vllm_config(sliding_model, r) for r in ("kv_producer", "kv_consumer", "kv_both")}


def connector(cfg, role=KVConnectorRole.SCHEDULER, kvc=None):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    return cls(cfg, role, kvc if kvc is not None else kv_cache_config())


def blocks(*groups):
    return KVCacheBlocks(tuple(tuple(KVCacheBlock(block_id=i) for i in ids) for ids in groups))


# ---- geometry --------------------------------------------------------------------------------


def test_groups_from_the_kv_cache_config(configs):
    c = connector(configs["kv_both"])
    assert isinstance(c, SupportsHMA)  # vLLM keeps its hybrid allocator on for this connector
    g = c.geometry
    assert g.groups == ({"kind": "attention", "layers": [0], "sliding_window": WINDOW},
                        {"kind": "attention", "layers": [1], "sliding_window": None})
    assert g.num_groups == 2 and g.group_of_layer() == [0, 1]
    # 100 tokens: the window [53, 100) lies in blocks 1..4; full attention needs blocks 0..4.
    assert g.held_blocks(0, 100) == (1, 4) and g.held_blocks(1, 100) == (0, 4)
    assert g.held_blocks(0, 40) == (0, 2)  # the window starts in block 0
    lay = g.tpu_sync_layout(NUM_BLOCKS)
    assert [grp["kind"].get("sliding_window") for grp in lay["model"]["groups"]] == [WINDOW, None]
    assert lay["spec"]["order"] == "lbhnc" and lay["groups"][0]["block_format"] == g.block_format
    # A uniform KV cache config (one full-attention group) is the uniform geometry, as before.
    uni = connector(configs["kv_both"], kvc=kv_cache_config(groups=[KVCacheGroupSpec([L0, L1],
                                                                                     FullAttentionSpec(**ATTN))]))
    assert uni.geometry.groups is None and "groups" not in uni.geometry.tpu_sync_layout(NUM_BLOCKS)
    assert uni.geometry.namespace() != g.namespace()  # never share tier blocks
    assert "groups" in g.mismatch(uni.geometry.to_dict())
    assert "groups" in g.mismatch(connector(configs["kv_both"], kvc=kv_cache_config(window=64)).geometry.to_dict())
    assert g.mismatch(g.to_dict()) is None
    assert g.mismatch(json.loads(json.dumps(g.to_dict()))) is None  # as a peer's params read back


def test_kinds_the_connector_cannot_move_are_named(configs):
    # Mamba states at block boundaries (prefix caching for Mamba) are not mapped: refused.
    mamba = MambaSpec(block_size=BS, shapes=((3, 512), (4, 64, 16)), dtypes=(torch.float32, torch.float32),
                      mamba_cache_mode="align")
    with pytest.raises(ValueError, match="MambaSpec.*mamba_cache_mode='align'"):
        connector(configs["kv_producer"], kvc=kv_cache_config(groups=[
            KVCacheGroupSpec(["model.layers.0.mixer"], mamba), KVCacheGroupSpec([L1], FullAttentionSpec(**ATTN))]))
    # Layer-wise P/D and loads work with several groups (below): accepted at start.
    cfg = vllm_config(configs["kv_both"].model_config.model, "kv_producer", extra={"layerwise": True})
    assert connector(cfg).config.layerwise
    with pytest.raises(ConfigError, match="layerwise"):
        connector(vllm_config(configs["kv_both"].model_config.model, "kv_producer", extra={"layerwise": 1}))
    # The cluster tier works with groups (a peer of this layout, through host memory:
    # test_hybrid_engine.py); the scheduler side starts without reaching etcd.
    cluster = {"cluster": {"endpoints": ["http://127.0.0.1:9"], "advertise": "127.0.0.1:9"}}
    assert connector(vllm_config(configs["kv_both"].model_config.model, "kv_both", extra=cluster)).geometry.groups


# ---- scheduler: block ids per group ----------------------------------------------------------


def producer_params(configs, n=100):
    p = connector(configs["kv_producer"])
    p.set_xfer_handshake_metadata({0: TpuSyncHandshake(0, "10.0.0.1:7001", p.geometry.block_format, NUM_BLOCKS)})
    toks = tokens(n)
    r = request("p1", toks, {"do_remote_decode": True}, max_tokens=1)
    r.num_computed_tokens, r.status = n, RequestStatus.FINISHED_LENGTH_CAPPED
    # vLLM's per-group block ids: the sliding group already dropped block 0 (its null block).
    nb = -(-n // BS)
    delay, params = p.request_finished_all_groups(r, ([0, 12, 13, 14][:nb], [9, 4, 7, 3][:nb]))
    return p, toks, delay, params


def test_producer_hands_off_each_groups_held_blocks(configs):
    p, _, delay, params = producer_params(configs)
    assert delay is True
    assert params["remote_block_ids"] == [[12, 13, 14], [9, 4, 7, 3]]
    assert params["remote_geometry"]["groups"][0]["sliding_window"] == WINDOW
    (send,) = p.build_connector_meta(sched_out({})).sends
    assert send.block_ids == [[12, 13, 14], [9, 4, 7, 3]] and send.num_tokens == 100
    # Bad input: another group count is an error; a null block inside the window, or too few
    # blocks, hands nothing off.
    r = request("p2", tokens(100), {"do_remote_decode": True}, max_tokens=1)
    r.num_computed_tokens, r.status = 100, RequestStatus.FINISHED_LENGTH_CAPPED
    with pytest.raises(ValueError, match="2 KV cache groups"):
        p.request_finished_all_groups(r, ([9, 4, 7, 3],))
    r = request("p3", tokens(100), {"do_remote_decode": True}, max_tokens=1)
    r.num_computed_tokens, r.status = 100, RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.request_finished_all_groups(r, ([0, 0, 13, 14], [9, 4, 7, 3])) == (False, None)
    r = request("p4", tokens(100), {"do_remote_decode": True}, max_tokens=1)
    r.num_computed_tokens, r.status = 100, RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.request_finished_all_groups(r, ([0, 12, 13, 14], [9, 4, 7])) == (False, None)


def test_consumer_pulls_into_each_groups_blocks(configs):
    _, toks, _, params = producer_params(configs)
    c = connector(configs["kv_consumer"])
    r = request("d1", toks, dict(params))
    assert c.get_num_new_matched_tokens(r, 0) == (100, True)
    # vLLM pads the sliding group's blocks before the window with its null block.
    c.update_state_after_alloc(r, blocks([0, 21, 22, 23], [5, 6, 8, 10]), 100)
    (spec,) = c.build_connector_meta(sched_out({})).recvs
    assert spec.src_block_ids == [[12, 13, 14], [9, 4, 7, 3]]
    assert spec.dst_block_ids == [[21, 22, 23], [5, 6, 8, 10]]
    assert spec.src_layout["groups"] and spec.src_layout["model"]["groups"][0]["kind"]["sliding_window"] == WINDOW
    # A null block inside the window on the decode side: vLLM waits for the load, so it is a
    # pull that fails at once (no source blocks: the worker's placement is refused), whose
    # blocks are all load errors; nothing is written.
    r2 = request("d2", toks, dict(params))
    assert c.get_num_new_matched_tokens(r2, 0) == (100, True)
    c.update_state_after_alloc(r2, blocks([0, 0, 22, 23], [5, 6, 8, 10]), 100)
    (spec,) = c.build_connector_meta(sched_out({})).recvs
    assert spec.src_block_ids == [] and spec.dst_block_ids == [[0, 0, 22, 23], [5, 6, 8, 10]]
    from tpu_sync.vllm.compat import placement
    from tpu_sync.vllm.worker import _flat_ids

    with pytest.raises(ValueError, match="one list per KV cache group"):
        placement(spec.src_layout, spec.src_block_ids)
    assert sorted(_flat_ids(spec.dst_block_ids)) == [5, 6, 8, 10, 22, 23]


def test_consumer_with_a_local_prefix_hit_pulls_each_groups_rest(configs):
    """A consumer whose prefix cache holds the request's first 2 blocks (in both groups) pulls
    only the producer's tokens after them: ``(100 - 64, True)``, each group's blocks from block
    2 on (the sliding group's window of the recomputed token 99, ``[52, 100)``, starts in the
    hit's block 1, which is local), ``first_token`` 64 and ``next_token`` 99 in the pull; the
    plan from the producer's placement moves exactly those tokens. A model with Mamba state
    groups prefills the rest locally instead."""
    import tpu_sync
    from tpu_sync.vllm.compat import placement

    _, toks, _, params = producer_params(configs)
    c = connector(configs["kv_consumer"])
    r = request("d3", toks, dict(params))
    assert c.get_num_new_matched_tokens(r, 2 * BS) == (100 - 2 * BS, True)
    c.update_state_after_alloc(r, blocks([0, 21, 22, 23], [5, 6, 8, 10]), 100 - 2 * BS)
    (spec,) = c.build_connector_meta(sched_out({})).recvs
    assert (spec.first_token, spec.next_token) == (2 * BS, 99)
    assert spec.dst_block_ids == [[22, 23], [8, 10]]
    assert c.scheduler_side.stats["p2p_partial"] == 1
    dst = placement(c.geometry.tpu_sync_layout(NUM_BLOCKS), spec.dst_block_ids, spec.first_token, spec.next_token)
    with tpu_sync.Plan(placement(spec.src_layout, spec.src_block_ids), dst, 100) as plan:
        # Tokens 64..100 of both layers (CPU blocks move whole: the 2 blocks of each).
        assert plan.total_bytes == 2 * 2 * c.geometry.layer_block_bytes
    # A Mamba hybrid: its state is the producer's after all its tokens; prefilled locally.
    mp, mtoks, mr = mamba_producer_params(configs)
    mr.num_computed_tokens, mr.status = 99, RequestStatus.FINISHED_LENGTH_CAPPED
    _, mparams = mp.request_finished_all_groups(mr, ([7], [9, 4, 7, 3]))
    m = connector(configs["kv_consumer"], kvc=mamba_kvc())
    assert m.get_num_new_matched_tokens(request("d4", mtoks, dict(mparams)), 0) == (99, True)  # the params are good
    assert m.get_num_new_matched_tokens(request("d5", mtoks, dict(mparams)), BS) == (0, False)
    assert m.scheduler_side.stats["refused_params"] == 0


@pytest.mark.parametrize("prompt_len", [79, 111, 143, 100, 107, 80, 70])
def test_pd_consumer_covers_the_recomputed_last_tokens_window(configs, prompt_len):
    """After a whole-prompt load vLLM recomputes the last prompt token (``num_computed_tokens``
    is set to ``T - 1``), whose window reads tokens ``[T - w, T - 1)``. With vLLM's real block
    allocation on both sides (``KVCacheManager``; the producer's out-of-window blocks freed
    before ``request_finished``, as ``Scheduler._connector_finished`` does): where
    ``(T + 1 - w)`` is a multiple of the block size (79, 111, 143 tokens) the block of token
    ``T - w`` is neither held by the producer nor a real block of a consumer of ``T`` tokens, so
    the consumer prefills locally and rejects the transfer; otherwise it pulls, and every block
    the recomputed token reads is a real block the pull writes."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    T = prompt_len
    boundary = (T + 1 - WINDOW) % BS == 0
    p = connector(configs["kv_producer"])
    p.set_xfer_handshake_metadata({0: TpuSyncHandshake(0, "10.0.0.1:7001", p.geometry.block_format, NUM_BLOCKS)})
    toks = tokens(T)
    pm = KVCacheManager(kv_cache_config(), 4096, BS, BS, enable_caching=False)
    r = request("p", toks, {"do_remote_decode": True}, max_tokens=1)
    assert pm.allocate_slots(r, T) is not None  # the prefill of the whole prompt
    r.num_computed_tokens, r.status = T, RequestStatus.FINISHED_LENGTH_CAPPED
    pm.remove_skipped_blocks("p", T)  # what vLLM frees before request_finished
    delay, params = p.request_finished_all_groups(r, pm.get_blocks("p").get_block_ids())
    assert delay is True and params["remote_num_tokens"] == T
    c = connector(configs["kv_consumer"])
    d = request("d", toks, dict(params))
    if boundary:
        # The producer's sliding group starts at the block after token T - w.
        assert c.geometry.held_blocks(0, T)[0] == (T - WINDOW) // BS + 1
        assert c.get_num_new_matched_tokens(d, 0) == (0, False)
        assert c.get_num_new_matched_tokens(d, 0) == (0, False)  # asked again: counted once
        c.update_state_after_alloc(d, blocks([], []), 0)
        meta = c.build_connector_meta(sched_out({}))
        assert meta.recvs == [] and len(meta.rejects) == 1
        assert c.scheduler_side.stats["window_local"] == 1
        return
    assert c.get_num_new_matched_tokens(d, 0) == (T, True)
    cm = KVCacheManager(kv_cache_config(), 4096, BS, BS, enable_caching=False)
    assert cm.allocate_slots(d, 0, num_external_computed_tokens=T, delay_cache_blocks=True) is not None
    c.update_state_after_alloc(d, cm.get_blocks("d"), T)
    (spec,) = c.build_connector_meta(sched_out({})).recvs
    assert spec.src_block_ids == params["remote_block_ids"]
    assert [len(x) for x in spec.src_block_ids] == [len(x) for x in spec.dst_block_ids]
    assert all(b != 0 for ids in spec.dst_block_ids for b in ids)  # never vLLM's null block
    # The pull covers the recomputed token's window, token T - w included (next_token): the
    # planner takes the producer's placement for it (it refuses a window the source's blocks
    # do not hold).
    import tpu_sync
    from tpu_sync.vllm.compat import placement

    assert spec.next_token == T - 1
    dst = placement(c.geometry.tpu_sync_layout(NUM_BLOCKS), spec.dst_block_ids, 0, spec.next_token)
    with tpu_sync.Plan(placement(spec.src_layout, spec.src_block_ids), dst, T):
        pass
    # The load is done; vLLM recomputes the last token (Scheduler._update_waiting_for_remote_kv).
    d.num_computed_tokens = T - 1
    assert cm.allocate_slots(d, 1) is not None
    table = cm.get_blocks("d").get_block_ids()
    for g, w in enumerate((WINDOW, None)):
        first = 0 if w is None else max(0, T - w) // BS  # the block of token T - w
        read = list(table[g][first:-(-(T - 1) // BS)])  # the blocks of tokens [T - w, T - 1)
        assert all(b != 0 for b in read), (g, table[g])
        assert set(read) <= set(spec.dst_block_ids[g]), (g, read, spec.dst_block_ids[g])
    assert c.scheduler_side.stats["window_local"] == 0


def layerwise_config(configs, role):
    return vllm_config(configs["kv_both"].model_config.model, role, extra={"layerwise": True})


class _Manager:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self, rid):
        return self.ids


def test_layerwise_producer_registers_each_groups_held_blocks(configs):
    p = connector(layerwise_config(configs, "kv_producer"))
    p.set_xfer_handshake_metadata({0: TpuSyncHandshake(0, "10.0.0.1:7001", p.geometry.block_format, NUM_BLOCKS)})
    ids = ([11, 12, 13, 14], [9, 4, 7, 3])  # the whole prompt in one step: every block held
    p.scheduler_side.kv_cache_manager = _Manager(ids)
    r = request("p1", tokens(100), {"do_remote_decode": True}, max_tokens=1)
    p.on_new_request(r)
    (send,) = p.build_connector_meta(sched_out({"p1": 100})).layer_sends
    assert send.block_ids == [[12, 13, 14], [9, 4, 7, 3]] and send.num_tokens == 100
    r.num_computed_tokens, r.status = 100, RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.request_finished_all_groups(r, ids)
    # The layer-wise registration is handed off: no second registration.
    assert delay and params["remote_request_id"] == send.xfer_id
    assert params["remote_block_ids"] == [[12, 13, 14], [9, 4, 7, 3]]
    meta = p.build_connector_meta(sched_out({}))
    assert meta.handoffs == ["p1"] and not meta.sends and not meta.withdraws
    # Blocks that differ at the end (another block table): that registration is withdrawn and
    # the request registered whole.
    r2 = request("p2", tokens(100, seed=5), {"do_remote_decode": True}, max_tokens=1)
    p.on_new_request(r2)
    (send2,) = p.build_connector_meta(sched_out({"p2": 100})).layer_sends
    r2.num_computed_tokens, r2.status = 100, RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.request_finished_all_groups(r2, ([0, 15, 16, 17], [9, 4, 7, 3]))
    meta = p.build_connector_meta(sched_out({}))
    assert meta.withdraws == [send2.xfer_id] and [s.block_ids for s in meta.sends] == [[[15, 16, 17], [9, 4, 7, 3]]]
    assert params["remote_request_id"] == meta.sends[0].xfer_id != send2.xfer_id
    # Aborted after its layer-wise registration: refused (a both-at-once consumer's pull of it
    # fails at once with the reason), not only withdrawn.
    r4 = request("p4", tokens(100, seed=7), {"do_remote_decode": True}, max_tokens=1)
    p.on_new_request(r4)
    (send4,) = p.build_connector_meta(sched_out({"p4": 100})).layer_sends
    r4.num_computed_tokens, r4.status = 100, RequestStatus.FINISHED_ABORTED
    delay, params = p.request_finished_all_groups(r4, ids)
    meta = p.build_connector_meta(sched_out({}))
    assert not delay and params is None and not meta.withdraws
    assert meta.refusals == [(send4.xfer_id, "request p4 was aborted on the producer")]
    # A null block inside the window: nothing registered layer by layer.
    p.scheduler_side.kv_cache_manager = _Manager(([0, 0, 13, 14], [9, 4, 7, 3]))
    p.on_new_request(request("p3", tokens(100, seed=6), {"do_remote_decode": True}, max_tokens=1))
    assert p.build_connector_meta(sched_out({"p3": 100})).layer_sends == []


def test_layerwise_consumer_pulls_each_group_or_whole_when_a_window_is_not_covered(configs):
    from tpu_sync.vllm._api import reports_failed_recving

    c = connector(layerwise_config(configs, "kv_consumer"))
    _, toks, _, params = producer_params(configs)
    if reports_failed_recving():
        # vLLM 0.32 refuses block-level load errors of a model with groups, so a synchronous
        # layer-wise pull that failed would stop the engine: these pulls are whole and
        # asynchronous there (reported by request).
        assert not c.scheduler_side.sync_layerwise
        assert c.get_num_new_matched_tokens(request("d0", toks, dict(params)), 0) == (100, True)
        # The layer-wise choice below is what vLLM 0.29 (vLLM-TorchTPU's base) gets.
        c = connector(layerwise_config(configs, "kv_consumer"))
        c.scheduler_side.sync_layerwise = True
    r = request("d1", toks, dict(params))
    # 100 tokens: the forward computes from token 96, whose window [49, 97) lies in blocks 1..
    # that the producer holds: a synchronous load read layer by layer.
    assert c.get_num_new_matched_tokens(r, 0) == (96, False)
    c.update_state_after_alloc(r, blocks([0, 21, 22, 23], [5, 6, 8, 10]), 96)
    meta = c.build_connector_meta(sched_out({"d1": 4}))
    (spec,) = meta.layer_recvs
    assert not meta.recvs
    assert spec.src_block_ids == [[12, 13, 14], [9, 4, 7, 3]] and spec.dst_block_ids == [[21, 22, 23], [5, 6, 8, 10]]
    assert spec.num_tokens == 100
    # 80 tokens: computing from token 64 reads token 17 (block 0) of the sliding layer, which the
    # producer of 80 tokens no longer holds (its window [33, 80) starts in block 1): the request
    # is pulled whole (asynchronously), and vLLM computes only its last token.
    _, toks80, _, params80 = producer_params(configs, n=80)
    assert params80["remote_block_ids"] == [[12, 13], [9, 4, 7]]
    r2 = request("d2", toks80, dict(params80))
    assert c.get_num_new_matched_tokens(r2, 0) == (80, True)
    assert c.scheduler_side.stats["layerwise_whole"] == 1
    c.update_state_after_alloc(r2, blocks([0, 21, 22], [5, 6, 8]), 80)
    meta = c.build_connector_meta(sched_out({}))
    (spec,) = meta.recvs
    assert not meta.layer_recvs and spec.dst_block_ids == [[21, 22], [5, 6, 8]]
    # 112 tokens after a local hit of 32: computing from token 96 reads token 49 (block 1), before
    # the producer's window of 112 ([65, 112), blocks 2..); the recomputed token 111's window
    # ([64, 112)) is in it: the rest (80 tokens) is pulled asynchronously and reported as
    # finished (not as a layer-wise load, which vLLM would never see finish).
    _, toks112, _, params112 = producer_params(configs, n=112)
    r3 = request("d3", toks112, dict(params112))
    assert c.get_num_new_matched_tokens(r3, BS) == (112 - BS, True)
    assert c.scheduler_side.stats["layerwise_whole"] == 2
    c.update_state_after_alloc(r3, blocks([0, 0, 22, 23], [5, 6, 8, 10]), 112 - BS)
    meta = c.build_connector_meta(sched_out({}))
    (spec,) = meta.recvs
    assert not meta.layer_recvs
    assert (spec.first_token, spec.next_token, spec.dst_block_ids) == (BS, 111, [[22, 23], [6, 8, 10]])


@pytest.mark.parametrize("tamper", ["flat", "group-count", "group-length", "window", "uniform-producer"])
def test_consumer_refuses_params_whose_groups_disagree(configs, tamper):
    _, toks, _, params = producer_params(configs)
    bad = dict(params)
    if tamper == "flat":
        bad["remote_block_ids"] = [12, 13, 14, 15]
    elif tamper == "group-count":
        bad["remote_block_ids"] = [[12, 13, 14]]
    elif tamper == "group-length":
        bad["remote_block_ids"] = [[11, 12, 13, 14], [9, 4, 7, 3]]
    elif tamper == "window":
        geom = dict(params["remote_geometry"])
        geom["groups"] = [dict(geom["groups"][0], sliding_window=64), geom["groups"][1]]
        bad["remote_geometry"] = geom
    else:
        bad["remote_geometry"] = dict(params["remote_geometry"], groups=None)
        bad["remote_block_ids"] = [9, 4, 7, 3]
    c = connector(configs["kv_consumer"])
    r = request("d3", toks, bad)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    assert c.scheduler_side.stats["refused_params"] == 1


def test_offload_saves_and_loads_per_group(configs):
    c = connector(configs["kv_both"])
    toks = tokens(100)
    r = request("o1", toks)
    c.on_new_request(r)

    class Manager:
        ids = ([30, 31, 32, 33], [40, 41, 42, 43])

        def get_block_ids(self, rid):
            return self.ids

    c.scheduler_side.kv_cache_manager = Manager()
    assert c.get_num_new_matched_tokens(r, 0) == (None, False)  # looked up first
    meta = c.build_connector_meta(sched_out({"o1": 100}))
    (save,) = meta.saves  # the 3 full prompt blocks, every group's block of each
    assert save.block_ids == [30, 31, 32]
    assert save.group_block_ids == [[30, 31, 32], [40, 41, 42]]
    # A sliding group that no longer holds a block: saved up to it only.
    r2 = request("o2", tokens(100, seed=3))
    c.on_new_request(r2)
    Manager.ids = ([33, 0, 35, 36], [44, 45, 46, 47])
    meta = c.build_connector_meta(sched_out({"o2": 100}))
    assert [s.group_block_ids for s in meta.saves if s.req_id == "o2"] == [[[33], [44]]]
    # A hit loads every group's block, the sliding group's null blocks included (skipped).
    from tpu_sync.vllm.metadata import TpuSyncWorkerMetadata
    from vllm.v1.outputs import KVConnectorOutput

    from tpu_sync.vllm._api import reports_failed_recving

    c.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TpuSyncWorkerMetadata(lookup_hits={"o1": 3})))
    # Asynchronous where vLLM takes a failure by request (vLLM 0.32 refuses block-level load
    # errors from a model with groups), so the worker reports it done or failed by request.
    async_load = reports_failed_recving()
    assert c.get_num_new_matched_tokens(r, 0) == (96, async_load)
    c.update_state_after_alloc(r, blocks([0, 0, 52, 53], [60, 61, 62, 63]), 96)
    (load,) = c.build_connector_meta(sched_out({})).loads
    assert load.group_block_ids == [[0, 0, 52], [60, 61, 62]]
    assert load.report == async_load


def test_a_request_finished_while_its_async_load_is_pending(configs):
    """With several KV cache groups on a vLLM that reads failed_recving, host-tier loads are
    asynchronous. A request with host-tier saves, preempted and readmitted with a load of its
    own saved blocks, then finished (aborted) before that step's output: vLLM holds its blocks
    until the load is reported and frees it then, so the connector does not keep them for its
    saves and drops the workers' report of those saves (vLLM asserts it knows every request in
    finished_sending). A request finished without a pending load keeps its blocks for its
    saves as before."""
    from tpu_sync.vllm._api import reports_failed_recving
    from tpu_sync.vllm.metadata import TpuSyncWorkerMetadata
    from vllm.v1.outputs import KVConnectorOutput

    if not reports_failed_recving():
        pytest.skip("this vLLM loads synchronously (no failed_recving)")
    c = connector(configs["kv_both"])
    s = c.scheduler_side
    assert s.async_loads

    class Manager:
        ids = {"o1": ([30, 31, 32, 33], [40, 41, 42, 43]), "o2": ([50, 51, 52, 53], [54, 55, 56, 57])}

        def get_block_ids(self, rid):
            return self.ids[rid]

    s.kv_cache_manager = Manager()
    r1, r2 = request("o1", tokens(100)), request("o2", tokens(100, seed=5))
    for r in (r1, r2):
        c.on_new_request(r)
        assert c.get_num_new_matched_tokens(r, 0) == (None, False)
    meta = c.build_connector_meta(sched_out({"o1": 100, "o2": 100}))
    assert {op.req_id for op in meta.saves} == {"o1", "o2"}
    # o1 preempted and readmitted: a hit of its own saved blocks, loaded asynchronously.
    c.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TpuSyncWorkerMetadata(lookup_hits={"o1": 3})))
    assert c.get_num_new_matched_tokens(r1, 0) == (96, True)
    c.update_state_after_alloc(r1, blocks([0, 0, 62, 63], [60, 61, 62, 63]), 96)
    (load,) = c.build_connector_meta(sched_out({})).loads
    assert load.report
    # Aborted before the output of the step that loads it: not delayed for its saves.
    delay, _ = c.request_finished_all_groups(r1, ([0, 0, 62, 63], [60, 61, 62, 63]))
    assert not delay
    # o2 finished normally: its blocks are kept until its saves are reported.
    delay2, _ = c.request_finished_all_groups(r2, Manager.ids["o2"])
    assert delay2 and s.pending_frees() == 1
    out = KVConnectorOutput(finished_recving={"o1"}, finished_sending={"o1", "o2"})
    c.update_connector_output(out)
    assert out.finished_recving == {"o1"} and out.finished_sending == {"o2"}
    assert s.pending_frees() == 0 and not s._unreported and not s._load_pending


# ---- worker: real PJRT CPU buffers -----------------------------------------------------------


def kv_tensors(seed):
    """vLLM CPU backend tensors of the two layers: [blocks, heads, block, 2 * head_size] f32,
    non-repeating contents."""
    g = torch.Generator().manual_seed(seed)
    return {L0: torch.rand((NUM_BLOCKS, 2, BS, 64), generator=g, dtype=torch.float32) + seed,
            L1: torch.rand((NUM_BLOCKS, 2, BS, 64), generator=g, dtype=torch.float32) + seed + 0.5}


def worker(configs, role, extra=None):
    from tpu_sync.vllm.worker import WorkerSide

    c = connector(configs[role])
    return WorkerSide(configs[role], ConnectorConfig.parse(role, extra or {}), c.geometry)


def test_worker_pd_moves_each_group_byte_exact(configs):
    prod = worker(configs, "kv_producer")
    cons = worker(configs, "kv_consumer")
    src, dst = kv_tensors(1), kv_tensors(2)
    before = {n: t.clone() for n, t in dst.items()}
    try:
        prod.register_kv_caches(src)
        cons.register_kv_caches(dst)
        held_src, held_dst = [[12, 13, 14], [9, 4, 7, 3]], [[21, 22, 23], [5, 6, 8, 10]]
        prod.start_load_kv(TpuSyncMetadata(sends=[SendSpec("p1", 77, held_src, 100, 60.0)]))
        assert prod.stats["registered"] == 1, prod.stats
        layout = prod.geometry.tpu_sync_layout(NUM_BLOCKS)
        cons.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d1", 77, {0: prod.transport.address}, layout, held_src,
                                                            held_dst, 100, 30.0)]))
        deadline = time.monotonic() + 30
        res = None
        while time.monotonic() < deadline:
            res = cons.get_transfer_results(set())
            if res.finished_recving:
                break
            time.sleep(0.02)
        assert res.finished_recving == {"d1"} and not res.failed_recving, cons.stats
        want = {n: t.clone() for n, t in before.items()}
        for name, s_ids, d_ids in ((L0, held_src[0], held_dst[0]), (L1, held_src[1], held_dst[1])):
            for s, d in zip(s_ids, d_ids):
                want[name][d] = src[name][s]
        for name in (L0, L1):
            assert torch.equal(dst[name], want[name]), name
        # The sliding layer's block before the window was not moved.
        assert not torch.equal(dst[L0][0], src[L0][0])

        # Bad input at the worker: a group count that disagrees with the layout fails the pull,
        # never writes bytes. Reported by request; as block ids too only where vLLM has no
        # failed_recving (0.29: vLLM 0.32 refuses block-level errors from a model with groups).
        snap = {n: t.clone() for n, t in dst.items()}
        cons.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d2", 77, {0: prod.transport.address}, layout,
                                                            [held_src[1]], [held_dst[1]], 100, 5.0)]))
        res = cons.get_transfer_results(set())
        assert res.failed_recving == {"d2"}
        from tpu_sync.vllm._api import reports_failed_recving

        assert set(cons.get_block_ids_with_load_errors()) == (set() if reports_failed_recving() else set(held_dst[1]))
        for name in (L0, L1):
            assert torch.equal(dst[name], snap[name])
    finally:
        cons.shutdown()
        prod.shutdown()


def test_worker_host_tier_store_then_load_per_group(configs):
    w = worker(configs, "kv_both", {"host_capacity_bytes": 64 << 20})
    kv = kv_tensors(3)
    try:
        w.register_kv_caches(kv)
        orig = {n: t.clone() for n, t in kv.items()}
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("o1", hashes, [30, 31, 32], None, [[3, 4, 5], [6, 7, 8]])]))
        assert w.flush_saves(30)  # asynchronous saves: wait for them
        assert w.stats["saved_blocks"] == 3
        # A save whose sliding group holds the null block is refused whole (a warning), nothing stored.
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("o2", [b"\x09" * 32], [9], None, [[0], [9]])]))
        assert w.flush_saves(30)  # asynchronous saves: wait for them
        assert w.stats["saved_blocks"] == 3
        w.start_load_kv(TpuSyncMetadata(lookups={"o1": hashes + [b"\x08" * 32]}))
        assert w.build_worker_meta().lookup_hits == {"o1": 3}
        # Load into other blocks; the sliding group's first block is vLLM's null block: skipped.
        w.start_load_kv(TpuSyncMetadata(loads=[TierOp("o1", hashes, [16, 17, 18], None, [[0, 11, 12], [16, 17, 18]])]))
        assert w.stats["loaded_blocks"] == 3 and w.stats["failed_loads"] == 0
        want = {n: t.clone() for n, t in orig.items()}
        for s, d in zip([4, 5], [11, 12]):
            want[L0][d] = orig[L0][s]
        for s, d in zip([6, 7, 8], [16, 17, 18]):
            want[L1][d] = orig[L1][s]
        for name in (L0, L1):
            assert torch.equal(kv[name], want[name]), name
        # Bad input: block ids of one group only: a failed load (recomputed), nothing written.
        w.start_load_kv(TpuSyncMetadata(loads=[TierOp("o3", hashes, [19, 20, 21], None, [[19, 20, 21]])]))
        assert w.stats["failed_loads"] == 1
        assert set(w.get_block_ids_with_load_errors()) == {19, 20, 21}
        for name in (L0, L1):
            assert torch.equal(kv[name], want[name]), name
    finally:
        w.shutdown()


def test_worker_layerwise_pd_moves_each_group_layer_by_layer_byte_exact(configs):
    """Layer-wise P/D with two KV cache groups: the producer registers the grouped placement
    before its forward and publishes each cache layer from ``save_kv_layer``; the consumer
    pulls layer-wise into its own blocks of each group, and ``wait_for_layer_load`` returns
    once that layer (of its group's blocks) is in, while later layers are untouched."""
    prod = worker(configs, "kv_producer", {"layerwise": True})
    cons = worker(configs, "kv_consumer", {"layerwise": True})
    src, dst = kv_tensors(4), kv_tensors(5)
    before = {n: t.clone() for n, t in dst.items()}
    try:
        prod.register_kv_caches(src)
        cons.register_kv_caches(dst)
        held_src, held_dst = [[12, 13, 14], [9, 4, 7, 3]], [[21, 22, 23], [5, 6, 8, 10]]
        prod.start_load_kv(TpuSyncMetadata(layer_sends=[SendSpec("p1", 78, held_src, 100, 60.0)]))
        assert prod.stats["layerwise_registered"] == 1, prod.stats
        layout = prod.geometry.tpu_sync_layout(NUM_BLOCKS)
        cons.start_load_kv(TpuSyncMetadata(layer_recvs=[RecvSpec("d1", 78, {0: prod.transport.address}, layout,
                                                                  held_src, held_dst, 100, 30.0)]))
        assert cons.stats["layerwise_pulls"] == 1, cons.stats
        want = {n: t.clone() for n, t in before.items()}
        for name, s_ids, d_ids in ((L0, held_src[0], held_dst[0]), (L1, held_src[1], held_dst[1])):
            for s_, d in zip(s_ids, d_ids):
                want[name][d] = src[name][s_]
        # Layer 0 (the sliding-window group) published and read; layer 1 not published yet.
        prod.save_kv_layer(L0)
        cons.wait_for_layer_load(L0)
        assert torch.equal(dst[L0], want[L0])
        assert torch.equal(dst[L1], before[L1])
        prod.save_kv_layer(L1)
        cons.wait_for_layer_load(L1)
        for name in (L0, L1):
            assert torch.equal(dst[name], want[name]), name
        assert not torch.equal(dst[L0][0], src[L0][0])  # the block before the window not moved
        prod.wait_for_save(None)
        cons.wait_for_save(None)
        assert cons.stats["pulls_done"] == 1 and cons.stats["pulls_failed"] == 0, cons.stats
        assert not cons.get_block_ids_with_load_errors()

        # Bad input: one group's lists for a two-group layout fail the layer-wise pull (load
        # errors, the producer told), nothing written.
        prod.start_load_kv(TpuSyncMetadata(layer_sends=[SendSpec("p2", 79, held_src, 100, 60.0)]))
        snap = {n: t.clone() for n, t in dst.items()}
        cons.start_load_kv(TpuSyncMetadata(layer_recvs=[RecvSpec("d2", 79, {0: prod.transport.address}, layout,
                                                                  [held_src[1]], [held_dst[1]], 100, 5.0)]))
        prod.save_kv_layer(L1)
        cons.wait_for_layer_load(L0)
        cons.wait_for_layer_load(L1)
        cons.wait_for_save(None)
        assert cons.stats["pulls_failed"] == 1
        assert set(cons.get_block_ids_with_load_errors()) == set(held_dst[1])
        for name in (L0, L1):
            assert torch.equal(dst[name], snap[name])
    finally:
        cons.shutdown()
        prod.shutdown()


def test_worker_layerwise_host_tier_load_per_group(configs):
    """Layer-wise host-tier loads with KV cache groups: each layer's part of a tier entry goes
    to its own group's block; the sliding group's null blocks are skipped; byte-exact, every
    other block unchanged; a load whose group lists disagree fails (load errors), writes
    nothing."""
    w = worker(configs, "kv_both", {"host_capacity_bytes": 64 << 20, "layerwise": True})
    kv = kv_tensors(6)
    try:
        w.register_kv_caches(kv)
        orig = {n: t.clone() for n, t in kv.items()}
        hashes = [bytes([i]) * 32 for i in range(11, 14)]
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("o1", hashes, [1, 2, 3], None, [[1, 2, 3], [4, 5, 6]])]))
        assert w.flush_saves(30)  # asynchronous saves: wait for them
        assert w.stats["saved_blocks"] == 3
        w.start_load_kv(TpuSyncMetadata(loads=[TierOp("o1", hashes, [16, 17, 18], None, [[0, 14, 15], [16, 17, 18]])]))
        assert w.stats["layerwise_loads"] == 1
        want = {n: t.clone() for n, t in orig.items()}
        for s_, d in zip([2, 3], [14, 15]):
            want[L0][d] = orig[L0][s_]
        w.wait_for_layer_load(L0)
        assert torch.equal(kv[L0], want[L0])
        for s_, d in zip([4, 5, 6], [16, 17, 18]):
            want[L1][d] = orig[L1][s_]
        w.wait_for_layer_load(L1)
        w.wait_for_save(None)
        assert w.stats["loaded_blocks"] == 3 and w.stats["failed_loads"] == 0, w.stats
        for name in (L0, L1):
            assert torch.equal(kv[name], want[name]), name
        assert torch.equal(kv[L0][0], orig[L0][0])  # the null block untouched
        w.start_load_kv(TpuSyncMetadata(loads=[TierOp("o3", hashes, [19, 20, 21], None, [[19, 20, 21]])]))
        w.wait_for_layer_load(L0)
        w.wait_for_layer_load(L1)
        w.wait_for_save(None)
        assert w.stats["failed_loads"] == 1
        assert set(w.get_block_ids_with_load_errors()) == {19, 20, 21}
        for name in (L0, L1):
            assert torch.equal(kv[name], want[name]), name
    finally:
        w.shutdown()


def test_worker_host_tier_groups_prefix_rule_eviction_and_warm_restart(configs):
    """The host tier with KV cache groups keeps one entry per block position holding every
    group's part (``StoreTier.put_groups``), so a prefix is present only when every group's
    part of each of its blocks is: a block evicted (or removed) cuts the hit there, a load
    delivers only the shorter prefix's bytes (never another request's), and a restarted worker
    re-attaching the shm segment hits the same prefix with the same bytes."""
    import os

    import tpu_sync

    shm = f"tpusync-groups-{os.getpid()}"
    block_bytes = connector(configs["kv_both"]).geometry.block_bytes
    extra = {"host_capacity_bytes": 6 * block_bytes, "shm_name": shm}  # 6 entries

    def lookup(w, req, hashes):
        w.start_load_kv(TpuSyncMetadata(lookups={req: hashes}))
        return w.build_worker_meta().lookup_hits[req]

    w = worker(configs, "kv_both", extra)
    w2 = None
    kv = kv_tensors(7)
    try:
        w.register_kv_caches(kv)
        orig = {n: t.clone() for n, t in kv.items()}
        a = [bytes([0xA0 + i]) * 32 for i in range(3)]
        b = [bytes([0xB0 + i]) * 32 for i in range(3)]
        c = [bytes([0xC0 + i]) * 32 for i in range(3)]
        ga, gb, gc = [[1, 2, 3], [4, 5, 6]], [[7, 8, 9], [10, 11, 12]], [[13, 14, 15], [16, 17, 18]]
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("a", a, ga[0], None, ga), TierOp("c", c, gc[0], None, gc)]))
        assert lookup(w, "a", a) == 3 and lookup(w, "c", c) == 3
        w.get_transfer_results({"a", "c"})  # ends the lookups' pins (finished requests)
        # One block of c removed (with what is chained below it): c's hit is the prefix before it.
        assert w.tier.store.remove([w.tier.key(c[1])]) >= 1
        assert lookup(w, "c", c) == 1
        w.get_transfer_results({"c"})
        # Filling the tier with b evicts whole entries (every group's part together), tails first.
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("b", b, gb[0], None, gb)]))
        hit_a, hit_b, hit_c = lookup(w, "a", a), lookup(w, "b", b), lookup(w, "c", c)
        assert hit_b == 3 and hit_a + hit_c == 3, (hit_a, hit_b, hit_c)  # one entry evicted
        w.get_transfer_results({"a", "b", "c"})

        def load_and_check(wk, tensors, hashes, src_ids, hit, want_src):
            before = {n: t.clone() for n, t in tensors.items()}
            dst = [[19, 20, 21], [22, 23, 17]]
            wk.start_load_kv(TpuSyncMetadata(loads=[TierOp("x", hashes, dst[0], None, dst)]))
            want = {n: t.clone() for n, t in before.items()}
            for name, g in ((L0, 0), (L1, 1)):
                for i in range(hit):
                    want[name][dst[g][i]] = want_src[name][src_ids[g][i]]
            for name in (L0, L1):
                assert torch.equal(tensors[name], want[name]), name
            if hit < len(hashes):
                assert set(wk.get_block_ids_with_load_errors()) == {x for g in dst for x in g[hit:]}

        # a's load delivers a's own bytes of its surviving prefix only.
        load_and_check(w, kv, a, ga, hit_a, orig)
        w.shutdown()
        w = None
        # A restarted worker (new tensors) re-attaches the segment: the same hits, b's bytes.
        w2 = worker(configs, "kv_both", extra)
        kv2 = kv_tensors(8)
        w2.register_kv_caches(kv2)
        assert lookup(w2, "b", b) == 3 and lookup(w2, "a", a) == hit_a and lookup(w2, "c", c) == hit_c
        load_and_check(w2, kv2, b, gb, 3, orig)
    finally:
        for x in (w, w2):
            if x is not None:
                x.shutdown()
        try:
            tpu_sync.remove_segment(shm, force=True)
        except Exception:
            pass


# ---- TP > 1 with KV cache groups: the connector's layouts through the Python API -----------


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_grouped_pd_reshards_tp_byte_exact(configs, src_tp, dst_tp, layerwise):
    """The connector's grouped layout and placements (:meth:`KvGeometry.tpu_sync_layout`,
    ``compat.placement``, ``compat.pullers_of_rank``) of vLLM's sliding-window + full-attention
    groups at producer TP ``src_tp`` and consumer TP ``dst_tp``: one endpoint per TP rank (as
    one per vLLM worker), tensors shaped as vLLM's CPU backend allocates them per rank
    (``[blocks, 2 / tp, 32, 64]``). Each consumer rank receives exactly its KV heads of each
    group's held blocks (head ``h`` of a TP=1 block is head 0 of rank ``h``'s block), every
    other byte unchanged; whole-request and layer-wise."""
    import dataclasses

    import tpu_sync
    from tpu_sync.vllm import compat

    base = connector(configs["kv_both"]).geometry
    n = 100
    geo = {tp: dataclasses.replace(base, tp=tp, heads_per_rank=base.num_kv_heads // tp) for tp in (src_tp, dst_tp)}
    held_src, held_dst = [[12, 13, 14], [9, 4, 7, 3]], [[21, 22, 23], [5, 6, 8, 10]]
    assert base.group_held_ids(([0] + held_src[0], held_src[1]), n) == held_src
    src_p = compat.placement(geo[src_tp].tpu_sync_layout(NUM_BLOCKS), held_src)
    dst_p = compat.placement(geo[dst_tp].tpu_sync_layout(NUM_BLOCKS), held_dst)

    def rank_kv(tp, seed):
        g = torch.Generator().manual_seed(seed)
        return [{name: torch.rand((NUM_BLOCKS, 2 // tp, BS, 64), generator=g, dtype=torch.float32) + seed + 0.25 * i
                 for i, name in enumerate((L0, L1))} for _ in range(tp)]

    src, dst = rank_kv(src_tp, 21), rank_kv(dst_tp, 31)
    before = [{k: t.clone() for k, t in r.items()} for r in dst]
    client = tpu_sync.Client()
    # Named per rank: endpoints of one process would otherwise share the process's default name
    # (each vLLM worker is a process of its own).
    prods = [tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=10, staging_budget_bytes=1 << 28, client=client,
                               name=f"prefill-rank{r}") for r in range(src_tp)]
    conss = [tpu_sync.Endpoint(listen=None, timeout=10, client=client, name=f"decode-rank{r}") for r in range(dst_tp)]
    try:
        views = lambda r: [client.view(r[L0]), client.view(r[L1])]  # noqa: E731 - cache layer order
        for rank, ep in enumerate(prods):
            pullers = compat.pullers_of_rank(src_p, rank, n, dst_tp)
            assert pullers == (dst_tp if src_tp == 1 else 1)
            if layerwise:
                ep.register_layers(80, src_p, n, {rank: views(src[rank])}, layers_ready=0, expected_releases=pullers)
            else:
                ep.register(80, src_p, n, {rank: views(src[rank])}, expected_releases=pullers)
        peers = {rank: ep.address for rank, ep in enumerate(prods)}
        handles = [ep.pull(80, peers, src_p, dst_p, n, {rank: views(dst[rank])}, layerwise=layerwise)
                   for rank, ep in enumerate(conss)]
        want = [{k: t.clone() for k, t in r.items()} for r in before]
        for name, s_ids, d_ids in ((L0, held_src[0], held_dst[0]), (L1, held_src[1], held_dst[1])):
            for h in range(base.num_kv_heads):
                sr, sh = (h, 0) if src_tp == 2 else (0, h)
                dr, dh = (h, 0) if dst_tp == 2 else (0, h)
                for s_, d in zip(s_ids, d_ids):
                    want[dr][name][d, dh] = src[sr][name][s_, sh]
        if layerwise:
            for ep in prods:
                assert ep.publish_layers(80, 1) == 1
            for h in handles:
                assert h.wait_layers(1, timeout=30)
            for r in range(dst_tp):
                assert torch.equal(dst[r][L0], want[r][L0]) and torch.equal(dst[r][L1], before[r][L1]), r
            for ep in prods:
                assert ep.publish_layers(80, 2) == 2
        for h in handles:
            h.wait(timeout=30)
        for r in range(dst_tp):
            for name in (L0, L1):
                assert torch.equal(dst[r][name], want[r][name]), (r, name)
        for ep in prods:  # the consumers' releases arrive after their transfers completed
            deadline = time.monotonic() + 30
            while ep.registration_state(80) == "active" and time.monotonic() < deadline:
                time.sleep(0.02)
            assert ep.registration_state(80) == "released"
    finally:
        for ep in conss + prods:
            ep.close()
        client.close()


# ---- Mamba state groups: vLLM's CPU layout through the Python API ----------------------------


def test_mamba_state_group_of_vllms_cpu_layout_moves_byte_exact():
    """The groups vLLM's CPU backend makes for the tiny granite-4.0-h style hybrid
    (``build_tiny_hybrid.py --kind granite``, measured: docs/vllm.md): a Mamba2 state group
    (conv ``(3, 288)`` + SSM ``(4, 64, 16)`` f32 in 32 KiB padded pages) and a full-attention
    group of block size 64. The connector refuses them (the reasons are in docs/vllm.md); the
    library's state groups move them: a pull between two endpoints over loopback TCP moves the
    request's state slot (its dense 19,840 bytes, not the padding) and its attention blocks,
    byte-exact, every other byte unchanged."""
    import tpu_sync
    from tpu_sync.vllm.compat import mamba_state_group

    spec = MambaSpec(block_size=1024, shapes=((3, 288), (4, 64, 16)), dtypes=(torch.float32, torch.float32),
                     page_size_padded=32768)
    kind, slot = mamba_state_group(spec)
    assert slot == 32768
    with pytest.raises(ValueError, match="TP-sharded"):
        mamba_state_group(spec, tp=2)
    dense = (3 * 288 + 4 * 64 * 16) * 4
    model = tpu_sync.hybrid_model("granite-tiny", [
        dict(name="mamba", layers=[0], kind=kind),
        dict(name="full_attention", layers=[1], kind=dict(type="attention", num_kv_heads=2, head_dim=32, dtype="f32")),
    ])
    slots, nb, bs, n = 6, 8, 64, 100

    def lay():
        return tpu_sync.layout(model, block_size=bs, order="nhd", num_blocks=[
            dict(num_blocks=slots, slot_bytes=slot),
            dict(num_blocks=nb, order="lbhnc", block_format="vllm-cpu/vec/float32")])

    src_p = tpu_sync.placement(lay(), [[[3]], [[1, 2]]])
    dst_p = tpu_sync.placement(lay(), [[[5]], [[4, 6]]])
    # Every component is f32, so the state buffer is f32 [slots, slot / 4] (a mix would be u8).
    shapes = [([slots, slot // 4], "f32", slots * slot), ([nb, 2, bs, 64], "f32", nb * 2 * bs * 64 * 4)]
    client = tpu_sync.Client(cpu_devices=1)
    prod = tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=10, staging_budget_bytes=1 << 30, client=client)
    cons = tpu_sync.Endpoint(listen=None, timeout=10, client=client)
    try:
        def bufs(seed):
            g = torch.Generator().manual_seed(seed)
            out = []
            for dims, dt, size in shapes:
                raw = torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8).numpy().tobytes()
                out.append(client.buffer_from_host(raw, shape=dims, dtype=dt))
            return out

        src, dst = bufs(11), bufs(12)
        src_b, init = [b.read() for b in src], [b.read() for b in dst]
        prod.register(41, src_p, n, {0: src})
        prod.register(42, src_p, n, {0: src})
        stats = cons.pull(41, prod.address, src_p, dst_p, n, {0: dst}).wait(timeout=30)
        got = [b.read() for b in dst]
        # The state slot: its dense bytes moved, the page padding after them not.
        want_state = bytearray(init[0])
        want_state[5 * slot:5 * slot + dense] = src_b[0][3 * slot:3 * slot + dense]
        assert got[0] == bytes(want_state)
        # The attention group: LBHNC blocks are opaque, so blocks 1, 2 land whole in 4, 6.
        lbb = 2 * bs * 64 * 4
        want_attn = bytearray(init[1])
        for s_id, d_id in ((1, 4), (2, 6)):
            want_attn[d_id * lbb:(d_id + 1) * lbb] = src_b[1][s_id * lbb:(s_id + 1) * lbb]
        assert got[1] == bytes(want_attn)
        assert stats["bytes"] == dense + 2 * lbb
        # A consumer whose state group has another shape is refused before any byte moves.
        other = MambaSpec(block_size=1024, shapes=((3, 288), (4, 64, 8)), dtypes=(torch.float32, torch.float32),
                          page_size_padded=32768)
        okind, _ = mamba_state_group(other)
        bad_model = dict(model, groups=[dict(model["groups"][0], kind=okind), model["groups"][1]])
        bad_lay = dict(lay(), model=bad_model)
        with pytest.raises(tpu_sync.errors.MismatchError):
            cons.pull(42, prod.address, dict(src_p, layout=bad_lay), dict(dst_p, layout=bad_lay), n,
                      {0: bufs(13)}).wait(timeout=30)
        assert prod.registration_state(42) == "active"
    finally:
        cons.close()
        prod.close()
        client.close()


# ---- Mamba state groups through the connector -------------------------------------------------

MAMBA = "model.layers.0.mixer"
#: a tiny Mamba2 state (conv (3, 96), SSM (2, 32, 16), f32: 5,248 dense bytes) in pages padded
#: to the attention page (2 heads x 32 tokens x 64 x 4 B), as vLLM pads them
ATTN_PAGE = 2 * BS * 64 * 4
STATE_DENSE = (3 * 96 + 2 * 32 * 16) * 4


def mamba_spec(**kw):
    args = dict(block_size=2048, shapes=((3, 96), (2, 32, 16)), dtypes=(torch.float32, torch.float32),
                page_size_padded=ATTN_PAGE)
    args.update(kw)
    return MambaSpec(**args)


def mamba_kvc(**kw):
    return kv_cache_config(groups=[KVCacheGroupSpec([MAMBA], mamba_spec(**kw)),
                                   KVCacheGroupSpec([L1], FullAttentionSpec(**ATTN))])


#: ``MambaStateShapeCalculator`` calls (vLLM ``mamba_utils.py``) of real models' shapes: the
#: tiny granite of the engine tests, Mamba-Codestral (8 groups), Qwen3-Next's gated delta net,
#: falcon-mamba (Mamba1), LFM2's short convolution and MiniMax-Text-01's linear attention.
CALCULATOR_CASES = [
    ("mamba2_state_shape", dict(intermediate_size=256, n_groups=1, num_heads=4, head_dim=64, state_size=16,
                                conv_kernel=4)),
    ("mamba2_state_shape", dict(intermediate_size=8192, n_groups=8, num_heads=128, head_dim=64, state_size=128,
                                conv_kernel=4)),
    ("gated_delta_net_state_shape", dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                                         conv_kernel_size=4)),
    ("mamba1_state_shape", dict(intermediate_size=8192, state_size=16, conv_kernel=4)),
    ("short_conv_state_shape", dict(intermediate_size=1024, conv_kernel=3)),
    ("linear_attention_state_shape", dict(num_heads=64, head_dim=96)),
]


def _tp_kw(method, tp):
    return dict(tp_size=tp) if method == "linear_attention_state_shape" else dict(tp_world_size=tp)


@pytest.mark.parametrize("method,args", CALCULATOR_CASES, ids=[c[0] + str(i) for i, c in enumerate(CALCULATOR_CASES)])
def test_state_components_split_as_vllms_calculator_at_every_tp(method, args):
    """The state components from a calculator call (``compat.state_components``) describe the
    whole model; at TP 1, 2, 4 and 8 each rank's share, as tpu_sync's layout splits it
    (``tpu_sync.Plan`` of a destination rank), is the bytes vLLM's calculator gives that TP,
    and they are the same at every TP (so engines of different TP agree on the model)."""
    import tpu_sync
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc

    from tpu_sync.vllm.compat import state_components, state_rank_bytes

    seen = None
    for tp in (1, 2, 4, 8):
        try:
            shapes = getattr(calc, method)(**args, **_tp_kw(method, tp))
        except AssertionError:  # vLLM's divide(): the model does not split over this TP
            continue
        dts = ["bf16"] * (len(shapes) - 1) + ["f32"]
        comps = state_components(method, dict(args, **_tp_kw(method, tp)), shapes, dts, tp)
        seen = seen or comps
        assert comps == seen, f"TP={tp} describes another model"
        want = [int(torch.tensor(s).prod()) * (4 if dt == "f32" else 2) for s, dt in zip(shapes, dts)]
        kind = dict(type="state", components=comps)
        assert state_rank_bytes(kind, tp) == want
        # The native layout agrees: a pull of one slot to a rank moves the rank's share.
        model = tpu_sync.hybrid_model("m", [dict(name="s", layers=[0], kind=kind), dict(
            name="a", layers=[1], kind=dict(type="attention", num_kv_heads=8, head_dim=16, dtype="f32"))])
        src = tpu_sync.placement(tpu_sync.layout(model, num_blocks=[4, 4]), [[[1]], [[0]]])
        dlay = tpu_sync.layout(model, tp=tp, num_blocks=[4, 4])
        dst = tpu_sync.placement(dlay, [[[2]] * tp, [[0]] * tp])
        plan = tpu_sync.Plan(src, dst, 16)
        try:
            per_rank = {}
            for sp in plan.spans():
                if sp.dst_buffer == 0:
                    per_rank[sp.dst_rank] = per_rank.get(sp.dst_rank, 0) + sp.len * sp.count
        finally:
            plan.close()
        assert per_rank == {r: sum(want) for r in range(tp)}, (tp, per_rank, want)


def _rank_channels(comp, tp, r):
    """Global channel ids that rank ``r`` of ``tp`` holds of a convolution state component
    (rows of channels: each segment's heads split in contiguous chunks, one head per rank when
    TP exceeds the heads, as ``tpu_sync::layout::HeadSplit``)."""
    out, base = [], 0
    for sg in comp["segments"]:
        h, e = sg["heads"], sg["head_elems"]
        per, rep = max(h // tp, 1), max(tp // h, 1)
        first = r // rep * per
        out += range(base + first * e, base + (first + per) * e)
        base += h * e
    return out


@pytest.mark.parametrize("n_groups", [1, 2, 8])
def test_mamba2_conv_channels_per_rank_are_vllms_weight_split(n_groups):
    """Which convolution channels each TP rank of a Mamba2 layer holds, as vLLM's weight loading
    splits the conv1d weight (``mamba_v2_sharded_weight_loader`` when the groups do not divide
    over TP, with one group replicated on every rank; chunks of each of x, B and C otherwise),
    equals the channels ``compat.state_components`` assigns that rank: the state tpu_sync moves
    to a rank is the state that rank's kernel keeps."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc

    from tpu_sync.vllm.compat import state_components

    inter, nh, hd, ss, k = 64, 8, 8, 16, 4
    for tp in (1, 2, 4, 8):
        if n_groups % tp and n_groups != 1:
            continue  # vLLM's MambaMixer2 refuses it
        ext = n_groups + calc.extra_groups_for_head_shards(n_groups, tp)
        shapes = calc.mamba2_state_shape(tp, inter, n_groups, nh, hd, ss, k)
        comps = state_components("mamba2_state_shape", dict(
            tp_world_size=tp, intermediate_size=inter, n_groups=n_groups, num_heads=nh, head_dim=hd, state_size=ss,
            conv_kernel=k, num_spec=0), shapes, ["bf16", "f32"], tp)
        ids = torch.arange(inter + 2 * n_groups * ss, dtype=torch.float32).unsqueeze(1)  # weight row = channel id
        for r in range(tp):
            if n_groups % tp == 0:
                got = []
                for start, n in ((0, inter), (inter, n_groups * ss), (inter + n_groups * ss, n_groups * ss)):
                    got += range(start + r * n // tp, start + (r + 1) * n // tp)
            else:
                gss = ext * ss
                part = torch.zeros((inter + 2 * gss) // tp, 1)
                spec = [(inter, 0, False), (gss, (ext - n_groups) * ss, n_groups == 1),
                        (gss, (ext - n_groups) * ss, n_groups == 1)]
                mamba_v2_sharded_weight_loader(spec, tp, r)(part, ids)
                got = part.squeeze(1).long().tolist()
            assert list(got) == _rank_channels(comps[0], tp, r), (n_groups, tp, r)


def test_state_components_refuse_what_does_not_match_the_spec():
    from tpu_sync.vllm.compat import mamba_state_group, state_components

    args = dict(intermediate_size=256, n_groups=1, num_heads=4, head_dim=64, state_size=16, conv_kernel=4)
    with pytest.raises(ValueError, match="per-rank shapes"):
        state_components("mamba2_state_shape", args, [(3, 160), (2, 64, 8)], ["f32", "f32"], 2)
    with pytest.raises(ValueError, match="no TP split of a kda_state_shape"):
        state_components("kda_state_shape", args, [(3, 160)], ["f32"], 2)
    with pytest.raises(ValueError, match="splits 4 heads over TP 3"):
        state_components("linear_attention_state_shape", dict(num_heads=4, head_dim=8), [(1, 8, 8)], ["f32"], 3)
    # A spec the split does not describe: refused at TP > 1, one rank's opaque state at TP = 1.
    spec = MambaSpec(block_size=1024, shapes=((3, 288), (4, 64, 8)), dtypes=(torch.float32, torch.float32))
    with pytest.raises(ValueError, match="per-rank shapes"):
        mamba_state_group(spec, 2, ("mamba2_state_shape", args))
    kind, _ = mamba_state_group(spec, 1, ("mamba2_state_shape", args))
    assert [c["segments"] for c in kind["components"]] == [[dict(heads=1, head_elems=288)],
                                                           [dict(heads=1, head_elems=512)]]


def test_geometries_whose_state_pages_differ_by_tp_match():
    """vLLM pads a rank's state page to its attention page, which halves with TP: the slot
    strides of two engines differ while their state is the same (``KvGeometry.mismatch``);
    a producer counting a decode instance's pullers plans it without its own stride."""
    from tpu_sync.vllm.compat import pullers_of_rank

    # The tiny granite's: 19,840 bytes at TP=1, 10,112 per rank at TP=2.
    state = dict(type="state", components=[dict(name="conv", dtype="f32", rows=3, segments=[
        dict(heads=4, head_elems=64), dict(heads=1, head_elems=16), dict(heads=1, head_elems=16)]),
        dict(name="ssm", dtype="f32", rows=1, segments=[dict(heads=4, head_elems=1024)])])

    def geo(tp, slot):
        return KvGeometry(model="m", num_layers=2, num_kv_heads=2, heads_per_rank=2 // tp, head_dim=32, dtype="f32",
                          block_size=64, tp=tp, block_format="vllm-cpu/vec/float32", groups=(
                              dict(kind="state", layers=[0], state=state, slot_bytes=slot),
                              dict(kind="attention", layers=[1], sliding_window=None)))

    assert geo(1, 32768).mismatch(geo(2, 16384).to_dict()) is None
    other = dict(state, components=[dict(state["components"][0], rows=2)])
    g3 = geo(2, 16384)
    g3 = dataclasses.replace(g3, groups=(dict(g3.groups[0], state=other), g3.groups[1]))
    assert "groups" in (geo(1, 32768).mismatch(g3.to_dict()) or "")
    # A TP=2 producer's slot stride (16 KiB) is smaller than a TP=1 rank's state: counting a
    # TP=1 decode instance's pullers must not carry it over.
    lay = geo(2, 16384).tpu_sync_layout(8)
    src = dict(layout=lay, dp_rank=0, block_ids=[[[1], [1]], [[2], [2]]])
    assert pullers_of_rank(src, 0, 64, 1) == 1 and pullers_of_rank(src, 1, 64, 1) == 1


def _gdn_case():
    """A small gated delta net (4 key heads, 8 value heads of 8 x 8, kernel 4) as vLLM's
    calculator shapes it."""
    return "gated_delta_net_state_shape", dict(num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=8,
                                               conv_kernel_size=4)


def _rank_state(conv, rec, parts, r, tp):
    """Rank ``r``'s slot of a whole-model state, by plain tensor slicing (an independent
    reference): each part of the convolution state's channels split in ``tp`` contiguous chunks
    (one per rank, or the one part every rank holds when it has fewer heads than ``tp``), the
    recurrent state's heads likewise."""
    cols, at = [], 0
    for heads, width in parts:
        n = heads * width
        per = max(heads // tp, 1) * width
        first = (r // max(tp // heads, 1)) * per
        cols.append(conv[:, at + first:at + first + per])
        at += n
    hv = rec.shape[0]
    per = max(hv // tp, 1)
    return torch.cat([torch.cat(cols, 1).reshape(-1), rec[(r // max(tp // hv, 1)) * per:][:per].reshape(-1)])


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1), (1, 4)])
def test_tp_sharded_state_moves_each_ranks_share_byte_exact(src_tp, dst_tp):
    """A gated-delta-net state (vLLM's split: each rank's q, k and v channels of the
    convolution state, its value heads of the recurrent state) pulled between endpoints of
    different TP over loopback TCP: every destination rank's slot holds exactly its share of the
    source's state (by plain tensor slicing of the whole-model tensors), the slot's padding and
    every other slot unchanged."""
    import tpu_sync
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc

    from tpu_sync.vllm.compat import mamba_state_group

    method, args = _gdn_case()
    parts = [(4, 8), (4, 8), (8, 8)]
    g = torch.Generator().manual_seed(5)
    conv = torch.randn(3, 32 + 32 + 64, generator=g)  # whole model: (state_len, q | k | v)
    rec = torch.randn(8, 8, 8, generator=g)

    def kind_of(tp):
        shapes = getattr(calc, method)(**args, tp_world_size=tp)
        spec = MambaSpec(block_size=64, shapes=shapes, dtypes=(torch.float32, torch.float32),
                         page_size_padded=4096)
        return mamba_state_group(spec, tp, (method, dict(args, tp_world_size=tp)))

    (skind, sslot), (dkind, dslot) = kind_of(src_tp), kind_of(dst_tp)
    assert skind == dkind and sslot == dslot == 4096

    def lay(tp):
        model = tpu_sync.hybrid_model("gdn", [dict(name="gdn", layers=[0], kind=skind), dict(
            name="full", layers=[1], kind=dict(type="attention", num_kv_heads=4, head_dim=8, dtype="f32"))])
        return tpu_sync.layout(model, tp=tp, block_size=16, num_blocks=[dict(num_blocks=4, slot_bytes=4096), 4])

    slots = 4096 // 4
    client = tpu_sync.Client(cpu_devices=1)
    prod = tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=10, staging_budget_bytes=1 << 28, client=client)
    cons = tpu_sync.Endpoint(listen=None, timeout=10, client=client)
    try:
        def bufs(tp, fill):
            out = {}
            for r in range(tp):
                st = torch.randn(4, slots, generator=g) if fill is None else fill(r)
                at = torch.randn(2, 4, 16, 4 // tp, 8, generator=g)
                out[r] = [client.buffer_from_host(st.numpy().tobytes(), shape=[4, slots], dtype="f32"),
                          client.buffer_from_host(at.numpy().tobytes(), shape=[2, 4, 16, 4 // tp, 8], dtype="f32")]
            return out

        def src_fill(r):
            st = torch.randn(4, slots, generator=g)
            mine = _rank_state(conv, rec, parts, r, src_tp)
            st[2, :mine.numel()] = mine
            return st

        src = bufs(src_tp, src_fill)
        dst = bufs(dst_tp, None)
        init = {r: [b.read() for b in bs] for r, bs in dst.items()}
        src_p = tpu_sync.placement(lay(src_tp), [[[2]] * src_tp, [[1]] * src_tp])
        dst_p = tpu_sync.placement(lay(dst_tp), [[[3]] * dst_tp, [[0]] * dst_tp])
        prod.register(7, src_p, 16, src, expected_releases=dst_tp)
        st = cons.pull(7, prod.address, src_p, dst_p, 16, dst).wait(timeout=30)
        total = 0
        for r in range(dst_tp):
            got = torch.frombuffer(bytearray(dst[r][0].read()), dtype=torch.float32).reshape(4, slots)
            want = torch.frombuffer(bytearray(init[r][0]), dtype=torch.float32).reshape(4, slots).clone()
            mine = _rank_state(conv, rec, parts, r, dst_tp)
            want[3, :mine.numel()] = mine
            assert torch.equal(got, want), f"destination rank {r}"
            total += mine.numel() * 4
        # The state shares, then the attention block's 16 tokens of 4 heads x 8 (K and V, f32).
        assert st["bytes"] == total + 16 * 4 * 8 * 2 * 4
    finally:
        cons.close()
        prod.close()
        client.close()


def test_mamba_state_group_geometry_and_start_checks(configs):
    c = connector(configs["kv_producer"], kvc=mamba_kvc())
    g = c.geometry
    assert g.has_state and g.is_state_group(0) and not g.is_state_group(1)
    assert g.groups[0]["kind"] == "state" and g.groups[0]["layers"] == [0] and g.groups[0]["slot_bytes"] == ATTN_PAGE
    assert [comp["rows"] for comp in g.groups[0]["state"]["components"]] == [3, 2]
    # One slot per request whatever its length; the attention group every block.
    assert g.held_blocks(0, 100) == (0, 1) and g.held_blocks(1, 100) == (0, 4)
    assert g.group_held_ids(([7], [9, 4, 7, 3]), 100) == [[7], [9, 4, 7, 3]]
    with pytest.raises(ValueError, match="null block"):
        g.group_held_ids(([0], [9, 4, 7, 3]), 100)
    with pytest.raises(ValueError, match="group 0 has 0 blocks"):
        g.group_held_ids(([], [9, 4, 7, 3]), 100)
    lay = g.tpu_sync_layout(NUM_BLOCKS)
    assert lay["model"]["groups"][0]["kind"]["type"] == "state"
    assert lay["groups"][0] == dict(num_blocks=NUM_BLOCKS, order="nhd", slot_bytes=ATTN_PAGE)
    import tpu_sync

    # The library accepts the layout (a state group next to an LBHNC attention group).
    plan = tpu_sync.Plan(tpu_sync.placement(lay, [[[7]], [[9, 4, 7, 3]]]),
                         tpu_sync.placement(lay, [[[5]], [[1, 2, 3, 4]]]), 100)
    try:
        assert plan.total_bytes == STATE_DENSE + 4 * ATTN_PAGE
    finally:
        plan.close()
    # A consumer whose state differs (shape, padding) refuses the producer's geometry.
    assert g.mismatch(g.to_dict()) is None
    other = connector(configs["kv_producer"], kvc=mamba_kvc(shapes=((3, 96), (2, 32, 8)))).geometry
    assert "groups" in g.mismatch(other.to_dict())
    # Another slot stride alone (vLLM pads a rank's state page to its attention page, which
    # differs with TP) is no mismatch: each side's stride is in its own layout.
    assert g.mismatch(connector(configs["kv_producer"],
                                kvc=mamba_kvc(page_size_padded=2 * ATTN_PAGE)).geometry.to_dict()) is None
    # Refused at start: offload (no state at block boundaries), layer-wise, speculative state
    # blocks, a state-only model.
    with pytest.raises(ConfigError, match="offload"):
        connector(configs["kv_both"], kvc=mamba_kvc())
    with pytest.raises(ConfigError, match="layerwise"):
        connector(vllm_config(configs["kv_both"].model_config.model, "kv_producer", extra={"layerwise": True}),
                  kvc=mamba_kvc())
    with pytest.raises(ValueError, match="speculative"):
        connector(configs["kv_producer"], kvc=mamba_kvc(num_speculative_blocks=1))
    with pytest.raises(ValueError, match="without attention"):
        connector(configs["kv_producer"], kvc=kv_cache_config(groups=[KVCacheGroupSpec([MAMBA], mamba_spec())]))


def mamba_producer_params(configs, n=100):
    p = connector(configs["kv_producer"], kvc=mamba_kvc())
    p.set_xfer_handshake_metadata({0: TpuSyncHandshake(0, "10.0.0.1:7001", p.geometry.block_format, NUM_BLOCKS)})
    toks = tokens(n)
    r = request("mp1", toks, {"do_remote_decode": True}, max_tokens=8)
    p.on_new_request(r)
    return p, toks, r


def test_mamba_producer_prefills_the_prompt_less_its_last_token(configs):
    p, toks, r = mamba_producer_params(configs)
    # The producer computes KV and state after tokens [0, 99): the consumer computes token 99.
    assert r.num_prompt_tokens == 99 and list(r.prompt_token_ids) == toks[:99] and r.num_tokens == 99
    assert r.max_tokens == 1 and r.kv_transfer_params["tpu_sync_truncated"] is True
    p.on_new_request(r)  # once only (a preempted request is not shortened again)
    assert r.num_prompt_tokens == 99 and p.scheduler_side.stats["state_truncated"] == 1
    r.num_computed_tokens, r.status = 99, RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.request_finished_all_groups(r, ([7], [9, 4, 7, 3]))
    assert delay is True
    assert params["remote_block_ids"] == [[7], [9, 4, 7, 3]] and params["remote_num_tokens"] == 99
    (send,) = p.build_connector_meta(sched_out({})).sends
    assert send.block_ids == [[7], [9, 4, 7, 3]] and send.num_tokens == 99
    # A state slot that is vLLM's null block hands nothing off.
    r2 = request("mp2", tokens(100, seed=1), {"do_remote_decode": True})
    p.on_new_request(r2)
    r2.num_computed_tokens, r2.status = 99, RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.request_finished_all_groups(r2, ([0], [9, 4, 7, 3])) == (False, None)
    # A request that is not P/D is left whole.
    r3 = request("mp3", tokens(100, seed=2))
    p.on_new_request(r3)
    assert r3.num_prompt_tokens == 100


def test_mamba_consumer_loads_all_but_the_last_prompt_token(configs):
    p, toks, r = mamba_producer_params(configs)
    r.num_computed_tokens, r.status = 99, RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.request_finished_all_groups(r, ([7], [9, 4, 7, 3]))
    c = connector(configs["kv_consumer"], kvc=mamba_kvc())
    d = request("md1", toks, dict(params))
    c.on_new_request(d)
    assert d.num_prompt_tokens == 100  # a consumer never shortens
    # 99 tokens arrive; vLLM computes the 100th from the pulled state (no re-applied token).
    assert c.get_num_new_matched_tokens(d, 0) == (99, True)
    # The pull restores every group: vLLM must not zero the state slot it writes.
    assert c.get_loaded_kv_cache_group_ids(d) == (0, 1)
    c.update_state_after_alloc(d, blocks([11], [5, 6, 8, 10]), 99)
    (spec,) = c.build_connector_meta(sched_out({})).recvs
    assert spec.src_block_ids == [[7], [9, 4, 7, 3]] and spec.dst_block_ids == [[11], [5, 6, 8, 10]]
    assert spec.num_tokens == 99 and spec.src_layout["groups"][0]["slot_bytes"] == ATTN_PAGE
    # A consumer state slot that is the null block: a pull that fails at once, nothing written.
    d2 = request("md2", toks, dict(params))
    assert c.get_num_new_matched_tokens(d2, 0) == (99, True)
    c.update_state_after_alloc(d2, blocks([0], [5, 6, 8, 10]), 99)
    (spec,) = c.build_connector_meta(sched_out({})).recvs
    assert spec.src_block_ids == []


@pytest.mark.parametrize("tamper", ["whole-prompt", "state-shape", "slot-count", "no-state-group"])
def test_mamba_consumer_refuses_params_it_cannot_use(configs, tamper):
    from tpu_sync.vllm.compat import prompt_digest

    p, toks, r = mamba_producer_params(configs)
    r.num_computed_tokens, r.status = 99, RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.request_finished_all_groups(r, ([7], [9, 4, 7, 3]))
    bad = dict(params)
    if tamper == "whole-prompt":
        # A producer whose state took the last prompt token too (not shortened): vLLM would
        # apply that token a second time.
        bad.update(remote_num_tokens=100, remote_prompt_digest=prompt_digest(toks), remote_block_ids=[[7], [9, 4, 7, 3]])
    elif tamper == "state-shape":
        other = connector(configs["kv_producer"], kvc=mamba_kvc(shapes=((3, 96), (2, 32, 8)))).geometry
        bad["remote_geometry"] = other.to_dict()
    elif tamper == "slot-count":
        bad["remote_block_ids"] = [[7, 8], [9, 4, 7, 3]]
    else:
        bad["remote_geometry"] = connector(configs["kv_producer"]).geometry.to_dict()  # sliding + full
    c = connector(configs["kv_consumer"], kvc=mamba_kvc())
    d = request("md3", toks, bad)
    assert c.get_num_new_matched_tokens(d, 0) == (0, False)
    assert c.scheduler_side.stats["refused_params"] == 1
    c.update_state_after_alloc(d, blocks([11], [5, 6, 8, 10]), 0)
    meta = c.build_connector_meta(sched_out({}))
    assert not meta.recvs and [rj.xfer_id for rj in meta.rejects] == [params["remote_request_id"]]


def mamba_tensors(seed):
    """vLLM's CPU layout of the two layers: one raw page pool shared by both groups (a block id
    is either a state slot or an attention block); the attention layer sees it as f32 [blocks,
    2, BS, 64], the Mamba layer as raw int8 [blocks, 1, 1, dense state bytes] with the page
    stride. Random, non-repeating contents."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (NUM_BLOCKS * ATTN_PAGE,), generator=g, dtype=torch.int8)
    attn = raw.view(torch.float32).view(NUM_BLOCKS, 2, BS, 64)
    state = torch.as_strided(raw, (NUM_BLOCKS, 1, 1, STATE_DENSE), (ATTN_PAGE, STATE_DENSE, STATE_DENSE, 1))
    return raw, {MAMBA: state, L1: attn}


def mamba_worker(configs, role, kvc=None, extra=None):
    from tpu_sync.vllm.worker import WorkerSide

    c = connector(configs[role], kvc=kvc or mamba_kvc())
    return WorkerSide(configs[role], ConnectorConfig.parse(role, extra or {}), c.geometry)


def mamba_pd(prod, cons, xfer, held_src, held_dst, tokens=99):
    """Registers request ``xfer`` (``tokens`` tokens at ``held_src``) on the producer worker and
    pulls it into ``held_dst`` of the consumer's; asserts it finished. Returns the layout."""
    from test_tpu_engine_layouts import wait_recv

    prod.start_load_kv(TpuSyncMetadata(sends=[SendSpec("p1", xfer, held_src, tokens, 60.0)]))
    assert prod.stats["registered"] == 1, prod.stats
    layout = prod.geometry.tpu_sync_layout(NUM_BLOCKS)
    cons.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d1", xfer, {0: prod.transport.address}, layout, held_src,
                                                        held_dst, tokens, 30.0)]))
    res = wait_recv(cons)
    assert res.finished_recving == {"d1"} and not res.failed_recving, cons.stats
    return layout


def test_mamba_worker_pd_moves_state_slot_and_blocks_byte_exact(configs):
    prod = mamba_worker(configs, "kv_producer")
    cons = mamba_worker(configs, "kv_consumer")
    src_raw, src = mamba_tensors(1)
    dst_raw, dst = mamba_tensors(2)
    before = dst_raw.clone()
    try:
        prod.register_kv_caches(src)
        cons.register_kv_caches(dst)
        held_src, held_dst = [[7], [9, 4, 12, 3]], [[11], [5, 6, 8, 10]]
        layout = mamba_pd(prod, cons, 78, held_src, held_dst)
        want = before.clone()
        # The state slot: its dense bytes, not the page padding after them.
        want[11 * ATTN_PAGE:11 * ATTN_PAGE + STATE_DENSE] = src_raw[7 * ATTN_PAGE:7 * ATTN_PAGE + STATE_DENSE]
        for s_id, d_id in zip(held_src[1], held_dst[1]):
            want[d_id * ATTN_PAGE:(d_id + 1) * ATTN_PAGE] = src_raw[s_id * ATTN_PAGE:(s_id + 1) * ATTN_PAGE]
        assert torch.equal(dst_raw, want)
        assert not torch.equal(dst_raw[11 * ATTN_PAGE + STATE_DENSE:12 * ATTN_PAGE],
                               src_raw[7 * ATTN_PAGE + STATE_DENSE:8 * ATTN_PAGE])

        # Bad input at the worker: two slots for the state group fail the pull, nothing written.
        snap = dst_raw.clone()
        cons.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d2", 78, {0: prod.transport.address}, layout,
                                                            [[7, 8], held_src[1]], [[13, 14], held_dst[1]], 99,
                                                            5.0)]))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            res = cons.get_transfer_results(set())
            if res.finished_recving:
                break
            time.sleep(0.02)
        assert res.failed_recving == {"d2"}, cons.stats
        assert torch.equal(dst_raw, snap)
        # A source layout whose state differs from the producer's registration (another SSM
        # state shape): refused at the handshake before any byte moves.
        other = mamba_worker(configs, "kv_producer", kvc=mamba_kvc(shapes=((3, 96), (2, 32, 8)))).geometry
        bad_layout = other.tpu_sync_layout(NUM_BLOCKS)
        prod.start_load_kv(TpuSyncMetadata(sends=[SendSpec("p3", 79, held_src, 99, 60.0)]))
        cons.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d3", 79, {0: prod.transport.address}, bad_layout,
                                                            held_src, held_dst, 99, 5.0)]))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            res = cons.get_transfer_results(set())
            if res.finished_recving:
                break
            time.sleep(0.02)
        assert res.failed_recving == {"d3"}, cons.stats
        assert torch.equal(dst_raw, snap)
    finally:
        cons.shutdown()
        prod.shutdown()



def torchtpu_mamba_tensors(seed):
    """vLLM-TorchTPU's per-layer caches of the same two layers (``initialize_kv_cache`` with a
    KV connector: the Mamba layer a tuple of separate tensors ``torch.zeros((num_blocks,
    *shape), dtype)`` per state shape, indexed by vLLM's block table; the attention layer its
    own tensor). Random, non-repeating contents."""
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn((NUM_BLOCKS, 3, 96), generator=g)
    ssm = torch.randn((NUM_BLOCKS, 2, 32, 16), generator=g)
    attn = torch.randn((NUM_BLOCKS, 2, BS, 64), generator=g)
    return {MAMBA: (conv, ssm), L1: attn}


def _slot_state(kv, slot):
    """The state bytes of ``slot`` (conv then SSM, as in a page) of either form."""
    st = kv[MAMBA]
    if isinstance(st, tuple):
        return torch.cat([x[slot].reshape(-1).view(torch.uint8) for x in st])
    return st[slot].reshape(-1).view(torch.uint8)


def _attn_block(kv, b):
    return kv[L1][b].reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("src_form,dst_form,copy_api", [
    ("torchtpu", "cpu", "torch"),            # vLLM-TorchTPU producer -> vLLM CPU consumer (in place)
    ("cpu", "torchtpu", "batch_transfer"),   # and back, through torch_tpu's batched copies' call shape
    ("torchtpu", "torchtpu", "auto"),        # separate state tensors pick framework-copy themselves
    ("cpu", "cpu", "framework-copy"),        # the CPU page pool through torch's copies
])
def test_mamba_worker_pd_through_torch_copies_byte_exact(configs, monkeypatch, src_form, dst_form, copy_api):
    """Mamba state slots of vLLM-TorchTPU's per-layer caches (a tuple of separate state tensors
    per layer) move through torch's copies (``framework-copy``): the host mirror lays each
    slot's tensors one after another as vLLM's page does, so a slot goes between such an engine
    and one with vLLM's CPU page pool either way. Byte-exact: the consumer's slot holds the
    producer's conv and SSM state, its attention blocks the producer's, every other block,
    slot and the page padding unchanged; the producer unchanged."""
    if copy_api == "batch_transfer":
        from test_torch_kv import install_batch_transfer_stand_in

        install_batch_transfer_stand_in(monkeypatch)

    def extra(form):
        if form == "cpu" and copy_api != "framework-copy":
            return {}  # viewed in place
        if copy_api in ("auto", "framework-copy"):
            return {} if copy_api == "auto" else {"torch_backend": "framework-copy"}
        return {"torch_backend": "framework-copy", "torch_copy_api": copy_api}

    def tensors(form, seed):
        if form == "cpu":
            raw, kv = mamba_tensors(seed)
            return raw, kv
        kv = torchtpu_mamba_tensors(seed)
        return None, kv

    prod = mamba_worker(configs, "kv_producer", extra=extra(src_form))
    cons = mamba_worker(configs, "kv_consumer", extra=extra(dst_form))
    src_raw, src = tensors(src_form, 1)
    dst_raw, dst = tensors(dst_form, 2)
    src_before = {n: (tuple(x.clone() for x in v) if isinstance(v, tuple) else v.clone()) for n, v in src.items()}
    dst_before = {n: (tuple(x.clone() for x in v) if isinstance(v, tuple) else v.clone()) for n, v in dst.items()}
    dst_raw_before = None if dst_raw is None else dst_raw.clone()
    try:
        prod.register_kv_caches(src)
        cons.register_kv_caches(dst)
        for w, form in ((prod, src_form), (cons, dst_form)):
            st = w.adapter_stats
            moved = form == "torchtpu" or copy_api == "framework-copy"
            assert st["backend"] == ("framework-copy" if moved else "pjrt-view"), st
            if moved and copy_api == "batch_transfer":
                assert st["copy_api"] == "batch_transfer", st
        held_src, held_dst = [[7], [9, 4, 12, 3]], [[11], [5, 6, 8, 10]]
        mamba_pd(prod, cons, 79, held_src, held_dst)
        # The state slot and the attention blocks, byte for byte.
        assert torch.equal(_slot_state(dst, 11), _slot_state(src, 7))
        for s_id, d_id in zip(held_src[1], held_dst[1]):
            assert torch.equal(_attn_block(dst, d_id), _attn_block(src, s_id)), (s_id, d_id)
        # Everything else as it was: other slots and blocks, and (a page pool) the padding.
        written = set(held_dst[1]) | {11}
        for b in range(NUM_BLOCKS):
            if b not in written:
                assert torch.equal(_slot_state(dst, b), _slot_state(dst_before, b)), b
                assert torch.equal(_attn_block(dst, b), _attn_block(dst_before, b)), b
        if dst_raw is not None:
            pad = slice(11 * ATTN_PAGE + STATE_DENSE, 12 * ATTN_PAGE)
            assert torch.equal(dst_raw[pad], dst_raw_before[pad])
        for n, v in src.items():  # as bits: the page pool's random bytes hold NaN patterns
            for a, b in zip(v if isinstance(v, tuple) else (v,),
                            src_before[n] if isinstance(v, tuple) else (src_before[n],)):
                assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), n
    finally:
        prod.shutdown()
        cons.shutdown()


def test_mamba_state_tensors_that_differ_from_the_group_are_refused(configs):
    """A state layer's tuple of tensors against its MambaSpec group: another number of tensors,
    another shape or dtype, or ``pjrt-view`` asked for separate tensors, refused by name."""
    from tpu_sync import errors

    kv = torchtpu_mamba_tensors(3)
    conv, ssm = kv[MAMBA]
    for bad, match in [((conv,), "registered 1 tensors"),
                       ((conv, ssm[:, :, :, :8].contiguous()), "tensor 1"),
                       ((conv.double(), ssm), "tensor 0"),
                       ((conv[:NUM_BLOCKS - 1], ssm), "tensor 0")]:
        w = mamba_worker(configs, "kv_producer")
        try:
            with pytest.raises(ValueError, match=match):
                w.register_kv_caches({MAMBA: bad, L1: kv[L1]})
        finally:
            w.shutdown()
    w = mamba_worker(configs, "kv_producer", extra={"torch_backend": "pjrt-view"})
    try:
        with pytest.raises(errors.UnsupportedError, match="separate tensors"):
            w.register_kv_caches(kv)
    finally:
        w.shutdown()
    # vLLM's CPU page pool through torch's copies: a state tensor of fewer bytes a block than
    # the group's state.
    raw, cpu = mamba_tensors(6)
    cpu[MAMBA] = torch.as_strided(raw, (NUM_BLOCKS, 1, 1, STATE_DENSE - 4), (ATTN_PAGE, STATE_DENSE, STATE_DENSE, 1))
    w = mamba_worker(configs, "kv_producer", extra={"torch_backend": "framework-copy"})
    try:
        with pytest.raises(ValueError, match=f"{STATE_DENSE - 4} B a block"):
            w.register_kv_caches(cpu)
    finally:
        w.shutdown()

def test_mamba_worker_refuses_a_state_tensor_of_another_layout(configs):
    w = mamba_worker(configs, "kv_consumer")
    raw, kv = mamba_tensors(3)
    # A block stride other than the spec's padded page.
    kv[MAMBA] = torch.as_strided(raw, (NUM_BLOCKS // 2, 1, 1, STATE_DENSE),
                                 (2 * ATTN_PAGE, STATE_DENSE, STATE_DENSE, 1))
    try:
        with pytest.raises(ValueError, match="block stride"):
            w.register_kv_caches(kv)
        assert w.transport is None  # nothing opened
    finally:
        w.shutdown()
    # Fewer state bytes per block than the spec's components.
    w = mamba_worker(configs, "kv_consumer", kvc=mamba_kvc(shapes=((3, 96), (2, 32, 32))))
    raw, kv = mamba_tensors(4)
    try:
        with pytest.raises(ValueError, match="state layer"):
            w.register_kv_caches(kv)
    finally:
        w.shutdown()
    # Layer-wise transfers through torch's copies: not supported, refused by name before
    # anything opens (state groups through them are mapped:
    # test_mamba_worker_pd_through_torch_copies_byte_exact).
    w = mamba_worker(configs, "kv_consumer", extra={"torch_backend": "framework-copy", "layerwise": True})
    raw, kv = mamba_tensors(5)
    try:
        with pytest.raises(NotImplementedError, match="layer-wise transfers with KV tensors moved by torch"):
            w.register_kv_caches(kv)
        assert w.transport is None
    finally:
        w.shutdown()


# ---- vLLM-TorchTPU: sliding-window + full-attention groups in RPA v3 caches -------------------
# vllm-torchtpu 0.29.0 ``kv_cache_materializer.py`` (``materialize_kv_cache_tensors``, direct
# allocation): one RPA v3 tensor ``[num_blocks, block_size, R, P, D']`` per region of vLLM's
# ``KVCacheTensor``, and the layers at one position of every group (here the sliding layer 0 and
# the full layer 1) are bound to the same tensor; each group reads and writes it at its own
# block ids.

#: the three ways a worker reaches the tensors: viewed in place, torch's ``Tensor.copy_``, and
#: torch_tpu's batch_transfer call shape (the stand-in of ``test_torch_kv.py``)
from test_tpu_engine_layouts import BACKENDS as TPU_BACKENDS, drop_during_loads  # noqa: E402


def _tpu_refs():
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(here)), "bindings", "python", "tests"))
    from test_tpu_layouts import DTYPES, logical_kv, merge_kv

    return DTYPES, logical_kv, merge_kv


def rpa3_geometry(configs, tp):
    """The sliding-window model's groups (vLLM's KVCacheConfig, 2 KV heads of 32) on a TPU
    platform: RPA v3, bf16 (``[BS, R, 2, 128]`` per block: 2 slots per packed row, 96 padding
    lanes per slot), TP ``tp``."""
    import dataclasses

    base = connector(configs["kv_both"]).geometry
    return dataclasses.replace(base, dtype="bf16", kv_order="rpa3", block_format="vllm-tpu/rpa3/bf16", tp=tp,
                               heads_per_rank=base.num_kv_heads // tp)


def rpa3_group_tensor(g, rank, tokens, held, seed, fill_seed):
    """One TP rank's shared tensor of both layers: every token slot filled as ``merge_kv``
    writes it (logical KV of seed ``fill_seed``), then the request's ``tokens`` tokens of seed
    ``seed`` of layer 0 at the sliding group's ``held[0]`` (the request's last blocks) and of
    layer 1 at the full group's ``held[1]``. Returns ``(tensor, merged)``: ``merged[layer]`` the
    request's ``[tokens, R, P, D']`` rows of this rank."""
    import numpy as np

    DTYPES, logical_kv, merge_kv = _tpu_refs()
    np_t = DTYPES[g.dtype]
    sl = slice(rank * g.heads_per_rank, (rank + 1) * g.heads_per_rank)
    cache = np.zeros((NUM_BLOCKS,) + tuple(g.layer_shape()), dtype=np_t)
    k, v = logical_kv(7, NUM_BLOCKS * BS, g.num_kv_heads, g.head_dim, np_t, fill_seed)
    cache.reshape((NUM_BLOCKS * BS,) + cache.shape[2:])[:] = merge_kv(k[:, sl], v[:, sl], g.packing, False)
    merged = []
    nblocks = -(-tokens // BS)
    for layer, ids in enumerate(held):
        k, v = logical_kv(layer, tokens, g.num_kv_heads, g.head_dim, np_t, seed)
        m = merge_kv(k[:, sl], v[:, sl], g.packing, False)
        merged.append(m)
        first = nblocks - len(ids)
        for t in range(first * BS, tokens):
            cache[ids[t // BS - first], t % BS] = m[t]
    t = torch.empty(cache.shape, dtype=torch.int16)
    t.copy_(torch.from_numpy(cache.view(np.int16)))
    return t.view(torch.bfloat16), merged


@pytest.mark.parametrize("split", [1, 2], ids=["blocks", "kernel-pages"])
@pytest.mark.parametrize("backend", sorted(TPU_BACKENDS))
def test_worker_pd_of_rpa3_groups_byte_exact(configs, monkeypatch, backend, split):
    """P/D TP=2 -> 1 between worker sides holding vLLM-TorchTPU's two groups in RPA v3 caches
    (one tensor per rank shared by the sliding and the full layer; on the decode also in kernel
    pages of half the scheduler's block): the decode's tensor gets
    the full layer's 100 tokens at the full group's blocks and the sliding layer's window
    (tokens 53..99: ``T + 1 - window`` on) at the sliding group's blocks, byte-exact against
    the kernels' ``merge_kv`` reference; every other token slot of those blocks, every other
    block (the other group's too, in the same tensor), and the lane and slot padding unchanged;
    the producers unchanged."""
    import numpy as np
    import vllm.distributed.parallel_state as ps

    from tpu_sync.vllm.worker import WorkerSide

    if backend == "batch-transfer":
        from test_torch_kv import install_batch_transfer_stand_in

        install_batch_transfer_stand_in(monkeypatch)
    extra = TPU_BACKENDS[backend]
    tokens = 100
    held_src, held_dst = [[12, 13, 14], [9, 4, 7, 3]], [[21, 22, 23], [5, 6, 8, 10]]
    gs, gd = rpa3_geometry(configs, 2), rpa3_geometry(configs, 1)
    src = [rpa3_group_tensor(gs, r, tokens, held_src, seed=3, fill_seed=11)[0] for r in range(2)]
    src_before = [t.clone() for t in src]
    dst, _ = rpa3_group_tensor(gd, 0, 0, [[], []], seed=3, fill_seed=12)
    dst_before = dst.clone()
    _, merged = rpa3_group_tensor(gd, 0, tokens, held_dst, seed=3, fill_seed=12)
    prods = [WorkerSide(configs["kv_producer"], ConnectorConfig.parse("kv_producer", dict(extra)), gs)
             for _ in range(2)]
    cons = WorkerSide(configs["kv_consumer"], ConnectorConfig.parse("kv_consumer", dict(extra)), gd)
    try:
        for r, w in enumerate(prods):
            monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda r=r: r)
            w.register_kv_caches({L0: src[r], L1: src[r]})
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
        # split 2: the decode's kernel runs 16-token pages of the 32-token scheduler block, its
        # one tensor [NUM_BLOCKS * 2, 16, R, P, D'] (token-major: the same bytes).
        paged = dst.view((NUM_BLOCKS * split, BS // split) + tuple(dst.shape[2:]))
        cons.register_kv_caches({L0: paged, L1: paged})
        for w in prods:
            w.start_load_kv(TpuSyncMetadata(sends=[SendSpec("p1", 78, held_src, tokens, 60.0, 1)]))
            assert w.stats["registered"] == 1, w.stats
        layout = gs.tpu_sync_layout(NUM_BLOCKS)
        assert layout["spec"]["order"] == "rpa3" and "block_format" not in layout["groups"][0]
        peers = {r: w.transport.address for r, w in enumerate(prods)}
        cons.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d1", 78, peers, layout, held_src, held_dst, tokens,
                                                            30.0)]))
        deadline, res = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            res = cons.get_transfer_results(set())
            if res.finished_recving or res.failed_recving:
                break
            time.sleep(0.02)
        assert res.finished_recving == {"d1"} and not res.failed_recving, cons.stats
        want = dst_before.view(torch.int16).numpy().copy()
        need = tokens + 1 - WINDOW
        for layer, ids in enumerate(held_dst):
            first = -(-tokens // BS) - len(ids)
            for t in range(need if layer == 0 else 0, tokens):
                want[ids[t // BS - first], t % BS] = merged[layer][t]
        got = dst.view(torch.int16).numpy()
        assert np.array_equal(got, want), np.argwhere(got != want)[:4]
        for r in range(2):
            assert torch.equal(src[r].view(torch.int16), src_before[r].view(torch.int16)), r
        if backend != "view":
            # The decode's copies: each group's blocks into its own layer only (3 + 4 blocks);
            # staged first, the blocks written in part: each group's last (the request ends
            # in it) and the sliding group's first (the window starts at token 53, inside it).
            bb = gd.layer_block_bytes
            st = cons.adapter_stats
            assert (st["commits"], st["h2d_bytes"], st["d2h_bytes"]) == (1, 7 * bb, 3 * bb), st
            for w in prods:
                assert (w.adapter_stats["stages"], w.adapter_stats["d2h_bytes"]) == (1, 7 * gs.layer_block_bytes)
    finally:
        cons.shutdown()
        for w in prods:
            w.shutdown()


@pytest.mark.parametrize("backend", sorted(TPU_BACKENDS))
def test_worker_host_tier_of_rpa3_groups(configs, monkeypatch, backend):
    """Host-tier store then load with the two groups in one shared RPA v3 tensor (TP=1): each
    group's blocks saved from, and loaded into, its own layer's view of the tensor; the sliding
    group's null block skipped; every other block unchanged."""
    import vllm.distributed.parallel_state as ps

    from tpu_sync.vllm.worker import WorkerSide

    if backend == "batch-transfer":
        from test_torch_kv import install_batch_transfer_stand_in

        install_batch_transfer_stand_in(monkeypatch)
    g = rpa3_geometry(configs, 1)
    kv, _ = rpa3_group_tensor(g, 0, 3 * BS, [[3, 4, 5], [6, 7, 8]], seed=21, fill_seed=22)
    w = WorkerSide(configs["kv_both"], ConnectorConfig.parse("kv_both", dict(TPU_BACKENDS[backend],
                                                                             host_capacity_bytes=64 << 20)), g)
    try:
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
        w.register_kv_caches({L0: kv, L1: kv})
        orig = kv.clone()
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("o1", hashes, [6, 7, 8], None, [[3, 4, 5], [6, 7, 8]])]))
        assert w.flush_saves(30)
        assert w.stats["saved_blocks"] == 3, w.stats
        w.start_load_kv(TpuSyncMetadata(lookups={"o1": hashes}))
        assert w.build_worker_meta().lookup_hits == {"o1": 3}
        drop_during_loads(monkeypatch, w, "get_groups")
        w.start_load_kv(TpuSyncMetadata(loads=[TierOp("o1", hashes, [16, 17, 18], None,
                                                      [[0, 11, 12], [16, 17, 18]])]))
        assert w.stats["loaded_blocks"] == 3 and w.stats["failed_loads"] == 0, w.stats
        want = orig.clone()
        for s, d in ((4, 11), (5, 12), (6, 16), (7, 17), (8, 18)):
            want[d] = orig[s]
        assert torch.equal(kv.view(torch.int16), want.view(torch.int16))
    finally:
        w.shutdown()


@pytest.mark.parametrize("backend", ["torch-copy", "batch-transfer"])
def test_worker_pd_of_a_mamba_hybrid_in_vllm_torchtpus_per_layer_caches(configs, monkeypatch, backend):
    """A Mamba hybrid as vLLM-TorchTPU allocates it with a KV connector (per-layer caches: the
    attention layer an RPA v3 tensor, the Mamba layer a tuple of separate state tensors over
    ``num_blocks``, indexed by vLLM's block table): P/D between worker sides through torch's
    copies. The decode's RPA v3 tensor gets the request's 99 tokens at its blocks, byte-exact
    against the kernels' ``merge_kv`` reference (every other slot, block and the lane padding
    unchanged), its state slot the producer's conv and SSM state; the producer unchanged."""
    import dataclasses

    import numpy as np

    from tpu_sync.vllm.worker import WorkerSide

    if backend == "batch-transfer":
        from test_torch_kv import install_batch_transfer_stand_in

        install_batch_transfer_stand_in(monkeypatch)
    extra = TPU_BACKENDS[backend]
    base = connector(configs["kv_producer"], kvc=mamba_kvc()).geometry
    g = dataclasses.replace(base, dtype="bf16", kv_order="rpa3", block_format="vllm-tpu/rpa3/bf16", tp=1,
                            heads_per_rank=base.num_kv_heads)
    tokens = 99
    held_src, held_dst = [[7], [9, 4, 12, 3]], [[11], [5, 6, 8, 10]]
    src_attn, _ = rpa3_group_tensor(g, 0, tokens, [[], held_src[1]], seed=3, fill_seed=11)
    dst_attn, _ = rpa3_group_tensor(g, 0, 0, [[], []], seed=3, fill_seed=12)
    _, merged = rpa3_group_tensor(g, 0, tokens, [[], held_dst[1]], seed=3, fill_seed=12)
    src_state, dst_state = torchtpu_mamba_tensors(1)[MAMBA], torchtpu_mamba_tensors(2)[MAMBA]
    before = ([x.clone() for x in src_state], src_attn.clone(), [x.clone() for x in dst_state], dst_attn.clone())
    prod = WorkerSide(configs["kv_producer"], ConnectorConfig.parse("kv_producer", dict(extra)), g)
    cons = WorkerSide(configs["kv_consumer"], ConnectorConfig.parse("kv_consumer", dict(extra)), g)
    try:
        prod.register_kv_caches({MAMBA: src_state, L1: src_attn})
        cons.register_kv_caches({MAMBA: dst_state, L1: dst_attn})
        assert cons.adapter_stats["backend"] == "framework-copy"
        layout = mamba_pd(prod, cons, 81, held_src, held_dst, tokens)
        assert layout["spec"]["order"] == "rpa3" and layout["groups"][0].get("slot_bytes") == ATTN_PAGE
        want = before[3].view(torch.int16).numpy().copy()
        for t in range(tokens):
            want[held_dst[1][t // BS], t % BS] = merged[1][t]
        got = dst_attn.view(torch.int16).numpy()
        assert np.array_equal(got, want), np.argwhere(got != want)[:4]
        for x, old, s in zip(dst_state, before[2], src_state):
            assert torch.equal(x[11], s[7])
            assert torch.equal(torch.cat([x[:11], x[12:]]), torch.cat([old[:11], old[12:]]))
        assert all(torch.equal(x, y) for x, y in zip(src_state, before[0]))
        assert torch.equal(src_attn.view(torch.int16), before[1].view(torch.int16))
    finally:
        cons.shutdown()
        prod.shutdown()
