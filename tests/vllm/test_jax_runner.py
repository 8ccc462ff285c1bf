"""The connector's worker side with a tpu-inference model runner (issue 25; docs/tpu.md).

tpu-inference 0.32 never calls ``register_kv_caches``: its connector gets ``register_runner(runner)``,
and ``runner.kv_caches`` is a list of ``jax.Array`` s, one per layer, each the ragged paged
attention v3 cache ``[num_blocks, block_size, TP * R, P, D']`` sharded
``NamedSharding(mesh, P("data", None, "model"))`` (one TP rank's cache per device), which every
forward re-assigns (donation). Here JAX runs on CPU with 8 host devices: the producer's runner on
devices 0..TP-1, the consumer's on devices 4..; the bytes are the kernels' ``merge_kv`` of random,
never-zero K/V (``bindings/python/tests/test_tpu_layouts.py``). The runner objects stand in for
tpu-inference's runner around the arrays only.

P/D between the worker sides over loopback TCP (TP=4 -> 2 and 2 -> 4, bf16 and fp8, head_dim 128
and the head_dim-64 kernel's cache, both back ends), and host-tier store then load: byte-exact,
every other block and the producer's caches unchanged.
"""

import os
import sys
import threading
import time

import numpy as np
import pytest

if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Read when JAX creates its CPU client (its first use, after collection).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
vllm = pytest.importorskip("vllm")
jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from test_connector import configs, connector, vllm_config  # noqa: E402,F401  (fixtures)
from test_tpu_engine_layouts import geometry, worker  # noqa: E402
from tpu_sync.jax_kv import JaxKv  # noqa: E402
from tpu_sync.vllm.metadata import RecvSpec, SendSpec, TierOp, TpuSyncMetadata  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bindings", "python", "tests"))
from test_tpu_layouts import DTYPES, merge_kv, logical_kv  # noqa: E402
from test_jax_kv import Runner, devices_or_skip  # noqa: E402  (the runner stand-in, the 8 devices)

NB, BS, LAYERS = 16, 16, 2  # test_tpu_engine_layouts' geometry: 2 layers, 16-token blocks
from test_jax_kv import JAX_DTYPE  # noqa: E402


def rank_caches(g, tokens, ids, seed, fill_seed):
    """Every TP rank's per-layer caches (bit patterns ``[NB, BS, R, P, D']``): block ``ids[i]``
    holds tokens ``i*BS..`` of the request's K/V (seed ``seed``), every other block other KV
    (seed ``fill_seed``), as ``merge_kv`` lays them out; padding zero."""
    np_t = DTYPES[g.dtype]
    packing = 4 // np.dtype(np_t).itemsize
    hd64 = g.kv_order == "rpa3hd64"
    out = []
    for r in range(g.tp):
        sl = slice(r * g.heads_per_rank, (r + 1) * g.heads_per_rank)
        per = []
        for layer in range(LAYERS):
            fk, fv = logical_kv(layer, NB * BS, g.num_kv_heads, g.head_dim, np_t, fill_seed)
            cache = merge_kv(fk[:, sl], fv[:, sl], packing, hd64).reshape((NB, BS) + g.layer_shape()[1:]).copy()
            if tokens:
                k, v = logical_kv(layer, tokens, g.num_kv_heads, g.head_dim, np_t, seed)
                m = merge_kv(k[:, sl], v[:, sl], packing, hd64)
                for t in range(tokens):
                    cache[ids[t // BS], t % BS] = m[t]
            per.append(cache)
        out.append(per)
    return out


def runner(g, caches, first_device):
    devs = devices_or_skip(8)[first_device:first_device + g.tp]
    mesh = Mesh(np.array(devs).reshape(1, g.tp), ("data", "model"))
    sh = NamedSharding(mesh, P("data", None, "model"))
    return Runner([jax.device_put(np.concatenate([caches[r][l] for r in range(g.tp)], axis=2).view(JAX_DTYPE[g.dtype]),
                                  sh) for l in range(LAYERS)])


def bits(a):
    return np.asarray(jax.device_get(a)).view(np.dtype(f"u{np.dtype(a.dtype).itemsize}"))


def glob(caches, layer):
    return np.concatenate([r[layer] for r in caches], axis=2)


def wait_pulled(w, req):
    deadline, res = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        res = w.get_transfer_results(set())
        if res.finished_recving or res.failed_recving:
            return res
        time.sleep(0.02)
    return res


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
@pytest.mark.parametrize("heads,dim,dtype,src_tp,dst_tp,both", [
    (8, 128, "bf16", 4, 2, False),
    (8, 128, "bf16", 2, 4, False),
    (8, 128, "fp8", 4, 2, False),
    (8, 128, "fp8", 2, 4, False),
    # The head_dim-64 kernel's cache (rpa3hd64).
    (8, 64, "bf16", 4, 2, False),
    (8, 64, "fp8", 2, 4, False),
    # Both at once: the consumer's pull starts before the producer registered, without its
    # blocks (it asks the producer for them).
    (8, 128, "bf16", 4, 2, True),
    (8, 64, "fp8", 2, 4, True),
])
def test_pd_between_jax_runners_through_the_worker_sides(configs, monkeypatch, heads, dim, dtype, src_tp, dst_tp,
                                                         both, backend):
    tokens = 40  # 3 blocks, the last one partial
    # The runner's arrays are read on the model's thread only: each forward replaces them
    # (donating the old ones), so a read from another thread mid-forward may meet a deleted
    # array (a both-at-once pull started on its describe thread once did, 1 run in ~20).
    readers = set()
    arrays = JaxKv.arrays

    def recorded(self):
        readers.add(threading.current_thread().name)
        return arrays(self)

    monkeypatch.setattr(JaxKv, "arrays", recorded)
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = geometry(heads, dim, dtype, src_tp), geometry(heads, dim, dtype, dst_tp)
    src = rank_caches(gs, tokens, src_ids, seed=3, fill_seed=11)
    dst = rank_caches(gd, 0, dst_ids, seed=3, fill_seed=12)
    want = rank_caches(gd, tokens, dst_ids, seed=3, fill_seed=12)
    pr, cr = runner(gs, src, 0), runner(gd, dst, 4)
    prod = worker(configs, "kv_producer", gs, {"jax_backend": backend})
    cons = worker(configs, "kv_consumer", gd, {"jax_backend": backend})
    try:
        prod.register_runner(pr)
        cons.register_runner(cr)
        want_backend = "pjrt-view" if backend == "auto" else backend
        for w, tp in ((prod, src_tp), (cons, dst_tp)):
            st = w.jax_stats
            assert st["backend"] == want_backend and st["tp"] == tp and st["ranks"] == list(range(tp)), st
            hs = w.handshake()
            assert hs.tp_ranks == list(range(tp)) and hs.address
        # The scheduler's view of the producer: one address for every rank it holds.
        peers = {r: prod.handshake().address for r in prod.handshake().tp_ranks}
        recv = RecvSpec("d1", 91, peers, gs.tpu_sync_layout(NB), None if both else src_ids, dst_ids, tokens, 30.0)
        if both:
            cr.forward()
            cons.start_load_kv(TpuSyncMetadata(recvs=[recv]))
            assert cons.get_transfer_results(set()).finished_recving == set()  # waits for the producer
        pr.forward()  # the caches are read again at each hook
        send = SendSpec("p1", 91, src_ids, tokens, 60.0, dst_tp)
        if both:
            # As an engine step registers with early_register (the default): bind before the
            # forward, wait_for_save after it (registered whole there, staged first).
            meta = TpuSyncMetadata(layer_sends=[send])
            prod.bind(meta)
            prod.start_load_kv(meta)
            prod.wait_for_save(meta)
        else:
            prod.start_load_kv(TpuSyncMetadata(sends=[send]))
        # Registered whole, staged on this thread (no layer-wise publisher reading the caches
        # while the next forward donates them).
        assert prod.stats["registered"] == 1 and prod.stats["layerwise_registered"] == 0, prod.stats
        pr.forward()  # the next step may overwrite the blocks: they are staged
        if not both:
            cr.forward()
            cons.start_load_kv(TpuSyncMetadata(recvs=[recv]))
        cr.forward()  # a forward while the pull runs: the caches are donated in place
        res = wait_pulled(cons, "d1")
        assert res.finished_recving == {"d1"} and not res.failed_recving, cons.stats
        for layer in range(LAYERS):
            got, exp = bits(cr.kv_caches[layer]), glob(want, layer)
            assert np.array_equal(got, exp), (layer, sorted({int(i[0]) for i in np.argwhere(got != exp)}),
                                              np.argwhere(got != exp)[:4])
            assert np.array_equal(bits(pr.kv_caches[layer]), glob(src, layer)), f"layer {layer} of the producer"
        assert cons.stats["pulls_deferred"] == int(both)
        assert readers == {threading.current_thread().name}, readers
        st = cons.jax_stats
        if want_backend == "framework-copy":
            assert st["h2d_bytes"] == 3 * gd.layer_block_bytes * dst_tp * LAYERS, st
            assert prod.jax_stats["d2h_bytes"] == 3 * gs.layer_block_bytes * src_tp * LAYERS
    finally:
        cons.shutdown()
        prod.shutdown()


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
def test_host_tier_store_then_load_with_a_jax_runner(configs, backend):
    g = geometry(8, 128, "bf16", 4)
    kv = rank_caches(g, 3 * BS, [3, 4, 5], seed=21, fill_seed=22)
    r = runner(g, kv, 0)
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 64 << 20, "jax_backend": backend})
    try:
        w.register_runner(r)
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("o1", hashes, [3, 4, 5])]))
        assert w.stats["saved_blocks"] == 3, w.stats  # synchronous with a JAX runner
        # ...but the scheduler (async_saves) frees the request's blocks only once reported.
        assert w.get_transfer_results({"o1"}).finished_sending == {"o1"}
        r.forward()
        w.start_load_kv(TpuSyncMetadata(lookups={"o1": hashes + [b"\x08" * 32]}))
        assert w.build_worker_meta().lookup_hits == {"o1": 3}
        w.start_load_kv(TpuSyncMetadata(loads=[TierOp("o1", hashes, [12, 13, 14])]))
        assert w.stats["loaded_blocks"] == 3 and w.stats["failed_loads"] == 0, w.stats
        for layer in range(LAYERS):
            want = glob(kv, layer).copy()
            want[12:15] = want[3:6]
            assert np.array_equal(bits(r.kv_caches[layer]), want), layer
    finally:
        w.shutdown()


def test_a_runner_that_disagrees_with_the_model_is_refused(configs):
    g = geometry(8, 128, "bf16", 2)
    kv = rank_caches(geometry(8, 128, "bf16", 4), 0, [], seed=1, fill_seed=2)
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 16 << 20})
    try:
        with pytest.raises(ValueError, match=r"sharded over 4 devices of the model axis, vLLM's TP is 2"):
            w.register_runner(runner(geometry(8, 128, "bf16", 4), kv, 0))
        assert w.caches is None
    finally:
        w.shutdown()


def registrations(w):
    """Source registrations the worker's endpoint still serves."""
    return w.transport.endpoint.stats()["source_registrations"]


def released(ws, timeout=10.0):
    """Whether every producer worker's registrations ended within ``timeout`` s (they were
    released, not left for the lease of 60 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(registrations(w) == 0 for w in ws):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("direction", ["torch->jax", "jax->torch"])
def test_pd_between_a_jax_runner_and_per_rank_workers(configs, monkeypatch, direction):
    """vLLM-TorchTPU's workers hold one endpoint per TP rank, a JAX runner one endpoint for all
    its ranks; the producer's registrations count consumer ranks, so a request is released once
    every consumer rank got it, whichever kind pulls: byte-exact both ways, and the producer's
    registrations end with the last rank's release (not with the first, not at the lease)."""
    from test_tpu_engine_layouts import NAMES, as_bytes, rank_tensors, register

    tokens = 40
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    jax_side_tp, torch_tp = 4, 2
    if direction == "torch->jax":
        gs, gd = geometry(8, 128, "bf16", torch_tp), geometry(8, 128, "bf16", jax_side_tp)
        src = [rank_tensors(gs, r, tokens, src_ids, seed=3, fill_seed=11) for r in range(torch_tp)]
        prods = [worker(configs, "kv_producer", gs) for _ in range(torch_tp)]
        dst = rank_caches(gd, 0, dst_ids, seed=3, fill_seed=12)
        want = rank_caches(gd, tokens, dst_ids, seed=3, fill_seed=12)
        cr = runner(gd, dst, 4)
        conss = [worker(configs, "kv_consumer", gd)]
    else:
        gs, gd = geometry(8, 128, "bf16", jax_side_tp), geometry(8, 128, "bf16", torch_tp)
        src = rank_caches(gs, tokens, src_ids, seed=3, fill_seed=11)
        pr = runner(gs, src, 0)
        prods = [worker(configs, "kv_producer", gs)]
        dst = [rank_tensors(gd, r, 0, dst_ids, seed=3, fill_seed=12) for r in range(torch_tp)]
        want = [rank_tensors(gd, r, tokens, dst_ids, seed=3, fill_seed=12) for r in range(torch_tp)]
        conss = [worker(configs, "kv_consumer", gd) for _ in range(torch_tp)]
    try:
        if direction == "torch->jax":
            for r, w in enumerate(prods):
                register(monkeypatch, w, src[r], r)
            conss[0].register_runner(cr)
            peers = {r: w.transport.address for r, w in enumerate(prods)}
        else:
            prods[0].register_runner(pr)
            for r, w in enumerate(conss):
                register(monkeypatch, w, dst[r], r)
            peers = {r: prods[0].handshake().address for r in range(jax_side_tp)}
        for w in prods:
            w.start_load_kv(TpuSyncMetadata(sends=[SendSpec("p1", 91, src_ids, tokens, 60.0, gd.tp)]))
            assert w.stats["registered"] == 1, w.stats
        layout = gs.tpu_sync_layout(NB)
        # One consumer after the other: each one's release is in before the next pulls, so a
        # producer that ended the request with the first rank's release fails the second's.
        for r, w in enumerate(conss):
            w.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d1", 91, peers, layout, src_ids, dst_ids, tokens, 30.0)]))
            res = wait_pulled(w, "d1")
            assert res.finished_recving == {"d1"} and not res.failed_recving, (r, w.stats)
            if r + 1 < len(conss):
                deadline = time.monotonic() + 10
                while prods[0].transport.endpoint.stats()["leases"] and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert prods[0].transport.endpoint.stats()["leases"] == 0, "the release did not come"
                assert registrations(prods[0]) == 1, "ended before every consumer rank released"
        if direction == "torch->jax":
            for layer in range(LAYERS):
                assert np.array_equal(bits(cr.kv_caches[layer]), glob(want, layer)), layer
        else:
            for r in range(torch_tp):
                for n in NAMES:
                    got, exp = as_bytes(dst[r][n]), as_bytes(want[r][n])
                    assert np.array_equal(got, exp), (r, n, np.argwhere(got != exp)[:4])
        assert released(prods), [registrations(w) for w in prods]
    finally:
        for w in conss + prods:
            w.shutdown()


# ---- tpu-inference's MLA latent cache (rpamla) ------------------------------------------------

MLA_BS = 32  # a multiple of the MLA kernel's 32 tokens per packed row (MLA_KV_PACKING_SIZE)


def mla_geometry(dtype, tp):
    from tpu_sync.vllm.compat import MLA_ORDER, KvGeometry

    return KvGeometry(model="mla-test", num_layers=LAYERS, num_kv_heads=1, heads_per_rank=1, head_dim=576,
                      dtype=dtype, block_size=MLA_BS, tp=tp, block_format=f"vllm-tpu/{MLA_ORDER}/{dtype}",
                      use_mla=True, kv_order=MLA_ORDER)


def mla_runner(dtype, tp, caches, first_device):
    from test_jax_kv import mla_cache, replicated  # noqa: F401

    devs = devices_or_skip(8)[first_device:]
    return Runner([replicated(c, devs, tp, dtype) for c in caches])


def mla_caches(dtype, tokens, ids, seed, fill_seed):
    """Per layer the MLA cache ``[NB, MLA_BS / 32, 32, 640]`` (bit patterns): other requests'
    latents everywhere (``fill_seed``), the request's ``tokens`` (``seed``) at blocks ``ids``."""
    from test_jax_kv import mla_cache

    out = []
    for layer in range(LAYERS):
        fill = mla_cache(NB, MLA_BS, NB * MLA_BS, list(range(NB)), dtype, seed=fill_seed * 100 + layer)
        out.append(mla_cache(NB, MLA_BS, tokens, ids, dtype, seed=seed * 100 + layer, fill=fill) if tokens else fill)
    return out


def replicas_of(a):
    from test_jax_kv import replicas

    return replicas(a)


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
@pytest.mark.parametrize("dtype,src_tp,dst_tp", [("bf16", 4, 2), ("fp8", 2, 4)])
def test_pd_between_jax_runners_with_mla_caches(configs, dtype, src_tp, dst_tp, backend):
    """DeepSeek-style MLA (576 = 512 latent + 64 rope in 640 lanes) between two tpu-inference
    runners through the worker sides: every replica of the consumer's latent (one per TP rank)
    byte-exact, every other block and the producer unchanged."""
    tokens = 70  # 3 blocks of 32, the last one partial
    src_ids, dst_ids = [5, 9, 2], [11, 3, 7]
    gs, gd = mla_geometry(dtype, src_tp), mla_geometry(dtype, dst_tp)
    assert gs.layer_shape() == (MLA_BS, 640)
    src = mla_caches(dtype, tokens, src_ids, seed=3, fill_seed=11)
    dst = mla_caches(dtype, 0, dst_ids, seed=3, fill_seed=12)
    want = mla_caches(dtype, tokens, dst_ids, seed=3, fill_seed=12)
    pr, cr = mla_runner(dtype, src_tp, src, 0), mla_runner(dtype, dst_tp, dst, 4)
    prod = worker(configs, "kv_producer", gs, {"jax_backend": backend})
    cons = worker(configs, "kv_consumer", gd, {"jax_backend": backend})
    try:
        prod.register_runner(pr)
        cons.register_runner(cr)
        assert prod.jax_stats["mla"] and cons.jax_stats["tp"] == dst_tp
        peers = {r: prod.handshake().address for r in prod.handshake().tp_ranks}
        pr.forward()
        prod.start_load_kv(TpuSyncMetadata(sends=[SendSpec("p1", 95, src_ids, tokens, 60.0, dst_tp)]))
        assert prod.stats["registered"] == 1, prod.stats
        pr.forward()
        cr.forward()
        cons.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d1", 95, peers, gs.tpu_sync_layout(NB), src_ids, dst_ids,
                                                           tokens, 30.0)]))
        res = wait_pulled(cons, "d1")
        assert res.finished_recving == {"d1"} and not res.failed_recving, cons.stats
        for layer in range(LAYERS):
            reps = replicas_of(cr.kv_caches[layer])
            assert len(reps) == dst_tp
            for i, got in enumerate(reps):
                assert np.array_equal(got, want[layer]), (layer, i, np.argwhere(got != want[layer])[:4])
            assert not np.array_equal(want[layer], dst[layer])  # the pull changed something
            for got in replicas_of(pr.kv_caches[layer]):
                assert np.array_equal(got, src[layer]), f"layer {layer} of the producer"
    finally:
        cons.shutdown()
        prod.shutdown()


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
def test_host_tier_store_then_load_with_a_jax_mla_runner(configs, backend):
    g = mla_geometry("bf16", 2)
    kv = mla_caches("bf16", 3 * MLA_BS, [3, 4, 5], seed=21, fill_seed=22)
    r = mla_runner("bf16", 2, kv, 0)
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 64 << 20, "jax_backend": backend})
    try:
        w.register_runner(r)
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("o1", hashes, [3, 4, 5])]))
        assert w.stats["saved_blocks"] == 3, w.stats
        r.forward()
        w.start_load_kv(TpuSyncMetadata(loads=[TierOp("o1", hashes, [12, 13, 14])]))
        assert w.stats["loaded_blocks"] == 3 and w.stats["failed_loads"] == 0, w.stats
        for layer in range(LAYERS):
            want = kv[layer].copy()
            want[12:15] = want[3:6]
            for got in replicas_of(r.kv_caches[layer]):
                assert np.array_equal(got, want), layer
    finally:
        w.shutdown()


def test_an_mla_runner_for_a_model_that_is_not_mla_is_refused(configs):
    kv = mla_caches("bf16", 0, [], seed=1, fill_seed=2)
    w = worker(configs, "kv_both", geometry(8, 128, "bf16", 2), {"host_capacity_bytes": 16 << 20})
    try:
        with pytest.raises(ValueError, match="are an MLA latent cache, while the model's cache is rpa3"):
            w.register_runner(mla_runner("bf16", 2, kv, 0))
    finally:
        w.shutdown()


def test_geometry_of_an_mla_model_on_a_tpu(monkeypatch):
    """On a TPU platform an MLA model's geometry is tpu-inference's MLA cache (rpamla: one
    latent plane, one head, replicated over TP); a latent that is not a multiple of 128 lanes
    (its rope part would not follow it) is refused by name."""
    import types

    import torch
    from vllm.platforms import current_platform

    from tpu_sync.vllm import compat

    monkeypatch.setattr(type(current_platform), "device_type", "tpu", raising=False)

    def cfg(lora):
        mc = types.SimpleNamespace(
            model="deepseek-test", dtype=torch.bfloat16, use_mla=True,
            hf_text_config=types.SimpleNamespace(kv_lora_rank=lora),
            get_num_kv_heads=lambda pc: 1, get_head_size=lambda: lora + 64, get_num_layers=lambda pc: 61,
            get_total_num_kv_heads=lambda: 128)  # vLLM reports the config's heads (DeepSeek-V3: 128)
        return types.SimpleNamespace(model_config=mc, parallel_config=types.SimpleNamespace(tensor_parallel_size=4),
                                     cache_config=types.SimpleNamespace(cache_dtype="auto", block_size=64),
                                     attention_config=types.SimpleNamespace(backend=None))

    g = compat.kv_geometry(cfg(512))
    assert (g.kv_order, g.block_format, g.kv_planes, g.layer_shape()) == (
        "rpamla", "vllm-tpu/rpamla/bfloat16", 1, (64, 640)), g
    lay = g.tpu_sync_layout(8)
    assert lay["spec"]["order"] == "rpamla" and lay["model"]["num_kv_heads"] == 1 and lay["model"]["head_dim"] == 576
    assert "block_format" not in lay and g.mismatch(g.to_dict()) is None
    with pytest.raises(ValueError, match="kv_lora_rank 448"):
        compat.kv_geometry(cfg(448))
    # The tokens packed to a row depend on the engine (tpu-inference: MLA_KV_PACKING_SIZE, 32;
    # vLLM-TorchTPU: 32 / bits), so the geometry accepts a block size of 48 and the registration
    # of the caches decides (tpu_sync.jax_kv.JaxKv, test_jax_kv.py; the torch worker,
    # test_tpu_engine_layouts.py).
    c = cfg(512)
    c.cache_config.block_size = 48
    assert compat.kv_geometry(c).torch_mla_shape() == (24, 2, 640)


# ---- KV cache groups (sliding window + full attention) with a JAX runner ----------------------
# tpu-inference 0.32.0 ``runner/kv_cache_manager.py`` (``initialize_kv_cache``): per
# ``KVCacheTensor`` one array, shared by the layers at one position of every attention group
# ("legacy single-cache aliasing"), or one array per layer; ``runner.layer_name_to_kvcache_index``
# maps each layer name to its array's index in ``runner.kv_caches``.

WINDOW = 24  # 40 tokens: the window [17, 40) starts inside block 1; the sliding group holds 1..2


def group_geometry(heads, dim, dtype, tp):
    import dataclasses

    return dataclasses.replace(geometry(heads, dim, dtype, tp), groups=(
        dict(kind="attention", layers=[0], sliding_window=WINDOW), dict(kind="attention", layers=[1],
                                                                        sliding_window=None)))


def group_caches(g, tokens, held, seed, fill_seed):
    """Every TP rank's one array shared by both layers (bit patterns ``[NB, BS, R, P, D']``):
    other KV everywhere (``fill_seed``), then the sliding layer's (layer 0) tokens at the
    sliding group's ``held[0]`` (the request's last blocks) and the full layer's at ``held[1]``.
    Returns ``(per rank array, per rank [merged rows of layer 0, of layer 1])``."""
    np_t = DTYPES[g.dtype]
    packing = 4 // np.dtype(np_t).itemsize
    hd64 = g.kv_order == "rpa3hd64"
    out, rows = [], []
    nblocks = -(-tokens // BS)
    for r in range(g.tp):
        sl = slice(r * g.heads_per_rank, (r + 1) * g.heads_per_rank)
        fk, fv = logical_kv(7, NB * BS, g.num_kv_heads, g.head_dim, np_t, fill_seed)
        cache = merge_kv(fk[:, sl], fv[:, sl], packing, hd64).reshape((NB, BS) + g.layer_shape()[1:]).copy()
        merged = []
        for layer, ids in enumerate(held):
            k, v = logical_kv(layer, max(tokens, 1), g.num_kv_heads, g.head_dim, np_t, seed)
            m = merge_kv(k[:, sl], v[:, sl], packing, hd64)
            merged.append(m)
            first = nblocks - len(ids)
            for t in range(first * BS, tokens):
                cache[ids[t // BS - first], t % BS] = m[t]
        out.append(cache)
        rows.append(merged)
    return out, rows


class GroupRunner:
    """tpu-inference's runner around the arrays of a model with two KV cache groups: one array
    per TP-sharded ``KVCacheTensor``, shared by both layers (``shared``) or one per layer."""

    def __init__(self, g, per_rank, first_device, shared):
        from test_tpu_engine_layouts import NAMES

        devs = devices_or_skip(8)[first_device:first_device + g.tp]
        mesh = Mesh(np.array(devs).reshape(1, g.tp), ("data", "model"))
        sh = NamedSharding(mesh, P("data", None, "model"))
        arr = np.concatenate(per_rank, axis=2).view(JAX_DTYPE[g.dtype])
        self.kv_caches = [jax.device_put(arr, sh) for _ in range(1 if shared else 2)]
        self.layer_name_to_kvcache_index = {NAMES[1]: 0 if shared else 1, NAMES[0]: 0}
        self._step = jax.jit(lambda c: c, donate_argnums=0)

    def forward(self):
        self.kv_caches = [self._step(c) for c in self.kv_caches]


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-layer"])
def test_pd_between_jax_runners_with_kv_cache_groups(configs, backend, shared):
    """P/D TP=4 -> 2 between tpu-inference runners of a sliding-window + full-attention model
    (one array per rank shared by both layers, or one per layer): the decode's arrays get the
    full layer's 40 tokens at the full group's blocks and the sliding layer's window (tokens 17..39)
    at the sliding group's, byte-exact against ``merge_kv``; every other token slot and block
    (the other group's, in a shared array) unchanged; the producer unchanged."""
    tokens = 40
    held_src, held_dst = [[9, 2], [5, 9 + 3, 2 + 11]], [[3, 7], [11, 4, 13]]
    gs, gd = group_geometry(8, 128, "bf16", 4), group_geometry(8, 128, "bf16", 2)
    src, _ = group_caches(gs, tokens, held_src, seed=3, fill_seed=11)
    dst, _ = group_caches(gd, 0, [[], []], seed=3, fill_seed=12)
    _, rows = group_caches(gd, tokens, held_dst, seed=3, fill_seed=12)
    pr, cr = GroupRunner(gs, src, 0, shared), GroupRunner(gd, dst, 4, shared)
    before_src = [bits(a) for a in pr.kv_caches]
    prod = worker(configs, "kv_producer", gs, {"jax_backend": backend})
    cons = worker(configs, "kv_consumer", gd, {"jax_backend": backend})
    try:
        prod.register_runner(pr)
        cons.register_runner(cr)
        peers = {r: prod.handshake().address for r in prod.handshake().tp_ranks}
        pr.forward()
        prod.start_load_kv(TpuSyncMetadata(sends=[SendSpec("p1", 97, held_src, tokens, 60.0, 2)]))
        assert prod.stats["registered"] == 1, prod.stats
        pr.forward()
        cr.forward()
        cons.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d1", 97, peers, gs.tpu_sync_layout(NB), held_src,
                                                           held_dst, tokens, 30.0)]))
        res = wait_pulled(cons, "d1")
        assert res.finished_recving == {"d1"} and not res.failed_recving, cons.stats
        need = tokens + 1 - WINDOW
        for layer in range(2):
            exp = np.concatenate(dst, axis=2)
            for other in ((1 - layer,) if shared else ()):
                # A shared array also holds the other layer's blocks.
                ids, first = held_dst[other], -(-tokens // BS) - len(held_dst[other])
                for t in range(need if other == 0 else 0, tokens):
                    exp[ids[t // BS - first], t % BS] = np.concatenate([rows[r][other][t] for r in range(2)], axis=0)
            ids, first = held_dst[layer], -(-tokens // BS) - len(held_dst[layer])
            for t in range(need if layer == 0 else 0, tokens):
                exp[ids[t // BS - first], t % BS] = np.concatenate([rows[r][layer][t] for r in range(2)], axis=0)
            got = bits(cr.kv_caches[cr.layer_name_to_kvcache_index[sorted(cr.layer_name_to_kvcache_index)[layer]]])
            assert np.array_equal(got, exp), (layer, np.argwhere(got != exp)[:4])
        for a, b in zip(pr.kv_caches, before_src):
            assert np.array_equal(bits(a), b), "the producer changed"
    finally:
        cons.shutdown()
        prod.shutdown()


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
def test_host_tier_with_kv_cache_groups_in_a_jax_runner(configs, backend):
    """Host-tier store then load with both groups in one shared array per rank (TP=2): each
    group's blocks saved from, and loaded into, its own layer's blocks; the sliding group's
    null block skipped; every other block unchanged. A runner without
    ``layer_name_to_kvcache_index`` is refused by name."""
    g = group_geometry(8, 128, "bf16", 2)
    kv, _ = group_caches(g, 3 * BS, [[3, 4, 5], [6, 7, 8]], seed=21, fill_seed=22)
    r = GroupRunner(g, kv, 0, shared=True)
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 64 << 20, "jax_backend": backend})
    try:
        w.register_runner(r)
        orig = bits(r.kv_caches[0])
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        w.wait_for_save(TpuSyncMetadata(saves=[TierOp("o1", hashes, [6, 7, 8], None, [[3, 4, 5], [6, 7, 8]])]))
        assert w.stats["saved_blocks"] == 3, w.stats
        r.forward()
        w.start_load_kv(TpuSyncMetadata(lookups={"o1": hashes}))
        assert w.build_worker_meta().lookup_hits == {"o1": 3}
        w.start_load_kv(TpuSyncMetadata(loads=[TierOp("o1", hashes, [12, 13, 14], None, [[0, 10, 11], [12, 13, 14]])]))
        assert w.stats["loaded_blocks"] == 3 and w.stats["failed_loads"] == 0, w.stats
        want = orig.copy()
        for s, d in ((4, 10), (5, 11), (6, 12), (7, 13), (8, 14)):
            want[d] = orig[s]
        got = bits(r.kv_caches[0])
        assert np.array_equal(got, want), np.argwhere(got != want)[:4]
    finally:
        w.shutdown()
    bare = GroupRunner(g, kv, 0, shared=True)
    del bare.layer_name_to_kvcache_index
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 16 << 20})
    try:
        with pytest.raises(ValueError, match="layer_name_to_kvcache_index"):
            w.register_runner(bare)
    finally:
        w.shutdown()


def test_a_data_parallel_runner_is_refused_by_the_connector(configs):
    """tpu-inference with DP > 1 (``data`` axis on the blocks): JaxKv maps the shards, but the
    DP scheduler passes on none of this connector's metadata and no handshake, so the worker
    refuses it at ``register_runner``, naming why (docs/tpu.md)."""
    g = geometry(8, 128, "bf16", 2)
    devs = devices_or_skip(8)
    mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("data", "model"))
    rows, packing, lanes = g.layer_shape()[1:]
    a = jax.device_put(np.zeros((2 * NB, BS, rows * 2, packing, lanes), JAX_DTYPE["bf16"]),
                       NamedSharding(mesh, P("data", None, "model")))
    r = Runner([a, a + 0])
    w = worker(configs, "kv_both", g, {"host_capacity_bytes": 16 << 20})
    try:
        with pytest.raises(NotImplementedError, match=r"data axis \(DP=2\).*DP scheduler"):
            w.register_runner(r)
    finally:
        w.shutdown()
