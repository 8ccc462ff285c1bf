"""The TPU engines' KV cache layouts (docs/tpu.md) through the Python API, against a reference
built with numpy exactly as the engines' kernels build them.

The reference is ``merge_kv`` of the ragged paged attention v3 kernels (vllm-torchtpu-core
0.29.0 and tpu-inference 0.32.0, ``kernels/ragged_paged_attention/v3/kernel.py`` and
``kernel_hd64.py``), written with the same numpy operations: concatenate K and V per head on
the last axis, reshape to ``2H`` rows (v3) or keep ``H`` rows of 128 lanes (head_dim 64), pad
rows to a multiple of ``P = 32 / bits`` and lanes to a multiple of 128 with zeros, reshape to
``[R, P, D']``; a layer's cache is ``[num_blocks, block_size, R, P, D']`` (the shape of
``PallasAttentionBackend.get_kv_cache_shape``). A plan between two such layouts, applied byte by
byte, must give exactly the destination's reference: every real element in place, padding and
every other block still zero.
"""

import numpy as np
import pytest

import tpu_sync
from tpu_sync.errors import LayoutError, MismatchError

# Element type -> (tpu_sync dtype, numpy integer type of the same width: bit patterns).
DTYPES = {"f32": np.uint32, "bf16": np.uint16, "fp8": np.uint8}


def align(x, a):
    return -(-x // a) * a


def logical_kv(layer, tokens, heads, dim, np_t, seed):
    """K and V of every token and head, ``[tokens, heads, dim]`` each: pseudo-random bit
    patterns, never zero (so a missing element cannot pass as padding)."""
    rng = np.random.default_rng(seed * 1000 + layer)
    top = np.iinfo(np_t).max
    k = rng.integers(1, top, size=(tokens, heads, dim), dtype=np_t, endpoint=True)
    v = rng.integers(1, top, size=(tokens, heads, dim), dtype=np_t, endpoint=True)
    return k, v


def merge_kv(k, v, packing, hd64):
    """One layer's new tokens as the kernels' ``merge_kv`` lays them out: ``[T, R, P, D']``."""
    t, h, d = k.shape
    if hd64:
        kv = np.concatenate([k, v], axis=-1)  # [T, H, 128]: K lanes 0..64, V lanes 64..128
        kv = np.pad(kv, ((0, 0), (0, align(h, packing) - h), (0, 0)))
        return kv.reshape(t, align(h, packing) // packing, packing, 2 * d)
    kv = np.concatenate([k, v], axis=-1).reshape(t, 2 * h, d)  # row j = 2 * head + (0 K, 1 V)
    kv = np.pad(kv, ((0, 0), (0, align(2 * h, packing) - 2 * h), (0, align(d, 128) - d)))
    return kv.reshape(t, align(2 * h, packing) // packing, packing, align(d, 128))


def rank_caches(layers, tokens, heads, dim, dtype, tp, block_size, num_blocks, block_ids, hd64, seed):
    """Every TP rank's per-layer caches holding the request at ``block_ids[rank]``."""
    np_t = DTYPES[dtype]
    packing = 4 // np.dtype(np_t).itemsize
    # Fewer heads than TP: each head on TP / heads consecutive ranks (tpu-inference's
    # repeat_interleave of the KV projection; tpu_sync's replicated TP split).
    local, rep = max(1, heads // tp), max(1, tp // heads)
    out = []
    for r in range(tp):
        per_layer = []
        for layer in range(layers):
            k, v = logical_kv(layer, tokens, heads, dim, np_t, seed)
            sl = slice(r // rep * local, (r // rep + 1) * local)
            merged = merge_kv(k[:, sl], v[:, sl], packing, hd64)
            cache = np.zeros((num_blocks, block_size) + merged.shape[1:], dtype=np_t)
            for t in range(tokens):
                cache[block_ids[r][t // block_size], t % block_size] = merged[t]
            per_layer.append(cache)
        out.append(per_layer)
    return out


def apply(plan, src, dst):
    """Copies every span's bytes from ``src[rank][layer]`` into ``dst[rank][layer]``."""
    sb = [[np.frombuffer(c, dtype=np.uint8) for c in r] for r in src]
    db = [[c.reshape(-1).view(np.uint8) for c in r] for r in dst]
    for s in plan.spans():
        for i in range(s.count):
            a, b = s.src_offset + i * s.src_stride, s.dst_offset + i * s.dst_stride
            db[s.dst_rank][s.dst_buffer][b:b + s.len] = sb[s.src_rank][s.src_buffer][a:a + s.len]


CASES = [
    # (heads, head_dim, dtype, hd64, src tp, src block, dst tp, dst block, tokens)
    (8, 128, "bf16", False, 4, 16, 2, 32, 70),   # tpu-inference TP=4 -> TP=2
    (8, 128, "bf16", False, 2, 32, 4, 16, 70),   # TP=2 -> TP=4
    (6, 128, "fp8", False, 2, 16, 1, 16, 45),    # fp8, 3 local heads: 6 of 8 slots used
    (6, 128, "fp8", False, 1, 8, 2, 16, 45),     # and back
    (4, 80, "f32", False, 1, 16, 4, 8, 33),      # head_dim 80: lanes 80..128 padding
    (8, 64, "bf16", True, 2, 16, 8, 16, 50),     # head_dim-64 kernel, one padded slot per token
    (8, 64, "fp8", True, 8, 16, 2, 32, 50),      # fp8 hd64: 1 head of 4 slots -> 4 of 4
]


@pytest.mark.parametrize("heads,dim,dtype,hd64,s_tp,s_bs,d_tp,d_bs,tokens", CASES)
def test_rpa3_reshard_matches_the_kernels_merge_kv(heads, dim, dtype, hd64, s_tp, s_bs, d_tp, d_bs, tokens):
    layers, order = 2, "rpa3hd64" if hd64 else "rpa3"
    m = tpu_sync.model("tpu-test", num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype)
    s_nb, d_nb = 2 * -(-tokens // s_bs) + 3, 2 * -(-tokens // d_bs) + 3
    # Scattered block ids, different per rank and side.
    s_ids = [[(7 * i + 3 + r) % s_nb for i in range(-(-tokens // s_bs))] for r in range(s_tp)]
    d_ids = [[(d_nb - 1 - 2 * i - r) % d_nb for i in range(-(-tokens // d_bs))] for r in range(d_tp)]
    for ids in s_ids + d_ids:
        assert len(set(ids)) == len(ids)
    src_l = tpu_sync.layout(m, tp=s_tp, block_size=s_bs, order=order, num_blocks=s_nb)
    dst_l = tpu_sync.layout(m, tp=d_tp, block_size=d_bs, order=order, num_blocks=d_nb)
    src = rank_caches(layers, tokens, heads, dim, dtype, s_tp, s_bs, s_nb, s_ids, hd64, seed=5)
    want = rank_caches(layers, tokens, heads, dim, dtype, d_tp, d_bs, d_nb, d_ids, hd64, seed=5)
    got = [[np.zeros_like(c) for c in r] for r in want]
    with tpu_sync.Plan(tpu_sync.placement(src_l, s_ids), tpu_sync.placement(dst_l, d_ids), tokens) as p:
        apply(p, src, got)
        # Exactly the real bytes: tokens x heads x K and V x head_dim x layers.
        assert p.total_bytes == tokens * heads * 2 * dim * np.dtype(DTYPES[dtype]).itemsize * layers
    for r in range(d_tp):
        for layer in range(layers):
            assert got[r][layer].shape == want[r][layer].shape
            assert np.array_equal(got[r][layer], want[r][layer]), f"rank {r} layer {layer}"


def test_rpa3_layout_errors_name_the_cause():
    mla = tpu_sync.preset("deepseek-v3")
    with pytest.raises(LayoutError, match="MLA"):
        l = tpu_sync.layout(mla, order="rpa3", num_blocks=4)
        tpu_sync.Plan(tpu_sync.placement(l, [[0]]), tpu_sync.placement(l, [[1]]), 8)
    llama = tpu_sync.preset("llama-3.1-8b")
    with pytest.raises(LayoutError, match="head_dim"):
        l = tpu_sync.layout(llama, order="rpa3hd64", num_blocks=4)
        tpu_sync.Plan(tpu_sync.placement(l, [[0]]), tpu_sync.placement(l, [[1]]), 8)
    # A tiled TPU physical layout against an unknown one is refused, naming it.
    l = tpu_sync.layout(llama, order="rpa3", num_blocks=4)
    tiled = dict(l, physical_layout="{4,3,2,1,0:T(2,128)(2,1)}")
    with pytest.raises(MismatchError, match=r"T\(2,128\).*unknown"):
        tpu_sync.Plan(tpu_sync.placement(tiled, [[0]]), tpu_sync.placement(l, [[1]]), 8)
    # The same tiling on both sides (it keeps each packed row contiguous): whole-row plans are
    # built (TP 2 -> 1, head_dim 128), plans that cut rows are refused naming the layout.
    fp8 = "{4,3,2,1,0:T(4,128)(4,1)}"
    m = dict(llama, dtype="fp8")
    src = dict(tpu_sync.layout(m, tp=2, order="rpa3", num_blocks=4), physical_layout=fp8)
    dst = dict(tpu_sync.layout(m, order="rpa3", num_blocks=4), physical_layout=fp8)
    plan = tpu_sync.Plan(tpu_sync.placement(src, [[0], [1]]), tpu_sync.placement(dst, [[2]]), 8)
    assert plan.total_bytes == 8 * 32 * 8 * 2 * 128  # tokens x layers x heads x K,V x 128 fp8 lanes
    plan.close()
    m80 = dict(m, head_dim=80)
    src = dict(tpu_sync.layout(m80, tp=2, order="rpa3", num_blocks=4), physical_layout=fp8)
    dst = dict(tpu_sync.layout(m80, order="rpa3", num_blocks=4), physical_layout=fp8)
    with pytest.raises(MismatchError, match=r"T\(4,128\)\(4,1\).*cuts"):
        tpu_sync.Plan(tpu_sync.placement(src, [[0], [1]]), tpu_sync.placement(dst, [[2]]), 8)


# vLLM-TorchTPU's batched ragged paged attention kernel in its SEQ_ALONG_LANE layout
# (``--attention-backend CUSTOM``, ``VLLM_KV_CACHE_LAYOUT=HND``): per layer
# ``[num_blocks, 2H, D'/P, P, block_size]`` with ``D' = align(head_dim, 8 * P)`` (8 sublanes;
# ``get_kv_cache_shape`` in ``kernels/experimental/batched_rpa/wrapper.py``, vllm-torchtpu-core
# 0.29.0). The connector moves it as tpu_sync's opaque LBHNC regions of a model whose head_dim is
# ``D'`` (``tpu_sync.vllm.compat.KvGeometry.tpu_sync_layout``): the bytes of one (block, head)
# are K's ``D' x block_size`` then V's, one contiguous run.


def merge_kv_sal(k, v, packing):
    """New tokens as the batched kernel's ``merge_kv`` lays them out under SEQ_ALONG_LANE, with
    its numpy operations: K and V concatenated per head and reshaped to ``2H`` rows (K before V),
    head_dim padded to ``8 * P`` with zeros, packed ``[2H, D'/P, P]`` and the tokens moved to
    the last axis (``transpose(1, 2, 3, 0)``): ``[2H, D'/P, P, T]``."""
    t, h, d = k.shape
    dp = align(d, 8 * packing)
    kv = np.concatenate([k, v], axis=-1).reshape(t, 2 * h, d)
    kv = np.pad(kv, ((0, 0), (0, 0), (0, dp - d)))
    return kv.reshape(t, 2 * h, dp // packing, packing).transpose(1, 2, 3, 0)


def sal_cache(k, v, packing, block_size):
    """A layer's whole SEQ_ALONG_LANE cache from the K/V of every token slot (``[num_blocks *
    block_size, H, D]``, slot ``b * block_size + t`` = token ``t`` of block ``b``):
    ``[num_blocks, 2H, D'/P, P, block_size]``."""
    m = merge_kv_sal(k, v, packing)
    j, r, p, n = m.shape
    return np.ascontiguousarray(m.reshape(j, r, p, n // block_size, block_size).transpose(3, 0, 1, 2, 4))


SAL_CASES = [
    # (heads, head_dim, dtype, src tp, dst tp, tokens)
    (8, 128, "bf16", 2, 1, 300),   # vLLM-TorchTPU TP=2 prefill -> TP=1 decode
    (8, 128, "bf16", 1, 4, 300),   # and to TP=4
    (4, 80, "fp8", 4, 2, 129),     # fp8: head_dim 80 padded to 96 (8 sublanes x 4)
    (2, 128, "f32", 1, 2, 128),    # one head per rank, whole blocks only
]


@pytest.mark.parametrize("heads,dim,dtype,s_tp,d_tp,tokens", SAL_CASES)
def test_seq_along_lane_reshard_moves_whole_head_regions(heads, dim, dtype, s_tp, d_tp, tokens):
    layers, bs = 2, 128
    np_t = DTYPES[dtype]
    packing = 4 // np.dtype(np_t).itemsize
    dp = align(dim, 8 * packing)
    nblk = -(-tokens // bs)
    s_nb, d_nb = 2 * nblk + 3, 2 * nblk + 4
    s_ids = [2 * i + 1 for i in range(nblk)]
    d_ids = [d_nb - 1 - 2 * i for i in range(nblk)]
    fmt = f"vllm-tpu/rpa-sal/{dtype}"
    m = tpu_sync.model("tpu-test", num_layers=layers, num_kv_heads=heads, head_dim=dp, dtype=dtype)
    src_l = dict(tpu_sync.layout(m, tp=s_tp, block_size=bs, order="lbhnc", num_blocks=s_nb), block_format=fmt)
    dst_l = dict(tpu_sync.layout(m, tp=d_tp, block_size=bs, order="lbhnc", num_blocks=d_nb), block_format=fmt)
    src, got, want = [], [], []
    for layer in range(layers):
        # Every slot of both sides holds non-zero K/V (the source's other tokens, the
        # destination's other blocks); the destination's request blocks end up holding the
        # source's blocks whole (an opaque region moves with all its token slots).
        sk, sv = logical_kv(layer, s_nb * bs, heads, dim, np_t, seed=7)
        dk, dv = logical_kv(layer, d_nb * bs, heads, dim, np_t, seed=8)
        wk, wv = dk.copy(), dv.copy()
        for a, b in zip(s_ids, d_ids):
            wk[b * bs:(b + 1) * bs] = sk[a * bs:(a + 1) * bs]
            wv[b * bs:(b + 1) * bs] = sv[a * bs:(a + 1) * bs]
        sl = lambda r, tp: slice(r * heads // tp, (r + 1) * heads // tp)  # noqa: E731
        src.append([sal_cache(sk[:, sl(r, s_tp)], sv[:, sl(r, s_tp)], packing, bs) for r in range(s_tp)])
        got.append([sal_cache(dk[:, sl(r, d_tp)], dv[:, sl(r, d_tp)], packing, bs) for r in range(d_tp)])
        want.append([sal_cache(wk[:, sl(r, d_tp)], wv[:, sl(r, d_tp)], packing, bs) for r in range(d_tp)])
    assert src[0][0].shape == (s_nb, 2 * heads // s_tp, dp // packing, packing, bs)
    by_rank = lambda c, tp: [[c[layer][r] for layer in range(layers)] for r in range(tp)]  # noqa: E731
    got_r = by_rank(got, d_tp)
    with tpu_sync.Plan(tpu_sync.placement(src_l, [s_ids] * s_tp), tpu_sync.placement(dst_l, [d_ids] * d_tp),
                       tokens) as p:
        apply(p, by_rank(src, s_tp), got_r)
        # Whole (block, head) regions: blocks x heads x K and V x D' x block_size x layers.
        assert p.total_bytes == nblk * heads * 2 * dp * bs * np.dtype(np_t).itemsize * layers
    for r in range(d_tp):
        for layer in range(layers):
            assert np.array_equal(got_r[r][layer], want[layer][r]), f"rank {r} layer {layer}"
