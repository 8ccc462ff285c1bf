"""vLLM-TorchTPU's sparse MLA caches (DeepSeek-V3.2 style) through the connector's worker side
(issue 25; docs/tpu.md): each sparse layer registers a ``[nope, rope]`` pair of fp8 caches and
each DSA indexer a K cache, of exactly the shapes and dtypes vllm-torchtpu 0.29.0 allocates
(``kernels/mla/kv_cache_utils.py`` ``SparseMLAKVCacheSpec.shape``, ``sparsecore`` uint32 and
``tensorcore`` uint8; ``VllmTPUDeepseekV32IndexerBackend``, ``HEAD_ALONG_SUBLANE``), filled as
its writers fill them (``_scatter_rows`` / ``pack_tokens`` and the indexer's 129-byte records,
restated here in numpy). P/D between TP sizes over loopback TCP and host-tier store then load:
byte-exact, every other block and slot unchanged, each cache's padding never moved. The tensors
are torch CPU tensors (no TPU here); each case runs with them viewed in place and through torch's
own copies (what torch_tpu tensors get)."""

import time
import types

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from test_connector import configs, connector, vllm_config  # noqa: E402,F401  (fixtures)
from test_tpu_engine_layouts import (BACKENDS, as_bytes, backend, pd_workers, register,  # noqa: E402,F401
                                     worker)
from tpu_sync.vllm import compat  # noqa: E402
from tpu_sync.vllm.compat import KvGeometry  # noqa: E402
from tpu_sync.vllm.metadata import TierOp, TpuSyncMetadata  # noqa: E402

NB, BS = 16, 16
#: what vLLM registers, as DeepSeek-V3.2's layers name them (vLLM's deepseek_v2.py: the
#: latent cache ``<prefix>.attn``, the indexer's ``<prefix>.indexer.k_cache``)
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache",
          "model.layers.1.self_attn.attn", "model.layers.1.self_attn.indexer.k_cache"]
INDEXERS = [n for n in LAYERS if n.endswith("k_cache")]
#: real bytes a token: the nope latent (512 fp8), the rope key (64 bf16), the indexer's record
#: (128 fp8 key bytes and one e8m0 scale byte; in a 256-byte row, or 132 along the lanes)
REAL = {"nope": 512, "rope": 128, "indexer": 129}


def geometry(tp, nope="sparsecore", rope="sparsecore", indexer="head_along_sublane"):
    parts = compat.sparse_mla_parts(LAYERS, INDEXERS, nope, rope, indexer)
    return KvGeometry(model="deepseek-v32-tpu-test", num_layers=sum(len(p["layers"]) for p in parts), num_kv_heads=1,
                      heads_per_rank=1, head_dim=576, dtype="fp8", block_size=BS, tp=tp,
                      block_format="vllm-tpu/rpamla-sparse/fp8", use_mla=True, kv_order=compat.MLA_ORDER,
                      mla_parts=parts)


def values(layer, part, tokens, seed):
    """``[tokens, real bytes]`` non-zero bytes of one cache of one layer; distinct per seed."""
    rng = np.random.default_rng(seed * 1000 + layer * 10 + len(part))
    return rng.integers(1, 256, size=(tokens, REAL[part]), dtype=np.uint8)


def token_row(lanes, layout, real, garbage_padding=False):
    """The ``lanes`` bytes of one token's row as the engine's writer leaves them in memory:
    ``as_token_bytes`` zero-pads the token to its row; ``sparsecore`` then interleaves four
    byte bands into each little-endian 32-bit word (``pack_tokens``: word ``i`` holds bytes
    ``i``, ``q + i``, ``2q + i``, ``3q + i`` of the row, ``q = lanes / 4``). The indexer's record
    is its row's first 129 bytes (``convert_cache_to_seq_along_lane`` reads ``[:128]`` and
    ``[128]``; in ``seq_along_lane`` the record padded to 132 bytes). ``garbage_padding``: the
    padding bytes non-zero (never moved in a token-major cache, so a destination's stay what
    they were)."""
    row = np.zeros(lanes, dtype=np.uint8)
    if garbage_padding:
        row[:] = 0xA5
    row[:len(real)] = real
    if layout == "sparsecore":
        row = row.reshape(4, lanes // 4).T.reshape(-1)
    return row


def tensors(g, tokens, block_ids, seed, fill_seed, garbage_padding=False):
    """One TP rank's caches (every rank holds the same), as vLLM-TorchTPU registers them: per
    sparse layer ``[nope, rope]``, per indexer its K cache; every token slot of every block
    written with filler of ``fill_seed``, then the request's ``tokens`` tokens of ``seed`` at
    ``block_ids``."""
    caches = {}
    for layer, spec in enumerate(g.part_of_layer()):
        part, layout, lanes = spec["name"], spec["layout"], int(spec["lanes"])
        rows = np.zeros((NB * BS, lanes), dtype=np.uint8)
        fill = values(layer, part, NB * BS, fill_seed)
        for s in range(NB * BS):
            rows[s] = token_row(lanes, layout, fill[s])
        req = values(layer, part, tokens, seed)
        for s in range(tokens):
            rows[block_ids[s // BS] * BS + s % BS] = token_row(lanes, layout, req[s], garbage_padding)
        if layout == "seq_along_lane":
            # Byte j of token t of a block at row j, lane t: (N, 33, 4, BS).
            rows = rows.reshape(NB, BS, lanes).transpose(0, 2, 1).copy()
            shape, dtype = (NB, lanes // 4, 4, BS), torch.uint8
        elif part == "indexer":
            shape, dtype = (NB, BS // 4, 4, lanes), torch.uint8
        elif layout == "sparsecore":
            shape = (NB, BS, lanes // 4) if part == "nope" else (NB, BS // 4, lanes)
            dtype = torch.uint32
        else:
            shape = (NB, BS, lanes // 128, 128) if part == "nope" else (NB, BS // 4, 4, lanes)
            dtype = torch.uint8
        t = torch.empty(shape, dtype=dtype)
        t.view(torch.uint8).view(-1).copy_(torch.from_numpy(rows.reshape(-1)))
        caches[layer] = t
    out, layer = {}, 0
    for n in compat.layer_order(LAYERS):
        if n in INDEXERS:
            out[n] = caches[layer]
            layer += 1
        else:
            out[n] = [caches[layer], caches[layer + 1]]
            layer += 2
    return out


def flat(kv):
    """Every cache tensor of ``kv``, in cache layer order, with its name."""
    out = []
    for n in compat.layer_order(list(kv)):
        v = kv[n]
        out += [(n + "#nope", v[0]), (n + "#rope", v[1])] if isinstance(v, list) else [(n, v)]
    return out


def test_geometry_and_layout_of_the_sparse_mla_caches():
    g = geometry(2)
    # Cache layers in vLLM layer order: layer 0's nope, rope, indexer, then layer 1's.
    assert [p["name"] for p in g.part_of_layer()] == ["nope", "rope", "indexer"] * 2
    assert g.layer_bytes() == [BS * 512, BS * 128, BS * 256] * 2 and g.block_bytes == BS * 896 * 2
    with pytest.raises(ValueError, match="layer_bytes"):
        g.layer_block_bytes
    lay = g.tpu_sync_layout(NB)
    assert lay["spec"]["order"] == compat.MLA_ORDER and len(lay["groups"]) == 3
    assert [(x["name"], x["layers"], x["kind"]["head_dim"]) for x in lay["model"]["groups"]] == [
        ("nope", [0, 3], 512), ("rope", [1, 4], 128), ("indexer", [2, 5], 129)]
    # One block table: one list of ids stands for every group.
    p = compat.placement(lay, [5, 9, 2])
    assert p["block_ids"] == [[[5, 9, 2]] * 2] * 3
    # Each rank of a TP=2 producer is read by the decode ranks that map to it.
    assert [compat.pullers_of_rank(p, r, 40, 4) for r in range(2)] == [2, 2]
    # A peer whose nope cache is in the other layout holds the same bytes in another order.
    other = geometry(2, nope="tensorcore")
    assert "mla_parts" in g.mismatch(other.to_dict()) and g.mismatch(geometry(4).to_dict()) is None
    assert g.namespace() != other.namespace() != geometry(2, rope="tensorcore").namespace()
    # The indexer's SEQ_ALONG_LANE cache (tokens along the lanes) moves as opaque whole blocks.
    sal = geometry(2, indexer="seq_along_lane")
    assert sal.layer_bytes() == [BS * 512, BS * 128, BS * 132] * 2
    lay = sal.tpu_sync_layout(NB)
    assert lay["model"]["groups"][2]["kind"] == dict(type="attention", num_kv_heads=1, head_dim=132, kv_planes=1,
                                                     dtype="fp8")
    assert lay["groups"][2] == dict(num_blocks=NB, order="lbhnc", block_format=compat.SAL_INDEXER_FORMAT)
    assert "mla_parts" in sal.mismatch(g.to_dict())
    with pytest.raises(ValueError, match="not one of sparsecore, tensorcore"):
        compat.sparse_mla_parts(LAYERS, INDEXERS, nope_layout="tiled")


def test_sparse_mla_parts_from_the_kv_cache_config(monkeypatch):
    """From vLLM 0.29's one KV cache group of several page sizes (``UniformTypeKVCacheSpecs``,
    the indexer caches' specs ``uint8``), with the layouts from the engine's environment."""
    # The indexer's spec: its own head size (key and scale bytes) in uint8; the latent's 576 (its
    # dtype does not tell them apart: vLLM's own table stores fp8 as uint8 too).
    specs = {n: types.SimpleNamespace(head_size=129 if n in INDEXERS else 576, dtype=torch.uint8) for n in LAYERS}
    grp = types.SimpleNamespace(layer_names=list(reversed(LAYERS)),
                                kv_cache_spec=types.SimpleNamespace(kv_cache_specs=specs))
    cfg = types.SimpleNamespace(kv_cache_groups=[grp])
    for k in ("TPU_SPARSE_MLA_NOPE_LAYOUT", "TPU_SPARSE_MLA_ROPE_LAYOUT", "VLLM_TPU_INDEXER_KV_CACHE_MODE"):
        monkeypatch.delenv(k, raising=False)
    assert compat.tpu_sparse_mla_parts(cfg, 16) == geometry(1).mla_parts
    # Without per-layer specs, vLLM's name for the indexer's cache tells them apart.
    bare = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(
        layer_names=list(LAYERS), kv_cache_spec=types.SimpleNamespace())])
    assert compat.tpu_sparse_mla_parts(bare, 16) == geometry(1).mla_parts
    monkeypatch.setenv("TPU_SPARSE_MLA_ROPE_LAYOUT", "tensorcore")
    assert compat.tpu_sparse_mla_parts(cfg, 16) == geometry(1, rope="tensorcore").mla_parts
    # vLLM-TorchTPU's default indexer mode with a block size of 128 is SEQ_ALONG_LANE.
    assert compat.tpu_indexer_layout(128) == "seq_along_lane" and compat.tpu_indexer_layout(64) == "head_along_sublane"
    assert [p["layout"] for p in compat.tpu_sparse_mla_parts(cfg, 128)] == ["sparsecore", "tensorcore",
                                                                             "seq_along_lane"]
    monkeypatch.setenv("TPU_USE_RAIDEN_KV_CACHE_MANAGER", "1")
    monkeypatch.setenv("TPU_RAIDEN_GLM_ADMISSION", "1")
    assert compat.tpu_indexer_layout(128) == "head_along_sublane"
    monkeypatch.delenv("TPU_RAIDEN_GLM_ADMISSION")
    monkeypatch.setenv("VLLM_TPU_INDEXER_KV_CACHE_MODE", "has")
    assert compat.tpu_indexer_layout(128) == "head_along_sublane"
    with pytest.raises(ValueError, match="2 KV cache groups"):
        compat.tpu_sparse_mla_parts(types.SimpleNamespace(kv_cache_groups=[grp, grp]), 16)


@pytest.mark.parametrize("nope,rope,indexer,src_tp,dst_tp", [
    # the engine's default layouts (a block size < 128), TP=2 prefill -> TP=4 decode
    ("sparsecore", "sparsecore", "head_along_sublane", 2, 4),
    ("tensorcore", "sparsecore", "head_along_sublane", 4, 1),   # another nope layout, TP=4 -> TP=1
    ("sparsecore", "tensorcore", "seq_along_lane", 1, 2),       # the indexer's SEQ_ALONG_LANE cache
])
def test_worker_pd_of_sparse_mla_caches_byte_exact(configs, monkeypatch, backend, nope, rope, indexer, src_tp,
                                                   dst_tp):
    """Every decode rank gets the request's tokens in every cache (a partial last block
    included) and nothing else: its other blocks, the partial block's unused slots and every
    row's padding unchanged (the producer's padding is garbage here, so moving it would show);
    the producer unchanged; bytes moved = real bytes of the request's tokens. The indexer's
    ``SEQ_ALONG_LANE`` cache moves in whole blocks: the request's blocks become the producer's
    (their unused slots and padding rows too), 132 bytes a token slot."""
    tokens = 40
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = geometry(src_tp, nope, rope, indexer), geometry(dst_tp, nope, rope, indexer)
    src = [tensors(gs, tokens, src_ids, seed=3, fill_seed=11, garbage_padding=True) for _ in range(src_tp)]
    before = tensors(gd, 0, dst_ids, seed=3, fill_seed=12)
    dst = [tensors(gd, 0, dst_ids, seed=3, fill_seed=12) for _ in range(dst_tp)]
    # The reference: the destination's filler with the request's tokens written with zero padding
    # (whole blocks of the producer's SEQ_ALONG_LANE indexer caches).
    ref = tensors(gd, tokens, dst_ids, seed=3, fill_seed=12)
    whole = indexer == "seq_along_lane"
    if whole:
        for n in INDEXERS:
            for a, b in zip(src_ids, dst_ids):
                ref[n][b] = src[0][n][a]
    src_before = [{n: [x.clone() for x in t] if isinstance(t, list) else t.clone() for n, t in r.items()} for r in src]
    with pd_workers(configs, monkeypatch, gs, gd, src, dst, BACKENDS[backend], 97, src_ids, dst_ids, tokens) as (
            prods, conss):
        for r in range(dst_tp):
            for (n, got), (_, exp), (_, old) in zip(flat(dst[r]), flat(ref), flat(before)):
                assert np.array_equal(as_bytes(got), as_bytes(exp)), (r, n, np.argwhere(as_bytes(got) !=
                                                                                         as_bytes(exp))[:4])
                assert not np.array_equal(as_bytes(got), as_bytes(old)), (r, n)  # the test can fail
        for r in range(src_tp):
            for (n, got), (_, exp) in zip(flat(src[r]), flat(src_before[r])):
                assert np.array_equal(as_bytes(got), as_bytes(exp)), (r, n)
        for w in conss:
            assert w.xfer_stats is not None  # vLLM 0.32's connector stats
            moved = w.xfer_stats.data["bytes_transferred"]
            per_token = REAL["nope"] + REAL["rope"] + (0 if whole else REAL["indexer"])
            blocks = len(dst_ids) * BS * compat.SAL_INDEXER_LANES if whole else 0
            assert moved == [(tokens * per_token + blocks) * 2], moved
            assert w.adapter_stats["backend"] == ("pjrt-view" if backend == "view" else "framework-copy")


@pytest.mark.parametrize("indexer", ["head_along_sublane", "seq_along_lane"])
def test_worker_host_tier_store_then_load_sparse_mla_blocks(configs, monkeypatch, backend, indexer):
    """Blocks 3..5 of every cache saved to the host tier and loaded into 12..14: those become
    copies of 3..5 (which differed before), every other block unchanged."""
    g = geometry(2, "tensorcore", "sparsecore", indexer)
    kv = tensors(g, 3 * BS, [3, 4, 5], seed=21, fill_seed=22)
    w = worker(configs, "kv_both", g, dict(BACKENDS[backend], host_capacity_bytes=64 << 20))
    try:
        register(monkeypatch, w, kv, 1)
        orig = [(n, t.clone()) for n, t in flat(kv)]
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("o1", hashes, [3, 4, 5])]))
        assert w.flush_saves(30)
        assert w.stats["saved_blocks"] == 3
        w.start_load_kv(TpuSyncMetadata(loads=[TierOp("o1", hashes, [12, 13, 14])]))
        assert w.stats["loaded_blocks"] == 3 and w.stats["failed_loads"] == 0, w.stats
        for (n, t), (_, o) in zip(flat(kv), orig):
            want = o.clone()
            want[12:15] = o[3:6]
            assert not torch.equal(want.view(torch.uint8), o.view(torch.uint8))
            assert np.array_equal(as_bytes(t), as_bytes(want)), n
    finally:
        w.shutdown()


def test_worker_refuses_sparse_mla_caches_that_differ_from_the_geometry(configs, monkeypatch):
    """Refused at registration, by name: a cache in the other layout than the geometry's, a
    pair that is not ``[nope, rope]``, a missing indexer, a block size 4 does not divide."""
    g = geometry(1)
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 16 << 20})
    try:
        kv = tensors(geometry(1, rope="tensorcore"), 0, [], seed=1, fill_seed=2)
        with pytest.raises(ValueError, match=r"rope cache .*\[16, 4, 4, 128\] torch.uint8.*sparsecore layout"):
            register(monkeypatch, w, kv, 0)
        kv = tensors(g, 0, [], seed=1, fill_seed=2)
        bad = dict(kv, **{LAYERS[0]: kv[LAYERS[0]][:1]})
        with pytest.raises(ValueError, match="registered 1 caches; expected"):
            register(monkeypatch, w, bad, 0)
        with pytest.raises(ValueError, match="from the KV cache config"):
            register(monkeypatch, w, {n: v for n, v in kv.items() if n != INDEXERS[1]}, 0)
        assert w.caches is None
    finally:
        w.shutdown()
    odd = KvGeometry(**dict(geometry(1).to_dict(), block_size=18))
    w = worker(configs, "kv_both", odd, {"host_capacity_bytes": 16 << 20})
    try:
        with pytest.raises(ValueError, match="block size 18 .* multiple of 4"):
            register(monkeypatch, w, tensors(g, 0, [], seed=1, fill_seed=2), 0)
    finally:
        w.shutdown()


def test_geometry_of_a_sparse_mla_model_on_a_tpu(monkeypatch):
    """On a TPU platform a model whose config has ``index_topk`` (DeepSeek-V3.2) gets the sparse
    MLA geometry from its KV cache config, with ``--kv-cache-dtype fp8`` (its kernel's only
    dtype); another cache dtype, or no KV cache config, is refused by name."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "device_type", "tpu", raising=False)
    for k in ("TPU_SPARSE_MLA_NOPE_LAYOUT", "TPU_SPARSE_MLA_ROPE_LAYOUT", "VLLM_TPU_INDEXER_KV_CACHE_MODE"):
        monkeypatch.delenv(k, raising=False)

    def cfg(cache_dtype):
        mc = types.SimpleNamespace(
            model="deepseek-v32-test", dtype=torch.bfloat16, use_mla=True,
            hf_text_config=types.SimpleNamespace(kv_lora_rank=512, index_topk=2048),
            get_num_kv_heads=lambda pc: 1, get_head_size=lambda: 576, get_num_layers=lambda pc: 2,
            get_total_num_kv_heads=lambda: 128)
        return types.SimpleNamespace(model_config=mc, parallel_config=types.SimpleNamespace(tensor_parallel_size=2),
                                     cache_config=types.SimpleNamespace(cache_dtype=cache_dtype, block_size=BS),
                                     attention_config=types.SimpleNamespace(backend=None))

    specs = {n: types.SimpleNamespace(head_size=129 if n in INDEXERS else 576, dtype=torch.uint8) for n in LAYERS}
    kvc = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(
        layer_names=list(LAYERS), kv_cache_spec=types.SimpleNamespace(kv_cache_specs=specs))])
    g = compat.kv_geometry(cfg("fp8"), kvc)
    assert g.mla_parts == geometry(2).mla_parts and g.mismatch(geometry(2).to_dict()) is None, g
    assert g.block_format == "vllm-tpu/rpamla-sparse/fp8" and g.num_layers == 6 and g.groups is None
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8"):
        compat.kv_geometry(cfg("auto"), kvc)
    # vLLM's own table would make "fp8" uint8 (CUDA's caches); the TPU backends' is float8_e4m3fn.
    assert compat.kv_geometry(cfg("fp8_e4m3"), kvc) == g
    with pytest.raises(ValueError, match=r"'fp8_e5m2' \(torch.float8_e5m2\) is not supported"):
        compat.kv_geometry(cfg("fp8_e5m2"), kvc)
    with pytest.raises(ValueError, match="KV cache config is needed"):
        compat.kv_geometry(cfg("fp8"), None)


def test_consumer_of_sparse_mla_caches_with_a_local_prefix_hit_pulls_the_rest(configs):
    """A consumer with a local prefix-cache hit of 2 blocks pulls only the producer's tokens
    after it, into its blocks from block 2 on (one list of block ids standing for every group,
    with the hit as the placement's ``first_token``); without a hit it pulls the whole
    request."""
    import dataclasses

    from test_connector import NUM_BLOCKS, blocks, producer_params, request, sched_out

    _, toks, _, params = producer_params(configs)
    c = connector(configs["kv_consumer"])
    g = dataclasses.replace(geometry(1), block_size=c.geometry.block_size)
    c.scheduler_side.geometry, c.scheduler_side.layout = g, g.tpu_sync_layout(NUM_BLOCKS)
    params = dict(params, remote_geometry=g.to_dict())
    hit = 2 * g.block_size
    r = request("d1", toks, dict(params))
    assert c.get_num_new_matched_tokens(r, hit) == (100 - hit, True)
    c.update_state_after_alloc(r, blocks([50, 51, 52, 53]), 100 - hit)
    [spec] = c.build_connector_meta(sched_out({})).recvs
    assert (spec.first_token, spec.dst_block_ids) == (hit, [52, 53]), spec
    p = compat.placement(g.tpu_sync_layout(NUM_BLOCKS), spec.dst_block_ids, spec.first_token)
    assert p["first_token"] == hit and p["block_ids"] == [[[52, 53]]] * 3, p
    assert c.scheduler_side.stats["p2p_partial"] == 1
    r2 = request("d2", toks, dict(params, remote_request_id=params["remote_request_id"] + 1))
    assert c.get_num_new_matched_tokens(r2, 0) == (100, True)
    c.update_state_after_alloc(r2, blocks([50, 51, 52, 53]), 100)
    [spec] = c.build_connector_meta(sched_out({})).recvs
    assert spec.first_token == 0 and spec.src_layout["spec"]["order"] == compat.MLA_ORDER
    p = compat.placement(spec.src_layout, spec.src_block_ids)
    assert p["block_ids"] == [[list(spec.src_block_ids)]] * 3 and "first_token" not in p


@pytest.mark.parametrize("indexer", ["head_along_sublane", "seq_along_lane"])
def test_worker_pd_of_sparse_mla_caches_after_a_local_prefix_hit(configs, monkeypatch, backend, indexer):
    """A decode instance (TP=4) that already holds the request's first block (a local prefix
    hit of 16 tokens) pulls only tokens 16..40 from the TP=2 producer, into its blocks from the
    second on, in every cache: the hit's block is never written (it holds other bytes than the
    producer's here, so a write would show), nor are the other blocks or the padding; bytes
    moved = real bytes of the 24 tokens after the hit (the ``SEQ_ALONG_LANE`` indexer: its 2
    whole blocks after the hit)."""
    tokens, first = 40, BS
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = geometry(2, indexer=indexer), geometry(4, indexer=indexer)
    src = [tensors(gs, tokens, src_ids, seed=3, fill_seed=11, garbage_padding=True) for _ in range(2)]
    # The consumer's hit: tokens 0..16 at its first block, of another seed than the producer's.
    before = tensors(gd, first, dst_ids, seed=4, fill_seed=12)
    dst = [tensors(gd, first, dst_ids, seed=4, fill_seed=12) for _ in range(4)]
    ref = tensors(gd, tokens, dst_ids, seed=3, fill_seed=12)
    whole = indexer == "seq_along_lane"
    for (n, r), (_, b) in zip(flat(ref), flat(before)):
        r[dst_ids[0]] = b[dst_ids[0]]  # the hit's block as it was
        if whole and n in INDEXERS:
            for a, d in zip(src_ids[1:], dst_ids[1:]):
                r[d] = src[0][n][a]
    src_before = [{n: [x.clone() for x in t] if isinstance(t, list) else t.clone() for n, t in r.items()} for r in src]
    with pd_workers(configs, monkeypatch, gs, gd, src, dst, BACKENDS[backend], 98, src_ids, dst_ids[1:], tokens,
                    first_token=first) as (prods, conss):
        for r in range(4):
            for (n, got), (_, exp), (_, old) in zip(flat(dst[r]), flat(ref), flat(before)):
                assert np.array_equal(as_bytes(got), as_bytes(exp)), (r, n, np.argwhere(as_bytes(got) !=
                                                                                         as_bytes(exp))[:4])
                assert not np.array_equal(as_bytes(got), as_bytes(old)), (r, n)  # the test can fail
        for r in range(2):
            for (n, got), (_, exp) in zip(flat(src[r]), flat(src_before[r])):
                assert np.array_equal(as_bytes(got), as_bytes(exp)), (r, n)
        for w in conss:
            moved = w.xfer_stats.data["bytes_transferred"]
            per_token = REAL["nope"] + REAL["rope"] + (0 if whole else REAL["indexer"])
            blocks = 2 * BS * compat.SAL_INDEXER_LANES if whole else 0
            assert moved == [((tokens - first) * per_token + blocks) * 2], moved


def test_both_at_once_pd_of_sparse_mla_caches(configs, monkeypatch, backend):
    """A router's both-at-once request (the consumer pulls before the producer has described
    it, ``src_block_ids`` None): the consumer's pull waits for the producer's registration,
    made as an engine step with early registration makes it (``bind`` before the forward,
    ``save_kv_layer`` of vLLM's layer names, ``wait_for_save``); TP=2 -> 4, byte-exact. Decode
    rank 3 starts only after ranks 0-2 finished, when producer rank 0's registration is gone
    (released by its pullers, decode ranks 0 and 2): it must ask producer rank 1, which it
    reads from (asking rank 0, as before, waited until its deadline)."""
    from tpu_sync.vllm.metadata import RecvSpec, SendSpec

    from test_tpu_engine_layouts import wait_recv

    tokens, src_tp, dst_tp = 40, 2, 4
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = geometry(src_tp), geometry(dst_tp)
    src = [tensors(gs, tokens, src_ids, seed=5, fill_seed=13, garbage_padding=True) for _ in range(src_tp)]
    dst = [tensors(gd, 0, dst_ids, seed=5, fill_seed=14) for _ in range(dst_tp)]
    ref = tensors(gd, tokens, dst_ids, seed=5, fill_seed=14)
    prods = [worker(configs, "kv_producer", gs, BACKENDS[backend]) for _ in range(src_tp)]
    conss = [worker(configs, "kv_consumer", gd, BACKENDS[backend]) for _ in range(dst_tp)]
    try:
        for r, w in enumerate(prods):
            register(monkeypatch, w, src[r], r)
        for r, w in enumerate(conss):
            register(monkeypatch, w, dst[r], r)
        peers = {r: w.transport.address for r, w in enumerate(prods)}
        recv = RecvSpec("d1", 99, peers, gs.tpu_sync_layout(NB), None, dst_ids, tokens, 30.0)
        for w in conss[:3]:
            w.start_load_kv(TpuSyncMetadata(recvs=[recv]))
            assert w.get_transfer_results(set()).finished_recving == set()  # waits for the producer
        for w in prods:
            meta = TpuSyncMetadata(layer_sends=[SendSpec("p1", 99, src_ids, tokens, 60.0, dst_tp)])
            w.bind(meta)
            w.start_load_kv(meta)
            for n in LAYERS:
                w.save_kv_layer(n)
            w.wait_for_save(meta)
        results = [wait_recv(w) for w in conss[:3]]
        deadline = time.monotonic() + 30
        while prods[0].transport.endpoint.stats()["leases"] and time.monotonic() < deadline:
            time.sleep(0.02)  # producer rank 0 released by decode ranks 0 and 2
        assert not prods[0].transport.endpoint.stats()["leases"]
        conss[3].start_load_kv(TpuSyncMetadata(recvs=[recv]))
        results.append(wait_recv(conss[3]))
        for r, (w, res) in enumerate(zip(conss, results)):
            assert res.finished_recving == {"d1"} and not res.failed_recving, (r, w.stats)
            assert w.stats["pulls_deferred"] == 1
            for (n, got), (_, exp) in zip(flat(dst[r]), flat(ref)):
                assert np.array_equal(as_bytes(got), as_bytes(exp)), (r, n)
    finally:
        for w in conss + prods:
            w.shutdown()
