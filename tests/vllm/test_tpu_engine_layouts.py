"""The connector's worker side with the TPU backends' KV caches (issue 25; docs/tpu.md): per-layer
tensors of exactly the shapes vLLM-TorchTPU's ``PallasAttentionBackend.get_kv_cache_shape``
allocates (ragged paged attention v3 ``[num_blocks, block_size, R, P, D']`` and the head_dim-64
kernel's ``[num_blocks, block_size, ceil(H / P), P, 128]``), as torch CPU tensors viewed
zero-copy as PJRT CPU buffers, filled as the kernels' ``merge_kv`` fills them (the numpy
reference of ``bindings/python/tests/test_tpu_layouts.py``). P/D between worker sides over
loopback TCP, resharded between TP sizes (bf16, fp8 with an odd number of local heads,
head_dim 64), and host-tier store then load: byte-exact, padding zero, every other block
unchanged. The engine around the buffers is vLLM's CPU build: the tensors' shapes, dtypes and
contents are the TPU engines'; only their memory is host memory (no TPU here). Each case runs with
the tensors viewed in place and through torch's own copies (``torch_backend`` ``framework-copy``,
what accelerator tensors get), with ``Tensor.copy_`` and with the batch_transfer call shape of
torch_tpu."""

import contextlib
import dataclasses
import os
import sys
import time

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from test_connector import configs, connector, vllm_config  # noqa: E402,F401  (fixtures)
from tpu_sync import errors  # noqa: E402
from tpu_sync.vllm import compat  # noqa: E402
from tpu_sync.vllm.compat import KvGeometry  # noqa: E402
from tpu_sync.vllm.config import ConnectorConfig  # noqa: E402
from tpu_sync.vllm.metadata import RecvSpec, SendSpec, TierOp, TpuSyncMetadata  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bindings", "python", "tests"))
from test_tpu_layouts import DTYPES, logical_kv, merge_kv, sal_cache  # noqa: E402

NB, BS = 16, 16
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
TORCH = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "f32": torch.float32}
TORCH_BITS = {"bf16": torch.int16, "fp8": torch.uint8, "f32": torch.int32}


def pallas_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, bits):
    """vllm-torchtpu 0.29.0 ``PallasAttentionBackend.get_kv_cache_shape`` for a concrete dtype
    (``vllm_torchtpu/layers/adapter/attention.py``), restated: pad head_size to 128, pack
    ``32 / bits`` values per word, ``num_kv_heads * 2`` rows (``num_kv_heads`` for head_size 64)
    rounded up to the packing."""
    padded = -(-head_size // 128) * 128
    packing = 32 // bits
    rows = num_kv_heads if head_size == 64 else num_kv_heads * 2
    rows = -(-rows // packing) * packing
    return (num_blocks, block_size, rows // packing, packing, padded)


def geometry(heads, dim, dtype, tp):
    order = "rpa3hd64" if dim == 64 else "rpa3"
    return KvGeometry(model="tpu-test", num_layers=len(NAMES), num_kv_heads=heads, heads_per_rank=max(1, heads // tp),
                      head_dim=dim, dtype=dtype, block_size=BS, tp=tp,
                      block_format=f"vllm-tpu/{order}/{dtype}", kv_order=order)


def rank_tensors(g, rank, tokens, block_ids, seed, fill_seed):
    """One TP rank's per-layer caches: every block filled as ``merge_kv`` fills it with the
    logical K/V of seed ``fill_seed`` (so blocks the request does not use hold other KV, never
    zero), then the request's ``tokens`` tokens of seed ``seed`` written at ``block_ids``."""
    np_t = DTYPES[g.dtype]
    hd64 = g.kv_order == "rpa3hd64"
    local = g.heads_per_rank
    out = {}
    for layer, name in enumerate(NAMES):
        cache = np.zeros((NB,) + g.layer_shape(), dtype=np_t)
        k, v = logical_kv(layer, NB * BS, g.num_kv_heads, g.head_dim, np_t, fill_seed)
        sl = slice(rank * local, (rank + 1) * local)
        cache.reshape((NB * BS,) + g.layer_shape()[1:])[:] = merge_kv(k[:, sl], v[:, sl], g.packing, hd64)
        k, v = logical_kv(layer, tokens, g.num_kv_heads, g.head_dim, np_t, seed)
        merged = merge_kv(k[:, sl], v[:, sl], g.packing, hd64)
        for t in range(tokens):
            cache[block_ids[t // BS], t % BS] = merged[t]
        bits = torch.from_numpy(cache.view(np.dtype(str(TORCH_BITS[g.dtype]).replace("torch.", ""))))
        # Allocated by torch as the engine allocates its caches (64-byte aligned, which a
        # zero-copy PJRT view needs), then filled.
        t = torch.empty(bits.shape, dtype=TORCH_BITS[g.dtype])
        t.copy_(bits)
        out[name] = t.view(TORCH[g.dtype])
    return out


def as_bytes(t):
    return t.contiguous().view(torch.uint8).numpy()


def block_major(tensors):
    """The same caches as vLLM-TorchTPU lays them out with ``VLLM_TPU_BLOCK_MAJOR_KV=1``
    (``vllm_torchtpu/runner/kv_cache_manager.py`` 0.29.0): one bundle ``[num_blocks, layers,
    BS, R, P, D']`` and, per layer, the strided view ``bundle[:, layer]`` that the engine binds and
    registers. Returns (bundle, views by name)."""
    first = tensors[NAMES[0]]
    bundle = torch.empty((first.shape[0], len(NAMES)) + tuple(first.shape[1:]), dtype=first.dtype)
    views = {}
    for i, n in enumerate(NAMES):
        bundle[:, i].copy_(tensors[n])
        views[n] = bundle[:, i]
    return bundle, views


def worker(configs, role, g, extra=None):
    from tpu_sync.vllm.worker import WorkerSide

    return WorkerSide(configs[role], ConnectorConfig.parse(role, extra or {}), g)


def wait_recv(w, timeout=30):
    """Polls a consumer worker until a pull finished or failed (or ``timeout`` s passed)."""
    deadline, res = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        res = w.get_transfer_results(set())
        if res.finished_recving or res.failed_recving:
            break
        time.sleep(0.02)
    return res


def register(monkeypatch, w, tensors, rank):
    """``register_kv_caches`` as vLLM's TP worker ``rank`` calls it."""
    import vllm.distributed.parallel_state as ps

    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: rank)
    w.register_kv_caches(tensors)


@contextlib.contextmanager
def pd_workers(configs, monkeypatch, gs, gd, src, dst, extra, xfer, src_ids, dst_ids, tokens, early=False,
               first_token=0):
    """Worker sides of a P/D pair, one per TP rank: producers registered with ``src`` (one
    tensor dict per rank), consumers with ``dst``; request ``xfer`` registered by every producer
    (``early``: as an engine step does with ``early_register``, ``bind`` before the forward,
    ``save_kv_layer`` per layer, ``wait_for_save``) and pulled by every consumer (from token
    ``first_token`` on, into ``dst_ids`` the blocks from there on: a local prefix hit). Yields
    ``(producers, consumers)`` once every pull finished; shuts them down after."""
    prods = [worker(configs, "kv_producer", gs, extra) for _ in src]
    conss = [worker(configs, "kv_consumer", gd, extra) for _ in dst]
    try:
        for r, w in enumerate(prods):
            register(monkeypatch, w, src[r], r)
        for r, w in enumerate(conss):
            register(monkeypatch, w, dst[r], r)
        for w in prods:
            send = SendSpec("p1", xfer, src_ids, tokens, 60.0, len(dst))
            if early:
                meta = TpuSyncMetadata(layer_sends=[send])
                w.bind(meta)
                w.start_load_kv(meta)
                for n in NAMES:
                    w.save_kv_layer(n)
                w.wait_for_save(meta)
            else:
                w.start_load_kv(TpuSyncMetadata(sends=[send]))
            # Registered, or skipped where no consumer rank reads this rank's replica.
            assert w.stats["registered"] + w.stats["register_skipped"] == 1, w.stats
        peers = {r: w.transport.address for r, w in enumerate(prods)}
        layout = gs.tpu_sync_layout(NB)
        for w in conss:
            w.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d1", xfer, peers, layout, src_ids, dst_ids, tokens,
                                                            30.0, first_token=first_token)]))
        for r, w in enumerate(conss):
            res = wait_recv(w)
            assert res.finished_recving == {"d1"} and not res.failed_recving, (r, w.stats)
        yield prods, conss
    finally:
        for w in conss + prods:
            w.shutdown()


def assert_pd_bytes(dst, want, src, src_before):
    """Every consumer rank's tensors equal ``want`` byte for byte, the producers' ``src_before``."""
    for r in range(len(dst)):
        for n in NAMES:
            got, exp = as_bytes(dst[r][n]), as_bytes(want[r][n])
            assert np.array_equal(got, exp), (r, n, np.argwhere(got != exp)[:4])
    for r in range(len(src)):
        for n in NAMES:
            assert np.array_equal(as_bytes(src[r][n]), as_bytes(src_before[r][n])), (r, n)


def test_geometry_of_the_tpu_backends_matches_their_shape_formula(configs, monkeypatch):
    for heads, dim, dtype, tp in [(8, 128, "bf16", 2), (6, 128, "fp8", 2), (8, 64, "bf16", 1), (8, 64, "fp8", 8),
                                  (4, 80, "f32", 1), (2, 128, "bf16", 4)]:
        g = geometry(heads, dim, dtype, tp)
        bits = {"f32": 32, "bf16": 16, "fp8": 8}[dtype]
        assert (NB,) + g.layer_shape() == pallas_kv_cache_shape(NB, BS, g.heads_per_rank, dim, bits), g
        assert g.layer_block_bytes == int(np.prod(g.layer_shape())) * bits // 8
        lay = g.tpu_sync_layout(NB)
        assert lay["spec"]["order"] == g.kv_order and "block_format" not in lay
    # A peer of another layout is refused by name; a peer from before the field is vLLM's CPU one.
    g = geometry(8, 128, "bf16", 2)
    assert "kv_order" in g.mismatch(dict(g.to_dict(), kv_order="rpa3hd64"))
    old = g.to_dict()
    del old["kv_order"]
    assert "kv_order: local 'rpa3', remote 'lbhnc'" in g.mismatch(old)
    # On a TPU platform the geometry of the engine's config is the RPA v3 one.
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "device_type", "tpu", raising=False)
    tg = compat.kv_geometry(configs["kv_both"])
    want = "rpa3hd64" if tg.head_dim == 64 else "rpa3"
    assert tg.kv_order == want and tg.block_format == f"vllm-tpu/{want}/float32", tg


def test_worker_refuses_tensors_of_another_layout(configs, monkeypatch):
    g = geometry(8, 128, "bf16", 2)
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 16 << 20})
    try:
        lbhnc = {n: torch.zeros((NB, 4, BS, 256), dtype=torch.bfloat16) for n in NAMES}
        with pytest.raises(ValueError, match=r"ragged paged attention v3 .*\[num_blocks, 16, 4, 2, 128\]"):
            register(monkeypatch, w, lbhnc, 0)
        wrong_dtype = {n: torch.zeros((NB,) + g.layer_shape(), dtype=torch.float16) for n in NAMES}
        with pytest.raises(ValueError, match="float16"):
            register(monkeypatch, w, wrong_dtype, 0)
    finally:
        w.shutdown()


#: How the workers reach the tensors: in place (the CPU default), or through torch's own copies
#: as on a TPU (``torch_backend`` ``framework-copy``), with ``Tensor.copy_`` or with the
#: batch_transfer API of torch_tpu (here the stand-in of ``test_torch_kv.py``, which copies with
#: torch; torch_tpu itself is never imported here).
BACKENDS = {
    "view": {},
    "torch-copy": {"torch_backend": "framework-copy", "torch_copy_api": "torch"},
    "batch-transfer": {"torch_backend": "framework-copy", "torch_copy_api": "batch_transfer"},
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, monkeypatch):
    if request.param == "batch-transfer":
        from test_torch_kv import install_batch_transfer_stand_in

        install_batch_transfer_stand_in(monkeypatch)
    return request.param


@pytest.mark.parametrize("early", [False, True], ids=["sends", "early"])
@pytest.mark.parametrize("heads,dim,dtype,src_tp,dst_tp", [
    (8, 128, "bf16", 2, 1),   # vLLM-TorchTPU TP=2 prefill -> TP=1 decode
    (6, 128, "fp8", 1, 2),    # fp8, 3 local heads on the decode: a packed row cut between heads
    (4, 64, "bf16", 2, 4),    # the head_dim-64 kernel, one padded slot per token on TP=4
])
def test_worker_pd_reshards_rpa3_caches_byte_exact(configs, monkeypatch, backend, heads, dim, dtype, src_tp,
                                                   dst_tp, early):
    """``early``: the producer registers as an engine step does with ``early_register`` (the
    default): ``bind`` before the forward, ``save_kv_layer`` per layer, ``wait_for_save``."""
    tokens = 40  # 3 blocks, the last one partial
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = geometry(heads, dim, dtype, src_tp), geometry(heads, dim, dtype, dst_tp)
    src = [rank_tensors(gs, r, tokens, src_ids, seed=3, fill_seed=11) for r in range(src_tp)]
    dst = [rank_tensors(gd, r, 0, dst_ids, seed=3, fill_seed=12) for r in range(dst_tp)]
    want = [rank_tensors(gd, r, tokens, dst_ids, seed=3, fill_seed=12) for r in range(dst_tp)]
    src_before = [{n: t.clone() for n, t in r.items()} for r in src]
    extra = BACKENDS[backend]
    with pd_workers(configs, monkeypatch, gs, gd, src, dst, extra, 91, src_ids, dst_ids, tokens,
                    early) as (prods, conss):
        assert_pd_bytes(dst, want, src, src_before)
        # Where the copies went: the framework staged exactly the request's blocks.
        lbb = gs.layer_block_bytes * len(NAMES)
        for w in prods:
            st = w.adapter_stats
            if backend == "view":
                assert st["backend"] == "pjrt-view" and "d2h_bytes" not in st, st
            else:
                assert (st["backend"], st["copy_api"]) == ("framework-copy", extra["torch_copy_api"]), st
                assert (st["stages"], st["d2h_bytes"]) == (1, 3 * lbb), st
        for w in conss:
            st = w.adapter_stats
            if backend != "view":
                # The partial last block staged first (its other token slots come back unchanged).
                assert (st["commits"], st["h2d_bytes"], st["d2h_bytes"]) == (
                    1, 3 * gd.layer_block_bytes * len(NAMES), gd.layer_block_bytes * len(NAMES)), st


def test_worker_host_tier_store_then_load_rpa3_blocks(configs, monkeypatch, backend):
    g = geometry(8, 128, "bf16", 2)
    kv = rank_tensors(g, 1, 3 * BS, [3, 4, 5], seed=21, fill_seed=22)
    w = worker(configs, "kv_both", g, dict(BACKENDS[backend], host_capacity_bytes=64 << 20))
    try:
        register(monkeypatch, w, kv, 1)
        orig = {n: t.clone() for n, t in kv.items()}
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("o1", hashes, [3, 4, 5])]))
        assert w.flush_saves(30)  # asynchronous saves (synchronous through framework copies): wait for them
        assert w.stats["saved_blocks"] == 3
        # The scheduler delays freeing a request with saves (async_saves) until a worker reports
        # it in finished_sending: reported once it finished, whichever way its saves ran.
        assert w.get_transfer_results(set()).finished_sending == set()
        assert w.get_transfer_results({"o1"}).finished_sending == {"o1"}
        assert w.get_transfer_results(set()).finished_sending == set()
        w.start_load_kv(TpuSyncMetadata(lookups={"o1": hashes + [b"\x08" * 32]}))
        assert w.build_worker_meta().lookup_hits == {"o1": 3}
        w.start_load_kv(TpuSyncMetadata(loads=[TierOp("o1", hashes, [12, 13, 14])]))
        assert w.stats["loaded_blocks"] == 3 and w.stats["failed_loads"] == 0, w.stats
        for n in NAMES:
            want = orig[n].clone()
            want[12:15] = orig[n][3:6]
            assert np.array_equal(as_bytes(kv[n]), as_bytes(want)), n
    finally:
        w.shutdown()


@pytest.mark.parametrize("direction", ["bundle->layers", "layers->bundle"])
def test_worker_pd_between_a_block_major_bundle_and_per_layer_caches(configs, monkeypatch, direction):
    """vLLM-TorchTPU's block-major KV bundle (per-layer strided views of one tensor) on one side,
    per-layer caches on the other, TP=2 -> 1: the bundle's views are reached through torch's
    copies (chosen automatically: a PJRT buffer cannot view a strided tensor), byte-exact, every
    other block and every other layer's bytes in the bundle unchanged."""
    tokens = 40
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = geometry(8, 128, "bf16", 2), geometry(8, 128, "bf16", 1)
    src = [rank_tensors(gs, r, tokens, src_ids, seed=5, fill_seed=15) for r in range(2)]
    dst = [rank_tensors(gd, 0, 0, dst_ids, seed=5, fill_seed=16)]
    want = rank_tensors(gd, 0, tokens, dst_ids, seed=5, fill_seed=16)
    src_before = [{n: t.clone() for n, t in r.items()} for r in src]
    bundles = []
    if direction == "bundle->layers":
        for r in range(2):
            b, src[r] = block_major(src[r])
            bundles.append(b)
    else:
        b, dst[0] = block_major(dst[0])
        bundles.append(b)
    prods = [worker(configs, "kv_producer", gs) for _ in range(2)]
    cons = worker(configs, "kv_consumer", gd)
    try:
        for r, w in enumerate(prods):
            register(monkeypatch, w, src[r], r)
        register(monkeypatch, cons, dst[0], 0)
        strided = prods if direction == "bundle->layers" else [cons]
        for w in strided:
            st = w.adapter_stats
            assert st["backend"] == "framework-copy" and "strided" in st["backend_reason"], st
            assert st["bundle_wide"], st  # every layer of a block in one copy
        for w in prods:
            send = SendSpec("p1", 92, src_ids, tokens, 60.0, 1)
            meta = TpuSyncMetadata(layer_sends=[send])
            w.bind(meta)
            w.start_load_kv(meta)
            w.wait_for_save(meta)
        peers = {r: w.transport.address for r, w in enumerate(prods)}
        cons.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d1", 92, peers, gs.tpu_sync_layout(NB), src_ids, dst_ids,
                                                            tokens, 30.0)]))
        res = wait_recv(cons)
        assert res.finished_recving == {"d1"} and not res.failed_recving, cons.stats
        for n in NAMES:
            got, exp = as_bytes(dst[0][n]), as_bytes(want[n])
            assert np.array_equal(got, exp), (n, np.argwhere(got != exp)[:4])
            for r in range(2):
                assert np.array_equal(as_bytes(src[r][n]), as_bytes(src_before[r][n])), (r, n)
        # One device copy per run of blocks, every layer at once: the producer's stage of
        # blocks 5, 9, 2 (3 runs); the consumer's stage of its partial last block, then its
        # commit of 11, 3, 7 (1 + 3). Per layer it would be twice as many.
        if direction == "bundle->layers":
            assert [w.adapter_stats["device_copies"] for w in prods] == [3, 3]
        else:
            assert cons.adapter_stats["device_copies"] == 4, cons.adapter_stats
        # The whole bundle: exactly the expected layers side by side (nothing written elsewhere).
        if direction == "bundle->layers":
            for r, b in enumerate(bundles):
                exp = torch.stack([src_before[r][n] for n in NAMES], dim=1)
                assert np.array_equal(as_bytes(b), as_bytes(exp)), r
        else:
            exp = torch.stack([want[n] for n in NAMES], dim=1)
            assert np.array_equal(as_bytes(bundles[0]), as_bytes(exp))
    finally:
        cons.shutdown()
        for w in prods:
            w.shutdown()


def test_worker_refuses_what_framework_copy_does_not_map_yet(configs, monkeypatch):
    """Layer-wise transfers with tensors reached through torch's copies are refused at
    registration, by name (the layer hooks would read mirrors nobody staged)."""
    g = geometry(8, 128, "bf16", 2)
    w = worker(configs, "kv_both", g, {"torch_backend": "framework-copy", "layerwise": True,
                                       "host_capacity_bytes": 16 << 20})
    try:
        with pytest.raises(NotImplementedError, match="layer-wise transfers with KV tensors moved by torch"):
            register(monkeypatch, w, rank_tensors(g, 0, 0, [], seed=1, fill_seed=2), 0)
    finally:
        w.shutdown()


# ---- vLLM-TorchTPU's batched kernel in the SEQ_ALONG_LANE layout -------------------------------
# (``--attention-backend CUSTOM`` with ``VLLM_KV_CACHE_LAYOUT=HND``: per layer ``[num_blocks, 2H,
# D'/P, P, block_size]``, tokens along the lanes; kernel pages of 128 tokens.)

SAL_BS = 128


def batched_sal_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, bits):
    """vllm-torchtpu-core 0.29.0 ``get_kv_cache_shape`` of the batched ragged paged attention
    kernel with ``kv_layout == SEQ_ALONG_LANE`` and no per-token scales
    (``kernels/experimental/batched_rpa/wrapper.py``), restated: ``num_kv_heads * 2`` rows, the
    head dimension rounded up to ``num_sublanes * packing`` (8 sublanes) and packed ``32 / bits``
    to a word, the page's tokens last."""
    packing = 32 // bits
    return (num_blocks, num_kv_heads * 2, -(-head_size // (8 * packing)) * (8 * packing) // packing, packing,
            block_size)


def sal_geometry(heads, dim, dtype, tp):
    return KvGeometry(model="tpu-test", num_layers=len(NAMES), num_kv_heads=heads, heads_per_rank=max(1, heads // tp),
                      head_dim=dim, dtype=dtype, block_size=SAL_BS, tp=tp,
                      block_format=f"vllm-tpu/{compat.SAL_ORDER}/{dtype}", kv_order=compat.SAL_ORDER)


def sal_slots(g, tokens, block_ids, seed, fill_seed):
    """Per layer, the logical K/V (``[NB * block_size, heads, head_dim]`` each, every head of the
    model) of every token slot: non-zero filler of ``fill_seed`` everywhere, then the request's
    ``tokens`` tokens of ``seed`` at ``block_ids``."""
    np_t = DTYPES[g.dtype]
    out = []
    for layer in range(len(NAMES)):
        k, v = logical_kv(layer, NB * SAL_BS, g.num_kv_heads, g.head_dim, np_t, fill_seed)
        rk, rv = logical_kv(layer, tokens, g.num_kv_heads, g.head_dim, np_t, seed)
        for t in range(tokens):
            slot = block_ids[t // SAL_BS] * SAL_BS + t % SAL_BS
            k[slot], v[slot] = rk[t], rv[t]
        out.append((k, v))
    return out


def sal_tensors(g, rank, slots):
    """TP rank ``rank``'s per-layer SEQ_ALONG_LANE caches (torch CPU tensors) holding ``slots``."""
    local = g.heads_per_rank
    sl = slice(rank * local, (rank + 1) * local)
    out = {}
    for name, (k, v) in zip(NAMES, slots):
        cache = sal_cache(k[:, sl], v[:, sl], g.packing, SAL_BS)
        bits = torch.from_numpy(cache.view(np.dtype(str(TORCH_BITS[g.dtype]).replace("torch.", ""))))
        t = torch.empty(bits.shape, dtype=TORCH_BITS[g.dtype])
        t.copy_(bits)
        out[name] = t.view(TORCH[g.dtype])
    return out


def sal_pd_slots(gs, gd, tokens, src_ids, dst_ids):
    """The logical K/V slots of a SEQ_ALONG_LANE P/D case: the producer's (the request's tokens
    at ``src_ids``), the consumer's before (other KV), and after (the producer's blocks, whole,
    at ``dst_ids``: an opaque region moves with its unused token slots)."""
    s_slots = sal_slots(gs, tokens, src_ids, seed=3, fill_seed=11)
    d_slots = sal_slots(gd, 0, dst_ids, seed=3, fill_seed=12)
    w_slots = []
    for (sk, sv), (dk, dv) in zip(s_slots, d_slots):
        wk, wv = dk.copy(), dv.copy()
        for a, b in zip(src_ids, dst_ids):
            wk[b * SAL_BS:(b + 1) * SAL_BS] = sk[a * SAL_BS:(a + 1) * SAL_BS]
            wv[b * SAL_BS:(b + 1) * SAL_BS] = sv[a * SAL_BS:(a + 1) * SAL_BS]
        w_slots.append((wk, wv))
    return s_slots, d_slots, w_slots


def test_geometry_of_the_seq_along_lane_cache_matches_its_shape_formula(configs, monkeypatch):
    import copy
    import types

    for heads, dim, dtype, tp in [(8, 128, "bf16", 2), (4, 80, "fp8", 1), (2, 256, "f32", 2), (8, 96, "bf16", 8)]:
        g = sal_geometry(heads, dim, dtype, tp)
        bits = {"f32": 32, "bf16": 16, "fp8": 8}[dtype]
        assert (NB,) + g.layer_shape() == batched_sal_kv_cache_shape(NB, SAL_BS, g.heads_per_rank, dim, bits), g
        lay = g.tpu_sync_layout(NB)
        # Moved as opaque (block, head) regions of D' x block_size elements per plane.
        assert lay["spec"]["order"] == "lbhnc" and lay["block_format"] == g.block_format, lay
        assert lay["model"]["head_dim"] == g.sal_head_dim == g.layer_shape()[1] * g.packing
        assert g.layer_block_bytes == 2 * g.heads_per_rank * g.sal_head_dim * SAL_BS * bits // 8
    # Peers of the token-major RPA v3 cache are refused by name.
    g = sal_geometry(8, 128, "bf16", 2)
    assert "kv_order" in g.mismatch(dict(g.to_dict(), kv_order="rpa3"))
    # The engine's config picks the layout as vLLM-TorchTPU's platform does: the CUSTOM backend
    # with a head-major KV cache layout (HND), except for head_dim 64 (the hd64 kernel).
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "device_type", "tpu", raising=False)
    base = configs["kv_both"]
    custom = types.SimpleNamespace(name="CUSTOM")
    hd = compat.kv_geometry(base).head_dim
    sal = "rpa3hd64" if hd == 64 else compat.SAL_ORDER

    def order(backend, layout=None, env=None):
        cc = copy.copy(base.cache_config)
        cc.kv_cache_layout = layout  # vLLM's CacheConfig: resolved once by the engine core
        if env is None:
            monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
        else:
            monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", env)
        c = types.SimpleNamespace(model_config=base.model_config, parallel_config=base.parallel_config,
                                  cache_config=cc, attention_config=types.SimpleNamespace(backend=backend))
        g = compat.kv_geometry(c)
        assert g.block_format == f"vllm-tpu/{g.kv_order}/float32", g
        return g.kv_order

    assert order(custom, "LBHNC") == sal and order(custom, "BLHNC", env="NHD") == sal
    assert order(custom, "LBNHC", env="HND") in ("rpa3", "rpa3hd64")
    assert order(None, "LBHNC") in ("rpa3", "rpa3hd64")
    # Not resolved in this process: the environment variable decides.
    assert order(custom, None, env="HND") == sal
    assert order(custom, None, env="NHD") in ("rpa3", "rpa3hd64")
    assert order(custom, None) in ("rpa3", "rpa3hd64")


@pytest.mark.parametrize("heads,dim,dtype,src_tp,dst_tp", [
    (8, 128, "bf16", 2, 1),   # TP=2 prefill -> TP=1 decode
    (4, 80, "fp8", 1, 2),     # fp8, head_dim 80 padded to 96 lanes' worth of sublanes
])
def test_worker_pd_reshards_seq_along_lane_caches_byte_exact(configs, monkeypatch, backend, heads, dim, dtype,
                                                             src_tp, dst_tp):
    """P/D between worker sides holding SEQ_ALONG_LANE caches, resharded between TP sizes: the
    consumer's request blocks hold the producer's blocks head by head (whole blocks: an opaque
    region moves with its unused token slots), every other block and the producer unchanged."""
    tokens = 300  # 3 blocks of 128, the last one partial
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = sal_geometry(heads, dim, dtype, src_tp), sal_geometry(heads, dim, dtype, dst_tp)
    s_slots, d_slots, w_slots = sal_pd_slots(gs, gd, tokens, src_ids, dst_ids)
    src = [sal_tensors(gs, r, s_slots) for r in range(src_tp)]
    dst = [sal_tensors(gd, r, d_slots) for r in range(dst_tp)]
    want = [sal_tensors(gd, r, w_slots) for r in range(dst_tp)]
    src_before = [{n: t.clone() for n, t in r.items()} for r in src]
    extra = BACKENDS[backend]
    with pd_workers(configs, monkeypatch, gs, gd, src, dst, extra, 93, src_ids, dst_ids, tokens) as (prods, _):
        assert_pd_bytes(dst, want, src, src_before)
        for r in range(dst_tp):
            for n in NAMES:
                # The request's blocks changed (the test can fail): the filler differed.
                assert not np.array_equal(as_bytes(dst[r][n]), as_bytes(sal_tensors(gd, r, d_slots)[n])), (r, n)
        for w in prods:
            st = w.adapter_stats
            want_backend = "pjrt-view" if backend == "view" else "framework-copy"
            assert st["backend"] == want_backend, st


def drop_during_loads(monkeypatch, w, method):
    """With framework copies: every host-tier load of worker ``w`` (``w.tier.<method>``) is
    followed, between the tier's write into the mirrors and the commit, by a drop of another
    block, as when a save ends on the saver thread then; the load must keep its blocks' pages
    (before the fix it committed zeros, silently)."""
    cp = w.caches.copier
    if cp is None:
        return
    real = getattr(w.tier, method)

    def racing(hashes, ids):
        n = real(hashes, ids)
        cp.drop([1])
        return n

    monkeypatch.setattr(w.tier, method, racing)


def tier_round_trip(configs, monkeypatch, backend, g, kv, split=1):
    """Saves blocks 3..5 of TP rank 1's ``kv`` to a worker's host tier and loads them into blocks
    12..14: those become copies of 3..5 (which differed before), every other block unchanged.
    ``split``: the tensors hold that many kernel pages per scheduler block (block ``b`` is pages
    ``b * split ..``)."""
    w = worker(configs, "kv_both", g, dict(BACKENDS[backend], host_capacity_bytes=64 << 20))
    try:
        register(monkeypatch, w, kv, 1)
        orig = {n: t.clone() for n, t in kv.items()}
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("o1", hashes, [3, 4, 5])]))
        assert w.flush_saves(30)
        assert w.stats["saved_blocks"] == 3
        drop_during_loads(monkeypatch, w, "get")
        w.start_load_kv(TpuSyncMetadata(loads=[TierOp("o1", hashes, [12, 13, 14])]))
        assert w.stats["loaded_blocks"] == 3 and w.stats["failed_loads"] == 0, w.stats
        for n in NAMES:
            want = orig[n].clone()
            want[12 * split:15 * split] = orig[n][3 * split:6 * split]
            assert not torch.equal(want.view(torch.uint8), orig[n].view(torch.uint8))
            assert np.array_equal(as_bytes(kv[n]), as_bytes(want)), n
    finally:
        w.shutdown()


def test_worker_host_tier_store_then_load_seq_along_lane_blocks(configs, monkeypatch, backend):
    g = sal_geometry(8, 128, "bf16", 2)
    tier_round_trip(configs, monkeypatch, backend, g,
                    sal_tensors(g, 1, sal_slots(g, 3 * SAL_BS, [3, 4, 5], seed=21, fill_seed=22)))


def test_worker_refuses_a_cache_of_the_other_tpu_layout(configs, monkeypatch):
    """A SEQ_ALONG_LANE geometry with token-major RPA v3 tensors (the engine and the connector
    disagree on the layout), and the reverse, fail at registration naming both shapes."""
    g = sal_geometry(8, 128, "bf16", 2)
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 16 << 20})
    try:
        v3 = {n: torch.zeros((NB, SAL_BS, 4, 2, 128), dtype=torch.bfloat16) for n in NAMES}
        with pytest.raises(ValueError, match=r"SEQ_ALONG_LANE .*\[num_blocks, 8, 64, 2, 128\]"):
            register(monkeypatch, w, v3, 0)
    finally:
        w.shutdown()
    g3 = dataclasses.replace(geometry(8, 128, "bf16", 2), block_size=SAL_BS)
    w = worker(configs, "kv_both", g3, {"host_capacity_bytes": 16 << 20})
    try:
        sal = {n: torch.zeros((NB,) + g.layer_shape(), dtype=torch.bfloat16) for n in NAMES}
        with pytest.raises(ValueError, match=r"ragged paged attention v3 .*\[num_blocks, 128, 4, 2, 128\]"):
            register(monkeypatch, w, sal, 0)
    finally:
        w.shutdown()


# ---- vLLM-TorchTPU's dense MLA latent cache ----------------------------------------------------
# (``PallasMLAttentionBackend``, DeepSeek-V2/V3 and Kimi-K2: one cache per MLA layer, replicated on
# every TP rank, ``[num_blocks, block_size / P, P, D']`` with P = 32 / bits tokens packed to a row
# and the latent (512) then the rope key (64) of a token in D' = 640 lanes.)

MLA_LORA, MLA_ROPE = 512, 64
MLA_DIM = MLA_LORA + MLA_ROPE
MLA_BS = 16


def pallas_mla_kv_cache_shape(num_blocks, block_size, head_size, bits):
    """vllm-torchtpu 0.29.0 ``PallasMLAttentionBackend.get_kv_cache_shape`` for a concrete dtype
    (``layers/adapter/attention.py``), which calls the MLA v2 kernel's ``get_kv_cache_shape``
    (``kernels/mla/v2/kernel.py``) with ``kv_packing = get_dtype_packing(dtype)``, restated."""
    packing = 32 // bits
    return (num_blocks, -(-block_size // packing), packing, -(-head_size // 128) * 128)


def mla_geometry(dtype, tp, block_size=MLA_BS):
    return KvGeometry(model="deepseek-tpu-test", num_layers=len(NAMES), num_kv_heads=1, heads_per_rank=1,
                      head_dim=MLA_DIM, dtype=dtype, block_size=block_size, tp=tp,
                      block_format=f"vllm-tpu/{compat.MLA_ORDER}/{dtype}", use_mla=True, kv_order=compat.MLA_ORDER)


def mla_latents(layer, tokens, np_t, seed):
    """``[tokens, 576]`` non-zero latents (kv_c then k_pe) of one layer; distinct per seed."""
    rng = np.random.default_rng(seed * 1000 + layer)
    return rng.integers(1, np.iinfo(np_t).max, size=(tokens, MLA_DIM), dtype=np_t, endpoint=True)


def mla_tensors(g, tokens, block_ids, seed, fill_seed):
    """One TP rank's per-layer MLA caches (every rank holds the same): every token slot of
    every block written as the MLA kernel writes a token (``pack_new_kv``: token ``t`` of a page
    at row ``t / P``, sublane ``t % P``, its 576 elements in the first lanes, the lane padding
    zero) with filler of ``fill_seed``, then the request's ``tokens`` tokens of ``seed`` at
    ``block_ids``."""
    np_t = DTYPES[g.dtype]
    bits = np.dtype(np_t).itemsize * 8
    shape = pallas_mla_kv_cache_shape(NB, g.block_size, MLA_DIM, bits)
    p = shape[2]
    out = {}
    for layer, name in enumerate(NAMES):
        cache = np.zeros(shape, dtype=np_t)
        fill = mla_latents(layer, NB * g.block_size, np_t, fill_seed)
        for s in range(NB * g.block_size):
            b, t = divmod(s, g.block_size)
            cache[b, t // p, t % p, :MLA_DIM] = fill[s]
        lat = mla_latents(layer, tokens, np_t, seed)
        for s in range(tokens):
            b, t = block_ids[s // g.block_size], s % g.block_size
            cache[b, t // p, t % p, :MLA_DIM] = lat[s]
        bits_t = torch.from_numpy(cache.view(np.dtype(str(TORCH_BITS[g.dtype]).replace("torch.", ""))))
        t = torch.empty(bits_t.shape, dtype=TORCH_BITS[g.dtype])
        t.copy_(bits_t)
        out[name] = t.view(TORCH[g.dtype])
    return out


def test_geometry_of_the_mla_cache_matches_its_shape_formula():
    for dtype, tp, bs in [("bf16", 1, 16), ("fp8", 4, 16), ("f32", 2, 8), ("bf16", 8, 64)]:
        g = mla_geometry(dtype, tp, bs)
        bits = {"f32": 32, "bf16": 16, "fp8": 8}[dtype]
        assert (NB,) + g.torch_mla_shape() == pallas_mla_kv_cache_shape(NB, bs, MLA_DIM, bits), g
        # tpu_sync sees the same bytes token-major: [num_blocks, block_size, D'].
        assert g.view_shape(NB) == (NB, bs, 640) and g.layer_shape() == (bs, 640)
        assert g.layer_block_bytes == int(np.prod(g.torch_mla_shape())) * bits // 8 == bs * 640 * bits // 8
        lay = g.tpu_sync_layout(NB)
        assert lay["spec"]["order"] == compat.MLA_ORDER and lay["model"]["num_kv_heads"] == 1, lay
        assert lay["model"]["kv_planes"] == 1 and lay["model"]["head_dim"] == MLA_DIM and "block_format" not in lay
    # Another engine's MLA layout, or a non-MLA peer, is refused by name.
    g = mla_geometry("bf16", 2)
    assert "kv_order" in g.mismatch(dict(g.to_dict(), kv_order="rpa3"))
    assert "use_mla" in g.mismatch(dict(g.to_dict(), use_mla=False))


@pytest.mark.parametrize("dtype,src_tp,dst_tp", [
    ("bf16", 4, 2),   # TP=4 prefill -> TP=2 decode
    ("fp8", 2, 4),    # fp8 (4 tokens to a row), TP=2 -> TP=4: every decode rank gets the latent
])
def test_worker_pd_of_mla_caches_writes_every_replica_byte_exact(configs, monkeypatch, backend, dtype, src_tp,
                                                                 dst_tp):
    """P/D between vLLM-TorchTPU worker sides holding the dense MLA cache: every decode rank's
    replica gets the request's latents (tokens of a partial last block included) and nothing
    else: its other blocks, its partial block's unused token slots and the lane padding
    unchanged; the producer unchanged; each decode rank pulled exactly one latent per token and
    layer (576 elements: never the lane padding)."""
    tokens = 40  # 3 blocks of 16, the last one partial
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = mla_geometry(dtype, src_tp), mla_geometry(dtype, dst_tp)
    src = [mla_tensors(gs, tokens, src_ids, seed=3, fill_seed=11) for _ in range(src_tp)]
    before = mla_tensors(gd, 0, dst_ids, seed=3, fill_seed=12)
    dst = [mla_tensors(gd, 0, dst_ids, seed=3, fill_seed=12) for _ in range(dst_tp)]
    # The reference: the filler, with the request's token slots overwritten by its latents.
    want = mla_tensors(gd, 0, dst_ids, seed=3, fill_seed=12)
    np_t = DTYPES[dtype]
    p = gd.packing
    for layer, n in enumerate(NAMES):
        lat = mla_latents(layer, tokens, np_t, seed=3)
        w = want[n].view(TORCH_BITS[dtype]).numpy()
        for s in range(tokens):
            b, t = dst_ids[s // MLA_BS], s % MLA_BS
            w[b, t // p, t % p, :MLA_DIM] = lat[s]
    src_before = [{n: t.clone() for n, t in r.items()} for r in src]
    extra = BACKENDS[backend]
    with pd_workers(configs, monkeypatch, gs, gd, src, dst, extra, 95, src_ids, dst_ids, tokens) as (prods, conss):
        assert_pd_bytes(dst, [want] * dst_tp, src, src_before)
        # Each decode rank reads one producer replica (rank r % src_tp): the producer ranks no
        # decode rank reads did not register (nor stage) the request.
        read = {r % src_tp for r in range(dst_tp)}
        assert [w.stats["registered"] for w in prods] == [int(r in read) for r in range(src_tp)]
        assert [w.stats["register_skipped"] for w in prods] == [int(r not in read) for r in range(src_tp)]
        for r in range(dst_tp):
            for n in NAMES:
                # The request's blocks changed (the test can fail): the filler differed.
                assert not np.array_equal(as_bytes(dst[r][n]), as_bytes(before[n])), (r, n)
        elem = np.dtype(np_t).itemsize
        for w in conss:
            moved = w.xfer_stats.data["bytes_transferred"] if w.xfer_stats is not None else None
            if moved is not None:
                assert moved == [tokens * MLA_DIM * elem * len(NAMES)], moved
            st = w.adapter_stats
            assert st["backend"] == ("pjrt-view" if backend == "view" else "framework-copy"), st


def test_worker_host_tier_store_then_load_mla_blocks(configs, monkeypatch, backend):
    g = mla_geometry("bf16", 2)
    tier_round_trip(configs, monkeypatch, backend, g, mla_tensors(g, 3 * MLA_BS, [3, 4, 5], seed=21, fill_seed=22))


def test_worker_refuses_mla_caches_it_does_not_map(configs, monkeypatch):
    """Refused at registration, by name: tpu-inference's packing (32 tokens to a row) handed to
    the torch worker, a sparse MLA layer's (nope, rope) pair, an indexer cache more than the
    attention layers, and a block size the dtype's packing does not divide."""
    g = mla_geometry("bf16", 2, block_size=64)
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 16 << 20})
    try:
        ti = {n: torch.zeros((NB, 2, 32, 640), dtype=torch.bfloat16) for n in NAMES}
        with pytest.raises(ValueError, match=r"MLA latent cache .*\[num_blocks, 32, 2, 640\].*\[16, 2, 32, 640\]"):
            register(monkeypatch, w, ti, 0)
        good = torch.zeros((NB, 32, 2, 640), dtype=torch.bfloat16)
        sparse = {NAMES[0]: good, NAMES[1]: (torch.zeros((NB, 64, 512), dtype=torch.float8_e4m3fn),
                                            torch.zeros((NB, 64, 64), dtype=torch.bfloat16))}
        with pytest.raises(NotImplementedError, match="sparse MLA layer"):
            register(monkeypatch, w, sparse, 0)
        indexer = {NAMES[0]: good, NAMES[1]: good, "model.layers.1.self_attn.indexer.k_cache": good}
        with pytest.raises(ValueError, match="indexer caches"):
            register(monkeypatch, w, indexer, 0)
    finally:
        w.shutdown()
    odd = mla_geometry("fp8", 1, block_size=18)
    w = worker(configs, "kv_both", odd, {"host_capacity_bytes": 16 << 20})
    try:
        with pytest.raises(ValueError, match="block size 18 .* packs 4 fp8 tokens to a row"):
            register(monkeypatch, w, {n: torch.zeros((NB, 5, 4, 640), dtype=torch.float8_e4m3fn) for n in NAMES}, 0)
    finally:
        w.shutdown()


# ---- kernel pages smaller than the scheduler's block --------------------------------------------
# (Where the attention kernel runs a fixed block size that the scheduler's block is a multiple of,
# vLLM splits scheduler block ``b`` into kernel blocks ``b * s .. b * s + s - 1``
# (``vllm/v1/worker/block_table.py`` ``map_to_kernel_blocks``) and vLLM-TorchTPU allocates
# ``[num_blocks * s, block_size / s, ...]`` per layer (``kv_cache_materializer.py``
# ``make_attention_cache_tensor``, 0.29.0). The connector's block ids are the scheduler's.)


def kernel_slots(split, block_size, slots):
    """(kernel block, slot in it) of scheduler slots ``slots`` (``block * block_size + token``),
    as vLLM's ``map_to_kernel_blocks`` places them with ``split`` kernel blocks per block."""
    kbs = block_size // split
    b, t = np.divmod(np.asarray(slots), block_size)
    return b * split + t // kbs, t % kbs


def kernel_page_tensors(g, rank, tokens, block_ids, seed, fill_seed, split):
    """One TP rank's per-layer RPA v3 caches with ``split`` kernel pages per scheduler block:
    ``[NB * split, BS / split, R, P, D']``, every token slot written where the kernel writes it
    (:func:`kernel_slots`), filler of ``fill_seed`` then the request's tokens at ``block_ids``."""
    np_t = DTYPES[g.dtype]
    hd64 = g.kv_order == "rpa3hd64"
    local = g.heads_per_rank
    sl = slice(rank * local, (rank + 1) * local)
    out = {}
    for layer, name in enumerate(NAMES):
        cache = np.zeros((NB * split, BS // split) + g.layer_shape()[1:], dtype=np_t)
        k, v = logical_kv(layer, NB * BS, g.num_kv_heads, g.head_dim, np_t, fill_seed)
        cache[kernel_slots(split, BS, range(NB * BS))] = merge_kv(k[:, sl], v[:, sl], g.packing, hd64)
        k, v = logical_kv(layer, tokens, g.num_kv_heads, g.head_dim, np_t, seed)
        slots = [block_ids[t // BS] * BS + t % BS for t in range(tokens)]
        if tokens:
            cache[kernel_slots(split, BS, slots)] = merge_kv(k[:, sl], v[:, sl], g.packing, hd64)
        bits = torch.from_numpy(cache.view(np.dtype(str(TORCH_BITS[g.dtype]).replace("torch.", ""))))
        t = torch.empty(bits.shape, dtype=TORCH_BITS[g.dtype])
        t.copy_(bits)
        out[name] = t.view(TORCH[g.dtype])
    return out


@pytest.mark.parametrize("heads,dim,dtype,src_tp,dst_tp,src_split,dst_split", [
    (8, 128, "bf16", 2, 1, 2, 1),   # the prefill's kernel runs 8-token pages, the decode's 16
    (6, 128, "fp8", 1, 2, 1, 4),    # the decode's kernel runs 4-token pages
    (4, 64, "bf16", 2, 4, 4, 2),    # the head_dim-64 kernel, kernel pages on both sides
])
def test_worker_pd_between_kernel_pages_smaller_than_the_scheduler_block(configs, monkeypatch, backend, heads, dim,
                                                                        dtype, src_tp, dst_tp, src_split, dst_split):
    """P/D where one side's (or both sides') kernel runs pages smaller than the scheduler's
    block: the engine's own tensors (kernel-page shaped) are written in place, byte-exact, tokens
    of a partial last block included, every other kernel page and the producer unchanged."""
    tokens = 40  # 3 blocks of 16, the last one partial
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = geometry(heads, dim, dtype, src_tp), geometry(heads, dim, dtype, dst_tp)
    src = [kernel_page_tensors(gs, r, tokens, src_ids, 3, 11, src_split) for r in range(src_tp)]
    dst = [kernel_page_tensors(gd, r, 0, dst_ids, 3, 12, dst_split) for r in range(dst_tp)]
    want = [kernel_page_tensors(gd, r, tokens, dst_ids, 3, 12, dst_split) for r in range(dst_tp)]
    assert tuple(dst[0][NAMES[0]].shape[:2]) == (NB * dst_split, BS // dst_split)
    src_before = [{n: t.clone() for n, t in r.items()} for r in src]
    with pd_workers(configs, monkeypatch, gs, gd, src, dst, BACKENDS[backend], 97, src_ids, dst_ids, tokens):
        assert_pd_bytes(dst, want, src, src_before)
        for r in range(dst_tp):
            for n in NAMES:
                assert not np.array_equal(as_bytes(dst[r][n]), as_bytes(kernel_page_tensors(
                    gd, r, 0, dst_ids, 3, 12, dst_split)[n])), (r, n)  # the pull changed them


def test_worker_pd_of_mla_caches_with_kernel_pages(configs, monkeypatch, backend):
    """The dense MLA cache with 8-token kernel pages on the prefill (fp8: 2 rows of 4 tokens
    each) and scheduler-block pages on the decode, TP=2 -> 1: byte-exact."""
    tokens, src_ids, dst_ids = 40, [5, 9, 2], [11, 3, 7]
    gs, gd = mla_geometry("fp8", 2), mla_geometry("fp8", 1)
    np_t = DTYPES["fp8"]
    p = gs.packing
    # [NB * 2, 8 / P, P, 640]: the scheduler layout's tensors in kernel pages, each token slot
    # placed by kernel_slots (not a reshape of the scheduler-block tensor).
    kb, ks = kernel_slots(2, MLA_BS, range(NB * MLA_BS))

    def paged(kv):
        out = {}
        for n, t in kv.items():
            a = t.view(TORCH_BITS["fp8"]).numpy()
            rows = a.reshape(NB * MLA_BS, 640)  # token-major, as the scheduler-block cache holds them
            cache = np.zeros((NB * 2, MLA_BS // 2 // p, p, 640), dtype=np.uint8)
            cache[kb, ks // p, ks % p] = rows
            t = torch.empty(cache.shape, dtype=torch.uint8)  # 64-byte aligned, as the engine's
            t.copy_(torch.from_numpy(cache))
            out[n] = t.view(TORCH["fp8"])
        return out

    src = [paged(mla_tensors(gs, tokens, src_ids, seed=3, fill_seed=11)) for _ in range(2)]
    dst = [mla_tensors(gd, 0, dst_ids, seed=3, fill_seed=12)]
    want = mla_tensors(gd, 0, dst_ids, seed=3, fill_seed=12)
    for layer, n in enumerate(NAMES):
        lat = mla_latents(layer, tokens, np_t, seed=3)
        w = want[n].view(TORCH_BITS["fp8"]).numpy()
        for s in range(tokens):
            b, t = dst_ids[s // MLA_BS], s % MLA_BS
            w[b, t // p, t % p, :MLA_DIM] = lat[s]
    src_before = [{n: t.clone() for n, t in r.items()} for r in src]
    with pd_workers(configs, monkeypatch, gs, gd, src, dst, BACKENDS[backend], 98, src_ids, dst_ids, tokens):
        assert_pd_bytes(dst, [want], src, src_before)


def test_worker_host_tier_store_then_load_kernel_pages(configs, monkeypatch, backend):
    """4 kernel pages per scheduler block: kernel pages 48..59 become copies of 12..23."""
    g = geometry(8, 128, "bf16", 2)
    tier_round_trip(configs, monkeypatch, backend, g, kernel_page_tensors(g, 1, 3 * BS, [3, 4, 5], 21, 22, 4), split=4)


def sal_kernel_pages(kv, split):
    """SEQ_ALONG_LANE caches (``[NB, 2H, D'/P, P, BS]`` per layer) as vLLM-TorchTPU allocates
    them with ``split`` kernel pages per scheduler block: ``[NB * split, 2H, D'/P, P, BS /
    split]``, token ``j`` of block ``b`` in lane ``j % (BS / split)`` of kernel page ``b * split +
    j // (BS / split)`` (``map_to_kernel_blocks``), each page's tokens along its lanes."""
    out = {}
    for n, t in kv.items():
        bits = TORCH_BITS[str(t.dtype).split(".")[-1].replace("bfloat16", "bf16").replace("float8_e4m3fn", "fp8")
                          .replace("float32", "f32")]
        a = t.view(bits).numpy()
        nb, rows, dp, p, bs = a.shape
        kbs = bs // split
        paged = np.zeros((nb * split, rows, dp, p, kbs), dtype=a.dtype)
        for j in range(bs):
            paged[np.arange(nb) * split + j // kbs, :, :, :, j % kbs] = a[:, :, :, :, j]
        c = torch.empty(paged.shape, dtype=bits)
        c.copy_(torch.from_numpy(paged))
        out[n] = c.view(t.dtype)
    return out


@pytest.mark.parametrize("src_split,dst_split", [(2, 1), (1, 4)])
def test_worker_pd_of_seq_along_lane_kernel_pages(configs, monkeypatch, backend, src_split, dst_split):
    """The SEQ_ALONG_LANE cache in kernel pages smaller than the scheduler's block (64- or
    32-token pages of a 128-token block) on the prefill or the decode, TP=2 -> 1: the pages are
    seen as scheduler blocks through a logical view (``[N, 2H, D'/P, P, s, BS/s]``) that only the
    framework's copies move (chosen for them whatever the back end asked for them is ``auto``),
    byte-exact in the engine's own paged tensors, every other page and the producer unchanged."""
    tokens = 300
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = sal_geometry(8, 128, "bf16", 2), sal_geometry(8, 128, "bf16", 1)
    s_slots, d_slots, w_slots = sal_pd_slots(gs, gd, tokens, src_ids, dst_ids)

    def paged(kv, split):
        return sal_kernel_pages(kv, split) if split > 1 else kv

    src = [paged(sal_tensors(gs, r, s_slots), src_split) for r in range(2)]
    dst = [paged(sal_tensors(gd, 0, d_slots), dst_split)]
    want = [paged(sal_tensors(gd, 0, w_slots), dst_split)]
    src_before = [{n: t.clone() for n, t in r.items()} for r in src]
    with pd_workers(configs, monkeypatch, gs, gd, src, dst, BACKENDS[backend], 96, src_ids, dst_ids,
                    tokens) as (prods, conss):
        assert_pd_bytes(dst, want, src, src_before)
        assert not np.array_equal(as_bytes(dst[0][NAMES[0]]), as_bytes(paged(sal_tensors(gd, 0, d_slots),
                                                                               dst_split)[NAMES[0]]))
        for ws, split in ((prods, src_split), (conss, dst_split)):
            for w in ws:
                st = w.adapter_stats
                assert st["backend"] == ("framework-copy" if split > 1 or backend != "view" else "pjrt-view"), st


@pytest.mark.parametrize("direction", ["bundle->layers", "layers->bundle"])
def test_worker_pd_of_a_bundle_of_kernel_pages(configs, monkeypatch, backend, direction):
    """vLLM-TorchTPU's block-major bundle with kernel pages (``[NB * 2, layers, BS / 2, R, P,
    D']``; a scheduler block's two pages of one layer lie a bundle row apart) on one side,
    per-layer caches on the other, TP=2 -> 1: byte-exact in the bundle, every other page and the
    producer unchanged."""
    tokens = 40
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = geometry(8, 128, "bf16", 2), geometry(8, 128, "bf16", 1)
    to_bundle = direction == "layers->bundle"

    def side(g, rank, n, ids, seed, fill, bundled):
        kv = kernel_page_tensors(g, rank, n, ids, seed, fill, 2 if bundled else 1)
        return block_major(kv)[1] if bundled else kv

    src = [side(gs, r, tokens, src_ids, 3, 11, not to_bundle) for r in range(2)]
    dst = [side(gd, 0, 0, dst_ids, 3, 12, to_bundle)]
    want = [side(gd, 0, tokens, dst_ids, 3, 12, to_bundle)]
    src_before = [{n: t.clone() for n, t in r.items()} for r in src]
    with pd_workers(configs, monkeypatch, gs, gd, src, dst, BACKENDS[backend], 99, src_ids, dst_ids,
                    tokens) as (prods, conss):
        assert_pd_bytes(dst, want, src, src_before)
        # The bundle side moves every layer of a block's pages in one device copy: a stage of
        # [5, 9, 2] (or a commit of [11, 3, 7]) is one batched call, or one Tensor.copy_ per run
        # (3 runs) with torch's copies, not one per layer too.
        for w in (conss if to_bundle else prods):
            st = w.adapter_stats
            assert st["bundle_wide"], st
            op = 1 if backend == "batch-transfer" else 3
            # the decode also stages its partial last block first (one more op of one block)
            assert st["device_copies"] == (op + 1 if to_bundle else op), st


def test_worker_host_tier_store_then_load_kernel_pages_in_other_layouts(configs, monkeypatch, backend):
    """The host tier with 2 kernel pages per block of the SEQ_ALONG_LANE cache, and of a
    block-major bundle: pages 24..29 become copies of 6..11."""
    g = sal_geometry(8, 128, "bf16", 2)
    kv = sal_kernel_pages(sal_tensors(g, 1, sal_slots(g, 3 * SAL_BS, [3, 4, 5], seed=21, fill_seed=22)), 2)
    tier_round_trip(configs, monkeypatch, backend, g, kv, split=2)
    g = geometry(8, 128, "bf16", 2)
    tier_round_trip(configs, monkeypatch, backend, g,
                    block_major(kernel_page_tensors(g, 1, 3 * BS, [3, 4, 5], 21, 22, 2))[1], split=2)


def test_worker_refuses_kernel_pages_it_cannot_see_as_blocks(configs, monkeypatch):
    """Refused at registration, by name: pages that do not divide the scheduler's block, and
    ``pjrt-view`` asked for kernel pages that only framework copies can see as scheduler blocks
    (the SEQ_ALONG_LANE cache's)."""
    g = sal_geometry(8, 128, "bf16", 2)
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 16 << 20, "torch_backend": "pjrt-view"})
    try:
        paged = {n: torch.zeros((NB * 2,) + g.layer_shape()[:-1] + (SAL_BS // 2,), dtype=torch.bfloat16)
                 for n in NAMES}
        with pytest.raises(errors.InvalidArgumentError, match=r"pjrt-view needs contiguous KV tensors"):
            register(monkeypatch, w, paged, 0)
    finally:
        w.shutdown()
    g = geometry(8, 128, "bf16", 2)
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 16 << 20})
    try:
        odd = {n: torch.zeros((NB * 3, 5) + g.layer_shape()[1:], dtype=torch.bfloat16) for n in NAMES}
        with pytest.raises(ValueError, match=r"ragged paged attention v3 .*\[num_blocks, 16, 4, 2, 128\]"):
            register(monkeypatch, w, odd, 0)
    finally:
        w.shutdown()
    # vLLM's CPU cache [num_blocks, heads, block_size, 2 * head_dim] has heads on its second
    # axis: half the heads on twice the blocks is a wrong cache, not kernel pages.
    lb = dataclasses.replace(g, kv_order="lbhnc", block_format="cpu/lbhnc/bf16")
    w = worker(configs, "kv_both", lb, {"host_capacity_bytes": 16 << 20})
    try:
        halved = {n: torch.zeros((NB * 2, 2, BS, 256), dtype=torch.bfloat16) for n in NAMES}
        with pytest.raises(ValueError, match=r"LBHNC per-layer KV cache \[num_blocks, 4, 16, 256\]"):
            register(monkeypatch, w, halved, 0)
    finally:
        w.shutdown()
