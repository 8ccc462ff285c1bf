"""Unit tests of TpuSyncConnector's scheduler and worker logic against vLLM's real classes
(VllmConfig, KVConnectorFactory, Request with real block hashes, KVCacheBlocks,
KVConnectorOutput), without running an engine."""

import pickle
import time
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402
from tpu_sync.vllm._api import CacheHitSource  # noqa: E402  (vLLM 0.32's, or its stand-in on 0.29)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

import tpu_sync.vllm as tsv  # noqa: E402
from tpu_sync.vllm.compat import KvGeometry, prompt_digest  # noqa: E402
from tpu_sync.vllm.config import ConfigError, ConnectorConfig  # noqa: E402
from tpu_sync.vllm.metadata import RecvSpec, TpuSyncHandshake, TpuSyncMetadata, TpuSyncWorkerMetadata  # noqa: E402

BS = 32
NUM_BLOCKS = 64
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def vllm_config(model, role, extra=None, by_name=False):
    ktc = KVTransferConfig(kv_connector="TpuSyncConnector", kv_role=role, kv_connector_extra_config=extra or {},
                           kv_connector_module_path=None if by_name else "tpu_sync.vllm")
    return VllmConfig(model_config=ModelConfig(model=model, dtype="float32", max_model_len=2048),
                      cache_config=CacheConfig(block_size=BS), device_config=DeviceConfig("cpu"),
                      kv_transfer_config=ktc)


@pytest.fixture(scope="module")
def configs(tiny_model):
    return {r: vllm_config(tiny_model, r) for r in ("kv_producer", "kv_consumer", "kv_both")}


def connector(cfg, role=KVConnectorRole.SCHEDULER):
    cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    return cls(cfg, role, KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[]))


def request(rid, tokens, params=None, max_tokens=4):
    sp = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params} if params else None)
    return Request(rid, list(tokens), sp, None, block_hasher=HASHER)


def blocks(ids):
    return KVCacheBlocks((tuple(KVCacheBlock(block_id=i) for i in ids),))


def tokens(n, seed=0):
    return [(seed * 7919 + i * 131) % 1000 + 3 for i in range(n)]


def sched_out(num_scheduled):
    return SimpleNamespace(num_scheduled_tokens=dict(num_scheduled), kv_connector_block_state=None)


class FakeManager:
    def __init__(self):
        self.ids = {}

    def get_block_ids(self, rid):
        return (self.ids[rid],)


# ---- loading and configuration ---------------------------------------------------------------


def test_loads_by_module_path_and_by_registered_name(configs, tiny_model):
    cls = KVConnectorFactory.get_connector_class(configs["kv_both"].kv_transfer_config)
    assert cls.__name__ == "TpuSyncConnector" and cls.__module__ == "tpu_sync.vllm.connector"
    # The entry point's function registers the name; calling it twice is harmless.
    tsv.register()
    tsv.register()
    by_name = vllm_config(tiny_model, "kv_both", by_name=True)
    assert KVConnectorFactory.get_connector_class(by_name.kv_transfer_config) is cls
    c = connector(by_name)
    assert c.role == KVConnectorRole.SCHEDULER and c.scheduler_side is not None
    assert cls.get_required_kvcache_layout(by_name) == "LBHNC"
    import importlib.metadata as md

    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.value == "tpu_sync.vllm:register"]
    assert len(eps) == 1, "the wheel must declare the vllm.general_plugins entry point"


def test_geometry_and_block_format(configs):
    g = connector(configs["kv_both"]).geometry
    assert (g.num_layers, g.num_kv_heads, g.heads_per_rank, g.head_dim, g.dtype, g.block_size, g.tp) == (
        2, 2, 2, 32, "f32", 32, 1)
    assert g.block_format.startswith("vllm-cpu/") and g.block_format.endswith("/float32"), g.block_format
    assert g.layer_block_bytes == 2 * 32 * 64 * 4 and g.block_bytes == 2 * g.layer_block_bytes
    other = dict(g.to_dict(), block_format="vllm-cpu/amx/bfloat16", dtype="bf16")
    why = g.mismatch(other)
    assert "block_format" in why and "dtype" in why
    assert g.mismatch(dict(g.to_dict(), tp=4, heads_per_rank=1)) is None  # TP differences reshard


def test_config_is_checked():
    c = ConnectorConfig.parse("kv_both", {"shm_name": "x", "host_capacity_bytes": 1 << 20})
    assert c.offload and not c.pd and c.shm_name == "x"
    assert ConnectorConfig.parse("kv_producer", {}).is_producer
    assert ConnectorConfig.parse("kv_consumer", {}).is_consumer
    assert not ConnectorConfig.parse("kv_consumer", {}).layerwise
    assert ConnectorConfig.parse("kv_consumer", {"layerwise": True}).layerwise
    for role, extra in [("kv_both", {"shm_nme": "x"}), ("kv_both", {"verify_checksums": 1}),
                        ("kv_producer", {"layerwise": 1}),
                        ("kv_both", {"host_capacity_bytes": True}), ("kv_sender", {}),
                        ("kv_producer", {"lease_s": 0}), ("kv_producer", {"psk": "zz"}),
                        ("kv_both", {"offload": False}), ("kv_consumer", {"idle_wait_ms": -1}),
                        ("kv_consumer", {"idle_wait_ms": "5"})]:
        with pytest.raises(ConfigError):
            ConnectorConfig.parse(role, extra)


# ---- P/D -------------------------------------------------------------------------------------


def producer_params(configs, n_tokens=100, status=RequestStatus.FINISHED_LENGTH_CAPPED):
    p = connector(configs["kv_producer"])
    p.set_xfer_handshake_metadata({0: TpuSyncHandshake(0, "10.0.0.1:7001", p.geometry.block_format, NUM_BLOCKS)})
    toks = tokens(n_tokens)
    r = request("p1", toks, {"do_remote_decode": True}, max_tokens=1)
    r.num_computed_tokens = n_tokens
    r.status = status
    delay, params = p.request_finished(r, [9, 4, 7, 30, 31])
    return p, toks, delay, params


def test_producer_keeps_blocks_and_returns_params(configs):
    p, toks, delay, params = producer_params(configs)
    assert delay is True
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [9, 4, 7, 30]  # ceil(100 / 32) blocks
    assert params["remote_num_tokens"] == 100 and params["remote_addresses"] == {"0": "10.0.0.1:7001"}
    assert params["remote_prompt_digest"] == prompt_digest(toks)
    assert 1 <= params["remote_request_id"] < 2**53
    # The workers are told to serve exactly these blocks, once.
    meta = p.build_connector_meta(sched_out({}))
    assert [(s.req_id, s.block_ids, s.num_tokens) for s in meta.sends] == [("p1", [9, 4, 7, 30], 100)]
    assert p.build_connector_meta(sched_out({})).sends == []
    assert p.scheduler_side.pending_sends() == 1
    p.update_connector_output(KVConnectorOutput(finished_sending={"p1"}))
    assert p.scheduler_side.pending_sends() == 0
    pickle.loads(pickle.dumps(meta))  # crosses process boundaries


def test_producer_does_not_hand_off_aborted_or_unaddressed(configs):
    _, _, delay, params = producer_params(configs, status=RequestStatus.FINISHED_ABORTED)
    assert (delay, params) == (False, None)
    p = connector(configs["kv_producer"])  # no handshake: no address to advertise
    r = request("p2", tokens(40), {"do_remote_decode": True}, max_tokens=1)
    r.num_computed_tokens, r.status = 40, RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.request_finished(r, [1, 2]) == (False, None)
    # A plain request on a producer is not handed off.
    r = request("p3", tokens(40))
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.request_finished(r, [1, 2]) == (False, None)


def test_consumer_pulls_asynchronously_into_allocated_blocks(configs):
    _, toks, _, params = producer_params(configs)
    c = connector(configs["kv_consumer"])
    r = request("d1", toks, dict(params))
    assert c.get_num_new_matched_tokens(r, 0) == (100, True)
    assert c.get_num_new_matched_tokens(r, 0) == (100, True)  # side-effect free
    c.update_state_after_alloc(r, blocks([50, 51, 52, 53]), 100)
    assert c.get_external_cache_hit_sources(r, 100) == {CacheHitSource.P2P: 100}
    meta = c.build_connector_meta(sched_out({}))
    (spec,) = meta.recvs
    assert isinstance(spec, RecvSpec)
    assert spec.src_block_ids == [9, 4, 7, 30] and spec.dst_block_ids == [50, 51, 52, 53]
    assert spec.num_tokens == 100 and spec.peers == {0: "10.0.0.1:7001"}
    assert spec.src_layout["spec"]["order"] == "lbhnc" and spec.src_layout["block_format"] == c.geometry.block_format
    assert c.build_connector_meta(sched_out({})).recvs == []
    # The request is pulled once: a second admission (after a preemption) does not pull again.
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    # Pulled tokens count once the pull succeeded.
    assert c.scheduler_side.stats["p2p_tokens"] == 0
    c.update_connector_output(KVConnectorOutput(finished_recving={"d1"}))
    assert c.scheduler_side.stats["p2p_tokens"] == 100 and c.scheduler_side.stats["p2p_failed_tokens"] == 0


def test_tokens_recomputed_after_a_failed_pull_are_not_counted_as_pulled(configs):
    _, toks, _, params = producer_params(configs)
    c = connector(configs["kv_consumer"])
    r = request("d9", toks, dict(params))
    assert c.get_num_new_matched_tokens(r, 0) == (100, True)
    c.update_state_after_alloc(r, blocks([50, 51, 52, 53]), 100)
    c.build_connector_meta(sched_out({}))
    try:
        out = KVConnectorOutput(finished_recving={"d9"}, failed_recving={"d9"})
    except TypeError:  # vLLM 0.29: no failed_recving; the workers' metadata carries the failure
        from tpu_sync.vllm.metadata import TpuSyncWorkerMetadata

        out = KVConnectorOutput(finished_recving={"d9"}, kv_connector_worker_meta=TpuSyncWorkerMetadata(
            failed_pulls={"d9"}))
    c.update_connector_output(out)
    st = c.scheduler_side.stats
    assert st["p2p_tokens"] == 0 and st["p2p_failed_tokens"] == 100
    # vLLM re-admits it to recompute: nothing of it is attributed to P2P any more.
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    c.update_state_after_alloc(r, blocks([50, 51, 52, 53]), 0)
    assert c.get_external_cache_hit_sources(r, 0) == {}
    assert c.get_external_cache_hit_sources(r, 32) != {CacheHitSource.P2P: 32}


def test_consumer_rejects_what_it_will_not_pull(configs):
    _, toks, _, params = producer_params(configs)
    c = connector(configs["kv_consumer"])
    # Aborted before admission.
    r = request("a1", toks, dict(params))
    r.status = RequestStatus.FINISHED_ABORTED
    c.request_finished(r, [])
    # Admitted, aborted before the workers got the pull.
    r2 = request("a2", toks, dict(params, remote_request_id=params["remote_request_id"] + 1))
    assert c.get_num_new_matched_tokens(r2, 0) == (100, True)
    c.update_state_after_alloc(r2, blocks([50, 51, 52, 53]), 100)
    r2.status = RequestStatus.FINISHED_ABORTED
    c.request_finished(r2, [50, 51, 52, 53])
    meta = c.build_connector_meta(sched_out({}))
    assert meta.recvs == []
    assert [(x.req_id, x.xfer_id, x.peers) for x in meta.rejects] == [
        ("a1", params["remote_request_id"], {0: "10.0.0.1:7001"}),
        ("a2", params["remote_request_id"] + 1, {0: "10.0.0.1:7001"})]
    assert "aborted" in meta.rejects[0].reason
    # Aborted after its pull was handed to the workers: the worker rejects it, not the scheduler.
    r3 = request("a3", toks, dict(params))
    c.get_num_new_matched_tokens(r3, 0)
    c.update_state_after_alloc(r3, blocks([50, 51, 52, 53]), 100)
    assert len(c.build_connector_meta(sched_out({})).recvs) == 1
    r3.status = RequestStatus.FINISHED_ABORTED
    c.request_finished(r3, [50, 51, 52, 53])
    assert c.build_connector_meta(sched_out({})).rejects == []
    # Aborted pulls are never counted as pulled.
    c.update_connector_output(KVConnectorOutput(finished_recving={"a3"}))
    assert c.scheduler_side.stats["p2p_tokens"] == 0
    pickle.loads(pickle.dumps(meta))


def test_consumer_with_local_prefix_hit_pulls_only_the_rest(configs):
    # A local prefix-cache hit of 2 blocks (64 tokens, shared with other requests): the pull
    # covers tokens 64..100 only, into this request's own blocks 52 and 53, never the shared 50
    # and 51; the tokens count as pulled only for what moves.
    _, toks, _, params = producer_params(configs)
    c = connector(configs["kv_consumer"])
    r = request("d2", toks, dict(params))
    assert c.get_num_new_matched_tokens(r, 64) == (36, True)
    c.update_state_after_alloc(r, blocks([50, 51, 52, 53]), 36)
    meta = c.build_connector_meta(sched_out({}))
    assert meta.rejects == []
    [spec] = meta.recvs
    assert (spec.first_token, spec.num_tokens, spec.src_block_ids, spec.dst_block_ids) == (64, 100, [9, 4, 7, 30],
                                                                                          [52, 53])
    st = c.scheduler_side.stats
    assert st["p2p_partial"] == 1 and st["p2p_local_hit_tokens"] == 64
    c.update_connector_output(KVConnectorOutput(finished_recving={"d2"}))
    assert st["p2p_tokens"] == 36
    assert c.get_external_cache_hit_sources(r, 36) == {CacheHitSource.P2P: 36}
    pickle.loads(pickle.dumps(meta))
    # A hit that covers every token the producer has: nothing to pull, the rest is computed
    # here and the producer is told at once.
    r2 = request("d4", toks + [5, 6, 7], dict(params, remote_request_id=params["remote_request_id"] + 1))
    assert c.get_num_new_matched_tokens(r2, 96) == (4, True)  # 96 < 100: still pulls 96..100
    r3 = request("d5", toks, dict(params, remote_request_id=params["remote_request_id"] + 2))
    assert c.get_num_new_matched_tokens(r3, 128) == (0, False)
    c.update_state_after_alloc(r3, blocks([50, 51, 52, 53]), 0)
    assert [x.req_id for x in c.build_connector_meta(sched_out({})).rejects] == ["d5"]


def test_both_at_once_ids_agree_only_for_the_same_prompt(configs, tiny_model):
    """A router sends the prompt to both sides at once (``tpu_sync_pair``): the producer
    registers under the id derived from the nonce and its prompt, the consumer (layer-wise or
    not) pulls that id asynchronously, all its prompt tokens, from blocks it asks the producer
    for (``src_block_ids`` None); another prompt or nonce gives another id; bad pair params are
    refused and the request prefilled locally."""
    from tpu_sync.vllm.compat import PAIR_KEY, check_pair_params, pair_params, pair_xfer_id

    p, toks, _, template = producer_params(configs)
    assert p.scheduler_side.pair_template().items() <= template.items()
    nonce = "n0nce-0123456789"
    prod = p.scheduler_side
    r = request("p9", toks, {"do_remote_decode": True, PAIR_KEY: nonce}, max_tokens=1)
    xfer = prod._new_xfer(r, 100)
    assert xfer == pair_xfer_id(nonce, prompt_digest(toks)) and 1 <= xfer < 2**53
    assert xfer != pair_xfer_id(nonce, prompt_digest(toks[:-1])) != pair_xfer_id("other-nonce", prompt_digest(toks))
    r.num_computed_tokens, r.status = 100, RequestStatus.FINISHED_LENGTH_CAPPED
    _, answer = p.request_finished(r, [9, 4, 7, 30])
    assert answer["remote_request_id"] == xfer and answer[PAIR_KEY] == nonce
    params = pair_params(template, nonce)
    assert "remote_block_ids" not in params and "remote_request_id" not in params and params["do_remote_prefill"]
    assert check_pair_params(params) is None
    for cfg in (configs["kv_consumer"], vllm_config(tiny_model, "kv_consumer", {"layerwise": True})):
        c = connector(cfg)
        d = request("d9", toks, dict(params))
        assert c.get_num_new_matched_tokens(d, 0) == (100, True)
        c.update_state_after_alloc(d, blocks([50, 51, 52, 53]), 100)
        meta = c.build_connector_meta(sched_out({}))
        [spec] = meta.recvs
        assert (spec.xfer_id, spec.num_tokens, spec.src_block_ids, spec.dst_block_ids) == (xfer, 100, None,
                                                                                          [50, 51, 52, 53])
        assert meta.layer_recvs == [] and spec.peers == {0: "10.0.0.1:7001"}
        pickle.loads(pickle.dumps(meta))
    # The same nonce with another prompt: another id, so it never pulls the producer's KV.
    d = request("d10", tokens(100, seed=3), dict(params))
    assert c.get_num_new_matched_tokens(d, 0) == (100, True)
    assert d.kv_transfer_params["remote_request_id"] != xfer
    # Client-supplied fields of other types: refused, never an exception out of the scheduler.
    for bad in (dict(params, **{PAIR_KEY: "short"}), dict(params, tpu_sync_version=99),
                {k: v for k, v in params.items() if k != "remote_addresses"},
                dict(params, remote_geometry="x"), dict(params, remote_addresses=["10.0.0.1:7001"]),
                dict(params, remote_addresses={"zero": "10.0.0.1:7001"}), dict(params, remote_num_blocks="many"),
                dict(params, remote_geometry=dict(params["remote_geometry"], block_size="sixteen"))):
        assert check_pair_params(bad) is not None
        c = connector(configs["kv_consumer"])
        d = request("d11", toks, bad)
        assert c.get_num_new_matched_tokens(d, 0) == (0, False)
        assert c.scheduler_side.stats["refused_params"] == 1
    with pytest.raises(ValueError):
        pair_params(template, "short")


def test_empty_steps_are_marked_idle(configs):
    """The workers may wait for a pull in a step that computes nothing (``idle_wait_ms``)."""
    c = connector(configs["kv_consumer"])
    out = sched_out({})
    out.total_num_scheduled_tokens = 0
    assert c.build_connector_meta(out).idle is True
    out = sched_out({"r": 5})
    out.total_num_scheduled_tokens = 5
    assert c.build_connector_meta(out).idle is False
    assert ConnectorConfig.parse("kv_consumer", {}).idle_wait_ms == 10.0
    assert ConnectorConfig.parse("kv_consumer", {"idle_wait_ms": 0}).idle_wait_ms == 0


def test_layerwise_consumer_with_local_prefix_hit_loads_only_the_rest(tiny_model):
    # Layer-wise: a synchronous load of the block-aligned tokens short of the last one, from
    # the hit on (tokens 32..96 of 100).
    cfg = vllm_config(tiny_model, "kv_consumer", dict(layerwise=True))
    pcfg = vllm_config(tiny_model, "kv_producer", dict(layerwise=True))
    _, toks, _, params = producer_params({"kv_producer": pcfg})
    c = connector(cfg)
    r = request("l1", toks, dict(params))
    assert c.get_num_new_matched_tokens(r, 32) == (64, False)
    c.update_state_after_alloc(r, blocks([50, 51, 52, 53]), 64)
    [spec] = c.build_connector_meta(sched_out({})).layer_recvs
    assert (spec.first_token, spec.dst_block_ids) == (32, [51, 52, 53])
    # A hit up to the last full block: nothing left to load.
    r2 = request("l2", toks, dict(params, remote_request_id=params["remote_request_id"] + 1))
    assert c.get_num_new_matched_tokens(r2, 96) == (0, False)


@pytest.mark.parametrize("tamper", ["geometry", "prompt", "version", "blocks"])
def test_consumer_refuses_unusable_params(configs, tamper):
    _, toks, _, params = producer_params(configs)
    params = dict(params)
    if tamper == "geometry":
        params["remote_geometry"] = dict(params["remote_geometry"], block_format="vllm-cpu/amx/bfloat16")
    elif tamper == "prompt":
        toks = toks[:-1] + [toks[-1] + 1]
    elif tamper == "version":
        params["tpu_sync_version"] = 99
    else:
        params["remote_block_ids"] = params["remote_block_ids"][:-1]
    c = connector(configs["kv_consumer"])
    r = request("d3", toks, params)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    assert c.scheduler_side.stats["refused_params"] == 1
    c.update_state_after_alloc(r, blocks([50, 51, 52, 53]), 0)
    rejects = c.build_connector_meta(sched_out({})).rejects
    assert [x.req_id for x in rejects] == ["d3"]  # its params still name the producer's transfer


@pytest.mark.parametrize("field,value", [
    ("remote_geometry", "a string"), ("remote_geometry", ["a", "list"]), ("block_size", "sixteen"),
    ("remote_num_blocks", "many"), ("remote_num_blocks", 0), ("remote_addresses", {"zero": "10.0.0.1:7001"}),
    ("remote_addresses", ["10.0.0.1:7001"]), ("remote_addresses", {"-1": "10.0.0.1:7001"})])
def test_consumer_refuses_malformed_params_without_raising(configs, field, value):
    """``kv_transfer_params`` come from the client: a malformed field (a geometry or address
    map of another type, a non-integer block size, block count or TP rank) is refused as
    unusable params (the request is prefilled locally), never an exception out of the
    scheduler's hooks, which would stop the engine."""
    _, toks, _, params = producer_params(configs)
    params = dict(params)
    if field == "block_size":
        params["remote_geometry"] = dict(params["remote_geometry"], block_size=value)
    else:
        params[field] = value
    c = connector(configs["kv_consumer"])
    r = request("d4", toks, params)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    assert c.scheduler_side.stats["refused_params"] == 1
    c.update_state_after_alloc(r, blocks([50, 51, 52, 53]), 0)
    meta = c.build_connector_meta(sched_out({}))
    assert not meta.recvs


# ---- offload ---------------------------------------------------------------------------------


def test_offload_lookup_then_sync_load_and_saves(configs):
    c = connector(configs["kv_both"])
    mgr = FakeManager()
    c.bind_kv_cache_manager(SimpleNamespace(block_pool=None, **{"get_block_ids": mgr.get_block_ids}))
    toks = tokens(200, seed=3)  # 6 full blocks + 8 tokens
    r = request("o1", toks)
    c.on_new_request(r)
    # The lookup takes one step: "not known yet", and the lookup is queued once.
    assert c.get_num_new_matched_tokens(r, 0) == (None, False)
    assert c.get_num_new_matched_tokens(r, 0) == (None, False)
    meta = c.build_connector_meta(sched_out({}))
    assert list(meta.lookups) == ["o1"] and meta.lookups["o1"] == [bytes(h) for h in r.block_hashes[:6]]
    assert c.build_connector_meta(sched_out({})).lookups == {}
    c.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TpuSyncWorkerMetadata(lookup_hits={"o1": 4})))
    assert c.get_num_new_matched_tokens(r, 0) == (128, False)  # synchronous
    c.update_state_after_alloc(r, blocks(list(range(10, 17))), 128)
    assert c.get_external_cache_hit_sources(r, 128) == {CacheHitSource.HOST: 128}
    mgr.ids["o1"] = list(range(10, 17))
    r.num_computed_tokens = 128
    meta = c.build_connector_meta(sched_out({"o1": 72}))
    (load,) = meta.loads
    assert load.block_ids == [10, 11, 12, 13] and load.hashes == [bytes(h) for h in r.block_hashes[:4]]
    # This step fills prompt blocks 4 and 5: saved, not the loaded ones, not the partial tail.
    (save,) = meta.saves
    assert save.block_ids == [14, 15] and save.hashes == [bytes(h) for h in r.block_hashes[4:6]]
    r.num_computed_tokens = 200
    assert c.build_connector_meta(sched_out({"o1": 1})).saves == []


def test_offload_full_hit_leaves_one_token_and_failed_load_is_saved_again(configs):
    c = connector(configs["kv_both"])
    mgr = FakeManager()
    c.bind_kv_cache_manager(SimpleNamespace(block_pool=None, get_block_ids=mgr.get_block_ids))
    r = request("o2", tokens(128, seed=5))  # exactly 4 blocks
    c.on_new_request(r)
    c.get_num_new_matched_tokens(r, 0)
    c.build_connector_meta(sched_out({}))
    c.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TpuSyncWorkerMetadata(lookup_hits={"o2": 4})))
    assert c.get_num_new_matched_tokens(r, 0) == (96, False)  # 3 blocks: the last token is computed
    c.update_state_after_alloc(r, blocks([1, 2, 3, 4]), 96)
    mgr.ids["o2"] = [1, 2, 3, 4]
    c.build_connector_meta(sched_out({}))
    # The load failed (checksum): vLLM recomputes; the recomputed blocks are saved again.
    c.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TpuSyncWorkerMetadata(failed_loads={"o2"})))
    meta = c.build_connector_meta(sched_out({"o2": 128}))
    assert [s.block_ids for s in meta.saves] == [[1, 2, 3, 4]]
    assert c.scheduler_side.stats["failed_loads"] == 1
    # Finishing drops the state; nothing is handed off, but the blocks it saved stay allocated
    # until the workers report the (asynchronous) saves done.
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert c.request_finished(r, [1, 2, 3, 4]) == (True, None)
    assert c.scheduler_side.pending_frees() == 1 and c.has_pending_block_frees()
    assert c.build_connector_meta(sched_out({"o2": 1})).saves == []
    c.update_connector_output(KVConnectorOutput(finished_sending={"o2"}))
    assert c.scheduler_side.pending_frees() == 0


def test_a_load_that_delivered_a_prefix_is_tried_again_for_that_prefix(configs):
    """A host-tier load that delivered 2 of its 3 blocks before failing (an entry that failed
    its checksum, or a peer that evicted blocks since the lookup): the blocks after the
    delivered ones are saved again once recomputed, and a second try of the request (vLLM asks
    again after a failed asynchronous load) loads the 2 delivered blocks, never the one that
    failed."""
    c = connector(configs["kv_both"])
    mgr = FakeManager()
    c.bind_kv_cache_manager(SimpleNamespace(block_pool=None, get_block_ids=mgr.get_block_ids))
    r = request("o3", tokens(128, seed=6))
    c.on_new_request(r)
    c.get_num_new_matched_tokens(r, 0)
    c.build_connector_meta(sched_out({}))
    c.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=TpuSyncWorkerMetadata(lookup_hits={"o3": 4})))
    assert c.get_num_new_matched_tokens(r, 0) == (96, False)
    c.update_state_after_alloc(r, blocks([1, 2, 3, 4]), 96)
    mgr.ids["o3"] = [1, 2, 3, 4]
    c.build_connector_meta(sched_out({}))
    a = TpuSyncWorkerMetadata(failed_loads={"o3"}, load_delivered={"o3": 2})
    b = TpuSyncWorkerMetadata(failed_loads={"o3"}, load_delivered={"o3": 3})
    c.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=a.aggregate(b)))
    assert c.get_num_new_matched_tokens(r, 0) == (64, False)
    meta = c.build_connector_meta(sched_out({"o3": 128}))
    assert [s.block_ids for s in meta.saves] == [[3, 4]]


def test_synchronous_saves_free_blocks_at_once(tiny_model):
    # async_saves=False: saves run inside wait_for_save, so a finished request's blocks are
    # freed at once.
    c = connector(vllm_config(tiny_model, "kv_both", dict(async_saves=False)))
    mgr = FakeManager()
    c.bind_kv_cache_manager(SimpleNamespace(block_pool=None, **{"get_block_ids": mgr.get_block_ids}))
    r = request("s1", tokens(100, seed=5))
    c.on_new_request(r)
    mgr.ids["s1"] = [1, 2, 3, 4]
    assert [s.block_ids for s in c.build_connector_meta(sched_out({"s1": 100})).saves] == [[1, 2, 3]]
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert c.request_finished(r, [1, 2, 3, 4]) == (False, None)
    assert c.scheduler_side.pending_frees() == 0


def test_async_saves_report_blocks_free_only_once_saved(tiny_model):
    """The worker side's saver: wait_for_save returns while the save still runs; the request is
    reported in finished_sending only after it finished and its saves completed; a lookup of a
    block being saved waits for it; a preempted request's saves are waited for."""
    import threading

    from tpu_sync.vllm.config import ConnectorConfig
    from tpu_sync.vllm.metadata import TierOp
    from tpu_sync.vllm.worker import WorkerSide

    gate = threading.Event()

    class SlowTier:
        def __init__(self):
            self.saved = {}

        def put(self, hashes, block_ids, parent=None):
            gate.wait(30)
            for h, b in zip(hashes, block_ids):
                self.saved[h] = b
            return len(hashes)

        def lookup(self, hashes):
            n = 0
            while n < len(hashes) and hashes[n] in self.saved:
                n += 1
            return n

        def pin(self, hashes):
            return None

        def close(self):
            pass

    cfg = ConnectorConfig.parse("kv_both", dict(max_pending_save_blocks=4))
    w = WorkerSide(None, cfg, None)
    from tpu_sync.vllm.worker import _Saver

    w.tier = SlowTier()
    w._saver = _Saver(w.tier, cfg.max_pending_save_blocks)
    h = [bytes([i]) * 32 for i in range(6)]
    w.wait_for_save(TpuSyncMetadata(saves=[TierOp("a", h[:3], [5, 6, 7])]))
    assert w._saver.pending("a") == 1  # returned before the save ran
    # Back-pressure: 3 queued + 3 more > 4: dropped, never blocking.
    w.wait_for_save(TpuSyncMetadata(saves=[TierOp("b", h[3:6], [8, 9, 10])]))
    assert w.stats["saves_dropped"] == 3
    # Both finished: "b" (its saves dropped, nothing pending) is reported at once, "a" not
    # while its save runs.
    assert w.get_transfer_results({"a", "b"}).finished_sending == {"b"}
    assert w.get_transfer_results(set()).finished_sending == set()
    t = threading.Timer(0.2, gate.set)
    t.start()
    # A lookup of a block being saved waits for the save, then sees it.
    assert w._lookup("x", h[:3]) == 3 and w.stats["save_waits"] == 1
    assert w.get_transfer_results(set()).finished_sending == {"a"}
    assert w.stats["saved_blocks"] == 3
    assert w.get_transfer_results(set()).finished_sending == set()  # reported once
    # Preempted: handle_preemptions waits for the request's saves.
    gate.clear()
    w.wait_for_save(TpuSyncMetadata(saves=[TierOp("c", h[3:5], [1, 2])]))
    threading.Timer(0.2, gate.set).start()
    w.handle_preemptions(TpuSyncMetadata(preempted=["c"]))
    assert w._saver.pending("c") == 0 and w.stats["save_waits"] == 2
    assert w.flush_saves(5) and w.stats["saved_blocks"] == 5
    w.shutdown()


def test_pullers_follow_the_plan():
    from tpu_sync.vllm.compat import placement, pullers_of_rank

    g1 = KvGeometry("m", 2, 2, 2, 32, "f32", 32, 1, "vllm-cpu/vec/float32")
    g2 = KvGeometry("m", 2, 2, 1, 32, "f32", 32, 2, "vllm-cpu/vec/float32")
    src1 = placement(g1.tpu_sync_layout(16), [3, 4, 5])
    assert [pullers_of_rank(src1, 0, 70, tp) for tp in (1, 2, 4)] == [1, 2, 4]  # 4 > heads: replicas
    src2 = placement(g2.tpu_sync_layout(16), [3, 4, 5])
    assert [pullers_of_rank(src2, r, 70, 1) for r in (0, 1)] == [1, 1]
    assert [pullers_of_rank(src2, r, 70, 2) for r in (0, 1)] == [1, 1]


def test_worker_metadata_aggregates_to_the_minimum():
    a = TpuSyncWorkerMetadata(lookup_hits={"x": 5, "y": 2}, saved_blocks=3)
    b = TpuSyncWorkerMetadata(lookup_hits={"x": 3}, failed_loads={"y"}, saved_blocks=3)
    m = a.aggregate(b)
    assert m.lookup_hits == {"x": 3, "y": 2} and m.failed_loads == {"y"} and m.saved_blocks == 3
    # A failed load's delivered prefix: the minimum over the ranks whose load failed.
    c = TpuSyncWorkerMetadata(failed_loads={"y"}, load_delivered={"y": 1})
    assert m.aggregate(c).load_delivered == {"y": 1} and a.aggregate(c).load_delivered == {"y": 1}
    assert TpuSyncWorkerMetadata().is_empty()


# ---- worker: pull completion, failure, timeout -----------------------------------------------


class FakeTransport:
    address = "127.0.0.1:1"

    def __init__(self, outcome):
        self.outcome = outcome
        self.registered = []
        self.rejected = []
        self.refused = []
        self.waits = []

    def refuse(self, xfer_id, reason):
        self.refused.append((xfer_id, reason))

    def active(self, xfer_id):
        return False

    def reject(self, xfer_id, peers, reason):
        self.rejected.append((xfer_id, dict(peers), reason))

    def register(self, xfer_id, placement, num_tokens, lease_s, pullers=1):
        if self.outcome == "register-fails":
            raise RuntimeError("staging failed")
        self.registered.append((xfer_id, placement["block_ids"], num_tokens, pullers))

    def pull(self, xfer_id, peers, src, dst, num_tokens, wait_for_registration=None):
        self.pulls = getattr(self, "pulls", 0) + 1
        self.waits.append(wait_for_registration)
        h = SimpleNamespace(done=self.outcome != "hang", error=None, cancelled=False)
        if self.outcome == "error":
            h.error = ConnectionError("peer closed")
        if self.outcome == "unknown-then-ok" and self.pulls == 1:
            from tpu_sync.errors import UnknownRequestError

            h.error = UnknownRequestError(15, "request 7 is not registered")
        h.cancel = lambda: setattr(h, "cancelled", True)
        self.handle = h
        return h


def worker(configs, outcome, role="kv_consumer"):
    from tpu_sync.vllm.backends import KvCaches
    from tpu_sync.vllm.worker import WorkerSide

    w = WorkerSide(configs[role], ConnectorConfig.parse(role, {}), connector(configs[role]).geometry)
    w.caches = KvCaches(names=["l0", "l1"], tensors=[], num_blocks=NUM_BLOCKS,
                        layer_block_bytes=w.geometry.layer_block_bytes, tp_rank=0)
    w.transport = FakeTransport(outcome)
    w._pull_waits = True
    return w


def rejected(w, n, limit=5.0):
    """The transport's rejects, once the background thread sent `n` of them."""
    deadline = time.monotonic() + limit
    while len(w.transport.rejected) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return w.transport.rejected


def recv(timeout=30.0):
    layout = KvGeometry("m", 2, 2, 2, 32, "f32", 32, 1, "vllm-cpu/vec/float32").tpu_sync_layout(NUM_BLOCKS)
    return RecvSpec("d1", 7, {0: "h:1"}, layout, [3, 4], [8, 9], 40, timeout)


@pytest.mark.parametrize("outcome", ["ok", "error", "hang", "unknown-then-ok"])
def test_worker_reports_pulls(configs, outcome):
    w = worker(configs, outcome)
    w.start_load_kv(TpuSyncMetadata(recvs=[recv(timeout=0.2)]))
    res = w.get_transfer_results(set())
    if outcome == "unknown-then-ok":  # the producer had not registered yet: retried, not failed
        assert res.finished_recving == set() and w.transport.pulls == 1
        time.sleep(0.06)
        res = w.get_transfer_results(set())
        assert w.transport.pulls == 2
    if outcome == "hang":
        assert res.finished_recving == set()
        time.sleep(0.25)
        res = w.get_transfer_results(set())
        assert w.transport.handle.cancelled
    assert res.finished_recving == {"d1"}
    # The pull waits for a producer that has not registered the request yet.
    assert w.transport.waits[0] is not None and 0 < w.transport.waits[0] <= 0.2
    if outcome in ("ok", "unknown-then-ok"):
        assert res.failed_recving == set() and w.get_block_ids_with_load_errors() == set()
        assert w.transport.rejected == []
    else:  # failed: reported in both sets, blocks reported, so vLLM recomputes or fails it
        assert res.failed_recving == {"d1"} and w.get_block_ids_with_load_errors() == {8, 9}
        # It will not be pulled again: the producer is told to free it.
        ((xfer, peers, why),) = rejected(w, 1)
        assert (xfer, peers) == (7, {0: "h:1"}) and "failed" in why
    assert w.get_transfer_results(set()).finished_recving == set()
    w.shutdown()


@pytest.mark.parametrize("case", ["ok", "tokens", "never", "cancel"])
def test_worker_deferred_pull_asks_for_the_placement_first(configs, case):
    """A both-at-once pull (``src_block_ids`` None): the worker asks the producer for its
    placement until it registered, then pulls with exactly that placement; a token count
    other than the request's, or no registration before the deadline, fails the pull (load
    errors, a reject); a request aborted while asking never starts its pull. Empty steps wait
    (``idle_wait_ms``) instead of returning at once."""
    from tpu_sync.errors import UnknownRequestError

    w = worker(configs, "ok")
    asked = []
    placed = {"layout": "the producer's", "block_ids": [[11, 12]]}

    def describe(xfer_id, address):
        asked.append((xfer_id, address))
        if case in ("never", "cancel") or len(asked) < 3:
            raise UnknownRequestError(15, f"request {xfer_id} is not registered")
        return placed, 41 if case == "tokens" else 40

    w.transport.describe = describe
    # The deadline ends the cases that never settle; the ones that settle get one no stall of a
    # loaded machine reaches (with 0.5 s, a run beside two other suites on 2 cores once made
    # its first describe attempt only at the deadline: "did not register within 0.5 s").
    spec = recv(timeout=0.5 if case in ("never", "cancel") else 30.0)
    spec.src_block_ids = None
    w.start_load_kv(TpuSyncMetadata(recvs=[spec], idle=True))
    t0 = time.monotonic()
    res = w.get_transfer_results(set())
    if case in ("never", "cancel"):  # nothing settles: the empty step waited its 10 ms, not spun
        assert w.stats["idle_waits"] == 1 and time.monotonic() - t0 >= 0.0099
    # ("ok" and "tokens" may settle before the step looks: then it does not wait.)
    assert w.stats["pulls_deferred"] == 1
    if case == "cancel":
        res = w.get_transfer_results({"d1"})
        assert res.finished_recving == {"d1"} and res.failed_recving == set()
        time.sleep(0.1)
        assert getattr(w.transport, "pulls", 0) == 0 and len(asked) >= 1
        ((xfer, _, why),) = rejected(w, 1)
        assert xfer == 7 and "aborted" in why
        w.shutdown()
        return
    deadline = time.monotonic() + spec.timeout_s + 5
    while not res.finished_recving and time.monotonic() < deadline:
        time.sleep(0.01)
        res = w.get_transfer_results(set())
    assert res.finished_recving == {"d1"}
    assert set(asked) == {(7, "h:1")}
    if case == "ok":
        assert len(asked) == 3 and w.transport.pulls == 1 and res.failed_recving == set()
        assert w.transport.waits[0] is not None and w.stats["pulls_done"] == 1
    else:
        assert getattr(w.transport, "pulls", 0) == 0 and res.failed_recving == {"d1"}
        assert w.get_block_ids_with_load_errors() == {8, 9}
        ((xfer, _, why),) = rejected(w, 1)
        assert xfer == 7 and "failed" in why
        if case == "never":
            assert time.monotonic() - t0 < 1.5  # the pull's deadline, not longer
    w.shutdown()


@pytest.mark.parametrize("fails", [False, "error", "ended"])
def test_layers_are_staged_off_the_models_thread(configs, fails):
    """A layer-wise producer: ``save_kv_layer`` queues the layer's D2H and returns while it
    runs; the request's blocks are reported free (``finished_sending``) only once every queued
    publish ran. A failed publish withdraws the registration and skips the rest; a
    registration that already ended (its consumers released it) is no failure."""
    import threading

    from tpu_sync.vllm.metadata import SendSpec

    w = worker(configs, "ok", role="kv_producer")
    w._layer_index = {"l0": 0, "l1": 1}
    gate = threading.Event()
    published, withdrawn = [], []

    def publish_layers(xfer, layers):
        gate.wait(10)
        if fails == "error":
            raise RuntimeError("D2H failed")
        if fails == "ended":
            from tpu_sync.errors import UnknownRequestError

            raise UnknownRequestError(15, "request 5 is not registered here (released)")
        published.append((xfer, layers))
        return layers

    w.transport.register_layers = lambda *a, **k: None
    w.transport.publish_layers = publish_layers
    w.transport.withdraw = withdrawn.append
    w.start_load_kv(TpuSyncMetadata(layer_sends=[SendSpec("p1", 5, [3, 4], 40, 60.0)]))
    w.save_kv_layer("l0")  # returns although the copy has not run
    w.save_kv_layer("l1")
    w.wait_for_save(TpuSyncMetadata())
    assert published == [] and w.stats["layerwise_registered"] == 1
    w.start_load_kv(TpuSyncMetadata(handoffs=["p1"]))
    assert w.get_transfer_results(set()).finished_sending == set()  # still staging: blocks kept
    gate.set()
    assert w._stager.wait_xfer(5, 10)
    assert w.get_transfer_results(set()).finished_sending == {"p1"}
    if fails == "error":  # refused: its pullers fail at once, with the reason
        assert published == [] and withdrawn == [] and w.stats["publish_failed"] == 1
        ((xfer, why),) = w.transport.refused
        assert xfer == 5 and "request p1" in why and "D2H failed" in why, why
    elif fails == "ended":
        assert published == [] and withdrawn == [] and w.stats["publish_failed"] == 0
    else:
        assert published == [(5, 1), (5, 2)] and withdrawn == []  # wait_for_save's layer 2 queued once
    if fails != "error":
        assert w.transport.refused == []
    w.shutdown()


def test_worker_cancels_pull_of_aborted_request(configs):
    w = worker(configs, "hang")
    w.start_load_kv(TpuSyncMetadata(recvs=[recv()]))
    assert w.get_transfer_results(set()).finished_recving == set()
    res = w.get_transfer_results({"d1"})  # vLLM says the request finished (aborted)
    assert res.finished_recving == {"d1"} and res.failed_recving == set()
    assert w.transport.handle.cancelled and w.get_block_ids_with_load_errors() == set()
    assert w.stats["pulls_cancelled"] == 1
    ((xfer, _, why),) = rejected(w, 1)
    assert xfer == 7 and "aborted" in why
    w.shutdown()


def test_worker_sends_the_schedulers_rejects(configs):
    from tpu_sync.vllm.metadata import RejectSpec

    w = worker(configs, "ok")
    w.start_load_kv(TpuSyncMetadata(rejects=[RejectSpec("r1", 12, {0: "h:1", 1: "h:2"}, "aborted before its pull")]))
    assert rejected(w, 1) == [(12, {0: "h:1", 1: "h:2"}, "aborted before its pull")]
    assert w.stats["rejects_sent"] == 1
    w.shutdown()


def test_amx_tile_permission_is_requested_for_amx_blocks_only():
    from tpu_sync.vllm.compat import request_amx_tiles, uses_amx

    assert uses_amx("vllm-cpu/amx/bfloat16") and not uses_amx("vllm-cpu/vec/float32")
    granted = request_amx_tiles()
    assert isinstance(granted, bool)
    has_amx = "amx_tile" in open("/proc/cpuinfo").read()
    assert granted == has_amx  # a no-op (False) without AMX; asking twice is harmless
    assert request_amx_tiles() == granted


@pytest.mark.parametrize("outcome", ["ok", "register-fails"])
def test_worker_registers_and_releases(configs, outcome):
    from tpu_sync.vllm.metadata import SendSpec

    w = worker(configs, outcome, role="kv_producer")
    w.start_load_kv(TpuSyncMetadata(sends=[SendSpec("p1", 11, [5, 6], 40, 60.0, decode_tp=2)]))
    assert w.get_transfer_results({"p1"}).finished_sending == {"p1"}
    if outcome == "ok":  # a TP=2 decode instance pulls each block's two heads with two ranks
        assert w.transport.registered == [(11, [[5, 6]], 40, 2)]
    assert w.stats["registered" if outcome == "ok" else "register_failed"] == 1
    if outcome == "ok":
        assert w.transport.refused == [] and w.stats["refused"] == 0
    else:  # the consumer's pull fails at once with the reason instead of waiting out its timeout
        ((xfer, why),) = w.transport.refused
        assert xfer == 11 and "request p1" in why and "staging failed" in why, why
        assert w.stats["refused"] == 1


def test_register_runner_refuses_what_it_cannot_move(configs):
    """tpu-inference hands its caches only through ``register_runner``; a runner without caches,
    or a JAX runner with a setting not supported for it, fails the engine's start with the
    reason (tests/vllm/test_jax_runner.py moves real JAX caches)."""
    c = connector(configs["kv_both"], KVConnectorRole.WORKER)
    try:
        with pytest.raises(ValueError, match="no kv_caches"):
            c.register_runner(object())
    finally:
        c.shutdown()
    c = connector(vllm_config(configs["kv_both"].model_config.model, "kv_both", {"layerwise": True}),
                  KVConnectorRole.WORKER)
    try:
        class Runner:
            kv_caches = [object()]

        with pytest.raises(NotImplementedError, match="layer-wise transfers with a JAX model runner"):
            c.register_runner(Runner())
    finally:
        c.shutdown()


def test_tpu_inference_loads_the_connector_under_a_name_its_platform_accepts():
    """tpu-inference 0.32's platform accepts only these ``kv_connector`` names
    (``tpu_inference/platforms/tpu_platform.py``, restated); vLLM's factory takes the module path
    first, so ``TPUConnector`` from ``tpu_sync.vllm.tpu_inference`` is tpu_sync's connector."""
    allowed = ("TPUConnector", "TPUConnectorHMA", "TPUOffloadConnector", "RaidenOffloadConnector")
    ktc = KVTransferConfig(kv_connector="TPUConnector", kv_role="kv_both",
                           kv_connector_module_path="tpu_sync.vllm.tpu_inference")
    assert ktc.kv_connector in allowed
    cls = KVConnectorFactory.get_connector_class(ktc)
    from tpu_sync.vllm.connector import TpuSyncConnector

    assert issubclass(cls, TpuSyncConnector) and cls.__module__ == "tpu_sync.vllm.tpu_inference"
