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
every other block and the producer's caches unchanged. Under tpu-inference's DP scheduler (the
``data`` axis on the blocks): its merge of the ranks' connector metadata restated, around the
connector's scheduler sides and around vLLM's own ``Scheduler`` per DP rank.
"""

import os
import pickle
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Read when JAX creates its CPU client (its first use, after collection).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
vllm = pytest.importorskip("vllm")
jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from test_connector import (FakeManager, blocks, configs, connector, request, sched_out, tokens,  # noqa: E402,F401
                            vllm_config)
from test_tpu_engine_layouts import geometry, worker  # noqa: E402
from tpu_sync.jax_kv import JaxKv  # noqa: E402
from tpu_sync.vllm.compat import PAIR_KEY, pair_params  # noqa: E402
from tpu_sync.vllm.config import ConnectorConfig  # noqa: E402
from tpu_sync.vllm.metadata import RecvSpec, SendSpec, TierOp, TpuSyncMetadata  # noqa: E402
from tpu_sync.vllm.worker import WorkerSide  # noqa: E402

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
    bs = g.block_size
    out = []
    for r in range(g.tp):
        sl = slice(r * g.heads_per_rank, (r + 1) * g.heads_per_rank)
        per = []
        for layer in range(LAYERS):
            fk, fv = logical_kv(layer, NB * bs, g.num_kv_heads, g.head_dim, np_t, fill_seed)
            cache = merge_kv(fk[:, sl], fv[:, sl], packing, hd64).reshape((NB, bs) + g.layer_shape()[1:]).copy()
            if tokens:
                k, v = logical_kv(layer, tokens, g.num_kv_heads, g.head_dim, np_t, seed)
                m = merge_kv(k[:, sl], v[:, sl], packing, hd64)
                for t in range(tokens):
                    cache[ids[t // bs], t % bs] = m[t]
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


def pull_groups(cons, req, xfer, peers, src_layout, held_src, held_dst, tokens):
    """The consumer worker pulls transfer ``xfer`` (request ``req``) from the producer's blocks
    ``held_src`` into ``held_dst`` (one list per KV cache group); asserts it succeeded."""
    cons.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec(req, xfer, peers, src_layout, held_src, held_dst, tokens,
                                                       30.0)]))
    res = wait_pulled(cons, req)
    assert res.finished_recving == {req} and not res.failed_recving, cons.stats


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
        pull_groups(cons, "d1", 97, peers, gs.tpu_sync_layout(NB), held_src, held_dst, tokens)
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


# ---- tpu-inference's DP scheduler (the mesh's data axis on the blocks, DP > 1) -----------------
# tpu-inference 0.32.0 ``core/sched/dp_scheduler.py``: one vLLM scheduler per DP rank (its own
# process, its own connector scheduler side) over ``num_blocks / DP`` rank-local blocks. Each
# step it merges the ranks' connector metadata into ``type(meta)()``, keeping only the field
# ``requests_meta`` (and ``reqs_to_send`` / ``reqs_to_load``) and adding ``rank *
# num_blocks_per_rank`` to each entry's non-empty ``local_block_ids`` (and ``save_spec.src_blocks``,
# ``load_spec.dst_blocks``); every rank's scheduler then gets the whole ``KVConnectorOutput``
# (``_split_model_output_by_rank``: ``kv_connector_output=g.kv_connector_output``), each its own
# pickled copy; its ``get_kv_connector()`` is None, so no rank gets the workers' handshake. The
# stand-in below restates that merge; the schedulers are the connector's real scheduler sides,
# the worker its real worker side over a JAX runner on 8 CPU devices.

DP = 2


def dp_merge(metas, num_blocks_per_rank):
    """``DPScheduler._combine_scheduler_outputs``' merge of the ranks' connector metadata (each
    first pickled, as it crosses from the rank's process)."""
    combined = None
    for rank, meta in enumerate(pickle.loads(pickle.dumps(m)) for m in metas):
        if meta is None:
            continue
        if combined is None:
            combined = type(meta)()
        if hasattr(meta, "requests_meta"):
            off = rank * num_blocks_per_rank
            for rm in meta.requests_meta:
                if getattr(rm, "local_block_ids", None):
                    rm.local_block_ids = [b + off for b in rm.local_block_ids]
                for spec, attr in (("save_spec", "src_blocks"), ("load_spec", "dst_blocks")):
                    sp = getattr(rm, spec, None)
                    if sp is not None and getattr(sp, attr, None):
                        setattr(sp, attr, [b + off for b in getattr(sp, attr)])
            combined.requests_meta.extend(meta.requests_meta)
        if hasattr(meta, "reqs_to_send"):
            combined.reqs_to_send.update(meta.reqs_to_send)
        if hasattr(meta, "reqs_to_load"):
            combined.reqs_to_load.update(meta.reqs_to_load)
    return combined


def dp_vllm_config(configs, role, dp):
    """What the connector reads of tpu-inference's config: vLLM's, and its platform's
    ``sharding_config.total_dp_size``."""
    return SimpleNamespace(**{k: getattr(configs[role], k) for k in ("kv_transfer_config", "model_config",
                                                                      "parallel_config", "cache_config")},
                           sharding_config=SimpleNamespace(total_dp_size=dp))


def worker_step(w, runner, meta, finished):
    """One engine step of the worker side ``w`` around ``runner``'s forward, as vLLM's model
    runner calls the connector's hooks; returns the step's ``KVConnectorOutput``."""
    from vllm.v1.outputs import KVConnectorOutput

    w.bind(meta)
    w.handle_preemptions(meta)
    w.start_load_kv(meta)
    runner.forward()
    w.wait_for_save(meta)
    res = w.get_transfer_results(finished)
    return KVConnectorOutput(finished_sending=res.finished_sending or None,
                             finished_recving=res.finished_recving or None, failed_recving=res.failed_recving,
                             invalid_block_ids=w.get_block_ids_with_load_errors(),
                             kv_connector_worker_meta=w.build_worker_meta())


class DpEngine:
    """One engine under tpu-inference's DP scheduler: a connector scheduler side per DP rank,
    one worker side over the runner (every replica and TP rank in this process)."""

    def __init__(self, configs, role, g, runner, extra):
        from vllm.v1.kv_cache_interface import KVCacheConfig

        from tpu_sync.vllm.config import ConnectorConfig
        from tpu_sync.vllm.scheduler import SchedulerSide

        vc = dp_vllm_config(configs, role, DP)
        cfg = ConnectorConfig.parse(role, extra)
        self.ranks = [SchedulerSide(vc, KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[]), cfg, g)
                      for _ in range(DP)]
        for s in self.ranks:
            s.kv_cache_manager = FakeManager()
        from tpu_sync.vllm.worker import WorkerSide

        self.worker = WorkerSide(vc, cfg, g)
        self.runner = runner
        self.worker.register_runner(runner)

    def step(self, scheduled=None, finished=()):
        """One engine step: every rank's metadata (``scheduled[rank]``: request -> tokens this
        step), merged, through the worker's hooks around a forward; every rank's scheduler side
        takes its own copy of the output. Returns those copies, by rank."""
        scheduled = scheduled or {}
        metas = [s.build_connector_meta(sched_out(scheduled.get(r, {}))) for r, s in enumerate(self.ranks)]
        assert all(m.requests_meta or not any(vars(m).values()) for m in metas), "DP metadata outside requests_meta"
        out = worker_step(self.worker, self.runner, dp_merge(metas, NB), set(finished))
        copies = [pickle.loads(pickle.dumps(out)) for _ in self.ranks]
        for s, o in zip(self.ranks, copies):
            s.update_connector_output(o)
        return copies

    def shutdown(self):
        self.worker.shutdown()


def dp_caches(g, reqs, fill_seed):
    """Every replica's per-rank caches: replica ``d`` filled with other KV (seed ``fill_seed +
    d``), then each request ``(d, tokens, local ids, seed)`` of that replica written there."""
    out = []
    for d in range(DP):
        per = rank_caches(g, 0, [], seed=0, fill_seed=fill_seed + d)
        for rd, tokens, ids, seed in reqs:
            if rd == d:
                req = rank_caches(g, tokens, ids, seed=seed, fill_seed=fill_seed + d)
                for r in range(g.tp):
                    for layer in range(LAYERS):
                        for b in ids:
                            per[r][layer][b] = req[r][layer][b]
        out.append(per)
    return out


def dp_runner(g, reps, first_device):
    devs = devices_or_skip(8)[first_device:first_device + DP * g.tp]
    mesh = Mesh(np.array(devs).reshape(DP, g.tp), ("data", "model"))
    sh = NamedSharding(mesh, P("data", None, "model"))
    return Runner([jax.device_put(dp_glob(reps, layer).view(JAX_DTYPE[g.dtype]), sh) for layer in range(LAYERS)])


def dp_glob(reps, layer):
    return np.concatenate([glob(rep, layer) for rep in reps], axis=0)


def prefill_and_hand_off(prod, p_ids, reqs, finish):
    """The producer side of the DP P/D tests: each request ``(rid, tokens)`` on its rank
    (``p_ids[rid]``: rank, vLLM's block ids) prefilled in one step (registered there,
    ``early_register``), then finished by ``finish(scheduler side, request, ids)`` (vLLM's
    ``request_finished`` or its all-groups form). Returns each request's params: they describe
    (no block ids: a DP rank does not know its offset)."""
    from vllm.v1.request import RequestStatus

    made = {}
    for rid, n in reqs:
        rank, ids = p_ids[rid]
        s = prod.ranks[rank]
        r = request(rid, tokens(n, seed=len(rid) + n), {"do_remote_decode": True}, max_tokens=1)
        s.on_new_request(r)
        s.kv_cache_manager.ids[rid] = ids
        made[rid] = r
    prod.step({p_ids[rid][0]: {rid: n} for rid, n in reqs})
    assert prod.worker.stats["registered"] == len(reqs), prod.worker.stats
    params = {}
    for rid, n in reqs:
        r = made[rid]
        r.num_computed_tokens, r.status = n, RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params[rid] = finish(prod.ranks[p_ids[rid][0]], r, p_ids[rid][1])
        assert delay is True
        assert "remote_block_ids" not in params[rid] and params[rid]["remote_describe"] is True
    return params


def pull_on_consumer_ranks(cons, d_ids, params, reqs, blocks_of):
    """The consumer side of the DP P/D tests: each request ``(did, pid, tokens)`` on its rank
    (``d_ids[did]``: rank, vLLM's block ids), its params as the proxy passes them on (the
    producer's ``params[pid]``), answered asynchronously, its blocks allocated
    (``blocks_of(ids)``: ``KVCacheBlocks``); then steps until each rank saw its own requests
    in ``finished_recving``, none failed."""
    cons.step()
    for did, pid, n in reqs:
        rank, ids = d_ids[did]
        s = cons.ranks[rank]
        r = request(did, tokens(n, seed=len(pid) + n), dict(params[pid]))
        s.on_new_request(r)
        assert s.get_num_new_matched_tokens(r, 0) == (n, True)
        s.update_state_after_alloc(r, blocks_of(ids), n)
    want = [{did for did, *_ in reqs if d_ids[did][0] == rank} for rank in range(DP)]
    deadline, done = time.monotonic() + 60, [set() for _ in range(DP)]
    while time.monotonic() < deadline and done != want:
        outs = cons.step()
        for rank, o in enumerate(outs):
            done[rank] |= set(o.finished_recving or ())
            assert not o.failed_recving and not o.invalid_block_ids, (o, cons.worker.stats)
        time.sleep(0.01)
    assert done == want, (done, cons.worker.stats)


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
def test_pd_under_tpu_inferences_dp_scheduler(configs, backend):
    """P/D between two engines under tpu-inference's DP scheduler (producer DP=2 x TP=2,
    consumer DP=2 x TP=1): each rank's scheduler learns the workers' endpoint from their report
    (no start-up handshake reaches it), the producer's params name no blocks (a rank does not
    know its offset; the consumer asks the endpoint), block ids reach the workers through the
    DP scheduler's merge only; two requests cross replicas (producer replica 1 -> consumer
    replica 0 and 0 -> 1) byte-exact, every other block of every replica unchanged; each rank's
    scheduler sees only its own requests in the finished sets (vLLM's asserts it knows them)."""
    gs, gd = geometry(8, 128, "bf16", 2), geometry(8, 128, "bf16", 1)
    t1, t2 = 40, 23  # 3 blocks and 2, the last ones partial
    p_ids = {"p1": (1, [5, 9, 2]), "p2": (0, [7, 1])}  # (producer DP rank, rank-local blocks)
    d_ids = {"d1": (0, [11, 3, 7]), "d2": (1, [4, 14])}
    src_reps = dp_caches(gs, [(1, t1, p_ids["p1"][1], 31), (0, t2, p_ids["p2"][1], 32)], fill_seed=40)
    dst_reps = dp_caches(gd, [], fill_seed=50)
    want = dp_caches(gd, [(0, t1, d_ids["d1"][1], 31), (1, t2, d_ids["d2"][1], 32)], fill_seed=50)
    extra = {"jax_backend": backend}
    prod = DpEngine(configs, "kv_producer", gs, dp_runner(gs, src_reps, 0), extra)
    cons = DpEngine(configs, "kv_consumer", gd, dp_runner(gd, dst_reps, 4), extra)
    try:
        assert prod.worker.jax_stats["dp"] == DP and prod.worker.caches.num_blocks == DP * NB
        # The first step: every rank asks for the handshake and gets it from the report.
        assert all(not s.peers for s in prod.ranks)
        prod.step()
        addr = prod.worker.handshake().address
        assert all(s.peers == {r: addr for r in range(DP * gs.tp)} for s in prod.ranks), prod.ranks[0].peers
        assert prod.step()[0].kv_connector_worker_meta is None  # asked once
        # The prefills: each request on its rank, registered in the step that completes it
        # (early_register, the default), then handed off by request_finished.
        params = prefill_and_hand_off(prod, p_ids, (("p1", t1), ("p2", t2)),
                                      lambda side, r, ids: side.request_finished(r, ids))
        outs = prod.step()
        # The handoffs are reported to every rank; each keeps its own request only.
        assert [set(o.finished_sending or ()) for o in outs] == [{"p2"}, {"p1"}], [o.finished_sending for o in outs]
        assert all(s.pending_sends() == 0 for s in prod.ranks)
        # The consumer: each request on its rank, its params as the proxy passes them on.
        pull_on_consumer_ranks(cons, d_ids, params, (("d1", "p1", t1), ("d2", "p2", t2)), blocks)
        assert cons.worker.stats["pulls_deferred"] == 2 and cons.worker.stats["pulls_failed"] == 0
        assert cons.ranks[0].stats["p2p_tokens"] == t1 and cons.ranks[1].stats["p2p_tokens"] == t2
        for layer in range(LAYERS):
            got, exp = bits(cons.runner.kv_caches[layer]), dp_glob(want, layer)
            assert np.array_equal(got, exp), (layer, sorted({int(i[0]) for i in np.argwhere(got != exp)}))
    finally:
        cons.shutdown()
        prod.shutdown()


def tier_request(rid, hashes, n):
    """What the scheduler side reads of a vLLM request with host-tier hashes."""
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_prompt_tokens=n, num_tokens=n,
                           num_computed_tokens=0, kv_transfer_params=None)


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
def test_host_tier_under_tpu_inferences_dp_scheduler(configs, monkeypatch, backend):
    """Offload under the DP scheduler (DP=2 x TP=2): a prompt saved from replica 1 is found by
    a request of rank 0 and loaded into replica 0 byte-exact (one tier entry holds a block of
    one replica's TP ranks), every other block unchanged; the load is asynchronous there and
    reported to rank 0 only; a load that fails is reported as failed_recving of its request,
    never as block ids (no rank's scheduler could read global ids)."""
    g = geometry(8, 128, "bf16", 2)
    bs, n = g.block_size, 3 * g.block_size + 5
    src, dst = [5, 9, 2], [12, 13, 6]
    reps = dp_caches(g, [(1, 3 * bs, src, 61)], fill_seed=70)
    eng = DpEngine(configs, "kv_both", g, dp_runner(g, reps, 0), {"host_capacity_bytes": 64 << 20,
                                                                     "jax_backend": backend})
    try:
        s0, s1 = eng.ranks
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        s1.on_new_request(tier_request("o1", hashes, n))
        s1.kv_cache_manager.ids["o1"] = src
        eng.step({1: {"o1": n}})  # the prefill: its full blocks saved
        assert eng.worker.stats["saved_blocks"] == 3, eng.worker.stats
        r2 = tier_request("o2", hashes, n)
        s0.on_new_request(r2)
        assert s0.get_num_new_matched_tokens(r2, 0) == (None, False)  # looked up in the next step
        eng.step()
        assert s0.get_num_new_matched_tokens(r2, 0) == (3 * bs, True)  # asynchronous under DP
        s0.update_state_after_alloc(r2, blocks(dst), 3 * bs)
        outs = eng.step()
        assert [set(o.finished_recving or ()) for o in outs] == [{"o2"}, set()], outs
        assert not outs[0].failed_recving and not outs[0].invalid_block_ids
        for layer in range(LAYERS):
            exp = dp_glob(reps, layer).copy()
            for s_b, d_b in zip(src, dst):
                exp[d_b] = exp[NB + s_b]  # replica 1's block into replica 0's
            got = bits(eng.runner.kv_caches[layer])
            assert np.array_equal(got, exp), (layer, sorted({int(i[0]) for i in np.argwhere(got != exp)}))
        # A load that fails (a tier error) names its request, on its rank only.
        r3 = tier_request("o3", hashes, n)
        s1.on_new_request(r3)
        s1.get_num_new_matched_tokens(r3, 0)
        eng.step()
        assert s1.get_num_new_matched_tokens(r3, 0) == (3 * bs, True)
        s1.update_state_after_alloc(r3, blocks([3, 4, 8]), 3 * bs)

        def broken(*a, **k):
            raise OSError("tier read failed")

        monkeypatch.setattr(eng.worker.tier, "get", broken)
        outs = eng.step()
        assert [set(o.finished_recving or ()) for o in outs] == [set(), {"o3"}], outs
        assert outs[1].failed_recving == {"o3"}
        assert outs[0].failed_recving == set() and not outs[1].invalid_block_ids
        assert s1.stats["failed_loads"] == 1
    finally:
        eng.shutdown()


# ---- KV cache groups under the DP scheduler ---------------------------------------------------


class GroupManager:
    """vLLM's KV cache manager as the scheduler side reads it: per request, one list of block
    ids per KV cache group (rank-local)."""

    def __init__(self):
        self.ids = {}

    def get_block_ids(self, rid):
        return tuple(list(g) for g in self.ids[rid])


def group_blocks(ids):
    """``KVCacheBlocks`` of one list per KV cache group."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(tuple(tuple(KVCacheBlock(block_id=i) for i in g) for g in ids))


class DpGroupRunner(GroupRunner):
    """:class:`GroupRunner` over DP replicas (the mesh's data axis on the blocks): one array
    shared by both layers, replica ``d``'s blocks ``d * NB ..``."""

    def __init__(self, g, reps, first_device):
        from test_tpu_engine_layouts import NAMES

        devs = devices_or_skip(8)[first_device:first_device + DP * g.tp]
        mesh = Mesh(np.array(devs).reshape(DP, g.tp), ("data", "model"))
        arr = dp_group_glob(reps).view(JAX_DTYPE[g.dtype])
        # XLA's own buffer (a device_put may alias host memory: test_jax_kv.Runner).
        self.kv_caches = [jnp.copy(jax.device_put(arr, NamedSharding(mesh, P("data", None, "model"))))]
        self.layer_name_to_kvcache_index = {NAMES[1]: 0, NAMES[0]: 0}
        self._step = jax.jit(lambda c: c, donate_argnums=0)


def dp_group_glob(reps):
    """The global array (bit patterns) of every replica's per-rank arrays."""
    return np.concatenate([np.concatenate(per, axis=2) for per in reps], axis=0)


def with_group_request(g, base, tokens, held, seed):
    """``base`` (one replica's per-rank arrays) with a request's KV written as a pull into a
    vLLM consumer leaves it: the full layer's tokens ``[0, tokens)`` at the full group's blocks
    ``held[1]``, the sliding layer's tokens the recomputed last token's window reads,
    ``[tokens - WINDOW, tokens)`` (of the held blocks), at ``held[0]``."""
    _, rows = group_caches(g, tokens, held, seed=seed, fill_seed=0)
    out = [a.copy() for a in base]
    nblocks = -(-tokens // BS)
    for layer, ids in enumerate(held):
        first = nblocks - len(ids)
        for t in range(max(first * BS, tokens - WINDOW if layer == 0 else 0), tokens):
            for r in range(g.tp):
                out[r][ids[t // BS - first], t % BS] = rows[r][layer][t]
    return out


def test_dp_form_carries_kv_cache_groups():
    """The DP form of ops with one block id list per KV cache group: through the DP
    scheduler's merge (rank 1's ids offset by ``NB``) each group's ids come back global, in
    their structure, vLLM's null block (0 on every rank, offset like any id by the merge) as
    0; a tier op's flat ``block_ids`` and ``group_block_ids`` both; a merge that offsets one
    op's ids unevenly is refused."""
    send = SendSpec("p1", 5, [[9, 2], [5, 12, 13]], 40, 60.0, 1)
    recv = RecvSpec("d1", 6, {0: "x"}, {}, None, [[3, 7], [11, 4, 13]], 40, 30.0)
    # A grouped tier op's flat ids are vLLM's first group's (here the sliding one's, a null first).
    load = TierOp("o1", [b"a" * 32, b"b" * 32], [0, 10], None, [[0, 10], [12, 13]], report=True)
    rank1 = TpuSyncMetadata(sends=[send], recvs=[recv], loads=[load]).to_dp_form()
    assert [e.local_block_ids for e in rank1.requests_meta] == [[0, 10, 0, 10, 12, 13], [9, 2, 5, 12, 13],
                                                               [3, 7, 11, 4, 13]]
    rank0 = TpuSyncMetadata(saves=[TierOp("o0", [b"c" * 32], [4], None, [[3], [4]])]).to_dp_form()
    out = dp_merge([rank0, rank1], NB).from_dp_form(DP)
    (save,) = out.saves
    assert save.block_ids == [4] and save.group_block_ids == [[3], [4]]
    (s,), (r,), (ld,) = out.sends, out.recvs, out.loads
    assert s.block_ids == [[9 + NB, 2 + NB], [5 + NB, 12 + NB, 13 + NB]] and s.num_tokens == 40
    assert r.dst_block_ids == [[3 + NB, 7 + NB], [11 + NB, 4 + NB, 13 + NB]] and r.src_block_ids is None
    assert ld.block_ids == [0, 10 + NB] and ld.group_block_ids == [[0, 10 + NB], [12 + NB, 13 + NB]]
    assert ld.report is True
    bad = dp_merge([None, TpuSyncMetadata(sends=[send]).to_dp_form()], NB)
    bad.requests_meta[0].local_block_ids[0] += 1
    with pytest.raises(ValueError, match="offset by"):
        bad.from_dp_form(DP)


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
def test_pd_with_kv_cache_groups_under_tpu_inferences_dp_scheduler(configs, backend):
    """P/D of a sliding-window + full-attention model between two engines under the DP
    scheduler (producer DP=2 x TP=2, consumer DP=2 x TP=1, one array per rank shared by both
    layers): each group's held blocks travel through the merge per group; two requests cross
    replicas (producer replica 1 -> consumer replica 0, 0 -> 1), each group's tokens land
    byte-exact at its own blocks (the sliding layer's window only), every other block of every
    replica unchanged, the producer unchanged; each rank sees only its own requests."""
    gs, gd = group_geometry(8, 128, "bf16", 2), group_geometry(8, 128, "bf16", 1)
    t1, t2 = 40, 23
    # (DP rank, vLLM's block ids per group: the sliding group's null block before its window)
    p_ids = {"p1": (1, [[0, 9, 2], [5, 12, 13]]), "p2": (0, [[6, 8], [10, 14]])}
    d_ids = {"d1": (0, [[0, 3, 7], [11, 4, 13]]), "d2": (1, [[2, 5], [9, 12]])}
    # Held: the sliding group's last 2 blocks (the window of the last token), the full group's all.
    held = {k: [ids[0][-2:], ids[1]] for k, (_, ids) in {**p_ids, **d_ids}.items()}
    src_reps = [group_caches(gs, t2, held["p2"], seed=32, fill_seed=40)[0],
                group_caches(gs, t1, held["p1"], seed=31, fill_seed=41)[0]]
    dst_reps = [group_caches(gd, 0, [[], []], seed=0, fill_seed=50 + d)[0] for d in range(DP)]
    want = [with_group_request(gd, dst_reps[0], t1, held["d1"], 31),
            with_group_request(gd, dst_reps[1], t2, held["d2"], 32)]
    extra = {"jax_backend": backend}
    prod = DpEngine(configs, "kv_producer", gs, DpGroupRunner(gs, src_reps, 0), extra)
    cons = DpEngine(configs, "kv_consumer", gd, DpGroupRunner(gd, dst_reps, 4), extra)
    for s in prod.ranks + cons.ranks:
        s.kv_cache_manager = GroupManager()
    src_before = bits(prod.runner.kv_caches[0])
    try:
        prod.step()
        params = prefill_and_hand_off(prod, p_ids, (("p1", t1), ("p2", t2)),
                                      lambda side, r, ids: side.request_finished_all_groups(r, tuple(ids)))
        outs = prod.step()
        assert [set(o.finished_sending or ()) for o in outs] == [{"p2"}, {"p1"}], [o.finished_sending for o in outs]
        pull_on_consumer_ranks(cons, d_ids, params, (("d1", "p1", t1), ("d2", "p2", t2)), group_blocks)
        assert cons.worker.stats["pulls_failed"] == 0, cons.worker.stats
        got, exp = bits(cons.runner.kv_caches[0]), dp_group_glob(want)
        assert np.array_equal(got, exp), str(sorted({tuple(int(x) for x in i[:2]) for i in np.argwhere(got != exp)}))
        assert np.array_equal(bits(prod.runner.kv_caches[0]), src_before), "the producer changed"
    finally:
        cons.shutdown()
        prod.shutdown()


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
def test_host_tier_with_kv_cache_groups_under_tpu_inferences_dp_scheduler(configs, backend):
    """Offload of a sliding-window + full-attention model under the DP scheduler (DP=2 x
    TP=2, one shared array per rank): a prompt saved from replica 0 is loaded by a request of
    rank 1 into replica 1, each group's blocks at its own blocks, the sliding group's null
    block skipped (offset by the merge to replica 1's block 0, which stays unchanged), every
    other block of both replicas unchanged; reported to rank 1 only."""
    g = group_geometry(8, 128, "bf16", 2)
    bs, n = g.block_size, 3 * g.block_size + 5
    reps = [group_caches(g, 3 * bs, [[3, 4, 5], [6, 7, 8]], seed=61, fill_seed=70 + d)[0] for d in range(DP)]
    eng = DpEngine(configs, "kv_both", g, DpGroupRunner(g, reps, 0), {"host_capacity_bytes": 64 << 20,
                                                                       "jax_backend": backend})
    for s in eng.ranks:
        s.kv_cache_manager = GroupManager()
    try:
        s0, s1 = eng.ranks
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        s0.on_new_request(tier_request("o1", hashes, n))
        s0.kv_cache_manager.ids["o1"] = [[3, 4, 5, 9], [6, 7, 8, 15]]
        eng.step({0: {"o1": n}})  # the prefill: its full blocks saved, every group's
        assert eng.worker.stats["saved_blocks"] == 3, eng.worker.stats
        orig = bits(eng.runner.kv_caches[0])
        r2 = tier_request("o2", hashes, n)
        s1.on_new_request(r2)
        assert s1.get_num_new_matched_tokens(r2, 0) == (None, False)
        eng.step()
        assert s1.get_num_new_matched_tokens(r2, 0) == (3 * bs, True)
        s1.update_state_after_alloc(r2, group_blocks([[0, 10, 11, 1], [12, 13, 14, 2]]), 3 * bs)
        outs = eng.step()
        assert [set(o.finished_recving or ()) for o in outs] == [set(), {"o2"}], outs
        assert not outs[1].failed_recving and not outs[1].invalid_block_ids
        assert eng.worker.stats["loaded_blocks"] == 3, eng.worker.stats
        want = orig.copy()
        for s_b, d_b in ((4, 10), (5, 11), (6, 12), (7, 13), (8, 14)):
            want[NB + d_b] = orig[s_b]  # replica 0's block into replica 1's
        got = bits(eng.runner.kv_caches[0])
        assert np.array_equal(got, want), sorted({int(i[0]) for i in np.argwhere(got != want)})
    finally:
        eng.shutdown()


class RealDpEngine:
    """tpu-inference's DP scheduler around vLLM's real ``Scheduler``, one per DP rank (each with
    its own connector, as each rank's process builds it), over the tiny model's geometry on a
    TPU platform (``rpa3``): each step schedules every rank, merges their metadata
    (:func:`dp_merge`), runs the worker's hooks around a forward, and gives every rank's
    ``update_from_output`` its requests' sampled tokens and its own copy of the whole
    ``KVConnectorOutput`` (``_split_model_output_by_rank``). vLLM's scheduler asserts it knows
    every request in the finished sets."""

    def __init__(self, tiny_model, role, runner_for, extra, dp=DP, policy=None, window=None):
        import torch
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                                SlidingWindowSpec)
        from vllm.v1.structured_output import StructuredOutputManager

        self.cfg = vllm_config(tiny_model, role, extra)
        if policy is not None:
            self.cfg.kv_transfer_config.kv_load_failure_policy = policy
        self.dp = dp
        self.cfg.sharding_config = SimpleNamespace(total_dp_size=dp)  # as tpu-inference's platform sets it
        self.cfg.cache_config.num_gpu_blocks = NB
        bs = self.cfg.cache_config.block_size
        attn = dict(block_size=bs, num_kv_heads=2, head_size=32, dtype=torch.float32)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        if window is None:
            groups = [KVCacheGroupSpec(names, FullAttentionSpec(**attn))]
        else:
            # A hybrid model: layer 0 sliding-window (group 0), layer 1 full attention (group 1),
            # as vLLM's hybrid KV cache manager groups them, one block pool for both.
            groups = [KVCacheGroupSpec(names[:1], SlidingWindowSpec(sliding_window=window, **attn)),
                      KVCacheGroupSpec(names[1:], FullAttentionSpec(**attn))]
        kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=groups)
        self.scheds = [Scheduler(self.cfg, kcc, StructuredOutputManager(self.cfg), block_size=bs) for _ in range(dp)]
        self.geometry = self.scheds[0].connector.geometry
        self.worker = WorkerSide(self.cfg, ConnectorConfig.parse(role, extra), self.geometry)
        self.runner = runner_for(self.geometry)
        self.worker.register_runner(self.runner)
        if dp == 1:
            # vLLM's own scheduler (tpu-inference uses it at DP 1): the start-up handshake.
            self.scheds[0].connector.set_xfer_handshake_metadata({0: self.worker.handshake()})
        self.tokens = {}
        #: every running request's block ids (rank-local), as last scheduled
        self.blocks_of = {}
        #: every request's block ids per KV cache group (rank-local), when it first ran
        self.group_blocks_of = {}
        #: the kv_transfer_params of finished requests (a producer's hand-offs)
        self.params = {}

    def step(self):
        from vllm.v1.outputs import ModelRunnerOutput

        outs = [s.schedule() for s in self.scheds]
        for s in self.scheds:
            for r in s.running:
                ids = s.kv_cache_manager.get_block_ids(r.request_id)
                self.blocks_of[r.request_id] = list(ids[0])
                self.group_blocks_of.setdefault(r.request_id, [list(g) for g in ids])
        meta = dp_merge([o.kv_connector_metadata for o in outs], NB) if self.dp > 1 else outs[0].kv_connector_metadata
        kv = worker_step(self.worker, self.runner, meta, set().union(*(o.finished_req_ids for o in outs)))
        for s, o in zip(self.scheds, outs):
            ids = list(o.num_scheduled_tokens)
            # A token for every request whose prompt is computed after this step.
            sampled = [[11] if s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens else []
                       for r in ids]
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=sampled, kv_connector_output=pickle.loads(pickle.dumps(kv)))
            for eo in s.update_from_output(o, mro).values():
                for out in eo.outputs:
                    self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.kv_transfer_params:
                        self.params[out.request_id] = out.kv_transfer_params
        return outs

    def run_until(self, done, limit=400):
        for _ in range(limit):
            self.step()
            if done():
                return
            time.sleep(0.005)
        raise AssertionError(f"not done after {limit} steps: {self.tokens}, {self.worker.stats}")

    def shutdown(self):
        self.worker.shutdown()


@pytest.fixture
def tpu_platform(monkeypatch):
    """The tiny model's geometry as on a TPU (``rpa3``, compat.kv_geometry)."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "device_type", "tpu", raising=False)


def engine_runner(dp, fill_seed, first_device):
    """A DP x TP=1 runner (the tiny model's geometry) for :class:`RealDpEngine`."""
    def make(g):
        reps = dp_caches(g, [], fill_seed=fill_seed)
        return dp_runner(g, reps, first_device) if dp > 1 else runner(g, reps[0], first_device)
    return make


@pytest.mark.parametrize("prod_dp,cons_dp,backend", [
    (2, 2, "auto"), (2, 2, "framework-copy"), (1, 2, "auto"), (2, 1, "framework-copy")])
def test_pd_with_vllms_schedulers_under_the_dp_scheduler(tiny_model, tpu_platform, prod_dp, cons_dp, backend):
    """vLLM's own scheduler per DP rank on either side (DP=2 x TP=1, or one plain vLLM
    scheduler at DP 1): prompts prefilled on the producer's ranks are handed off (under DP their
    params name no blocks), pulled on the consumer's ranks (crossing replicas) and run to their
    tokens; vLLM's asserts on the finished sets hold (each rank sees only its own requests);
    each request's KV lands byte-exact in the blocks the consumer's vLLM allocated in its rank's
    replica, read from the blocks the producer's vLLM allocated in its own; every other block
    unchanged. One request has a local prefix hit of 2 blocks on the consumer (a prompt
    sharing its first 64 tokens ran there first): only the tokens past it are pulled, into
    its own blocks; the shared ones are untouched."""
    extra = {"jax_backend": backend}
    prod = RealDpEngine(tiny_model, "kv_producer", engine_runner(prod_dp, 90, 0), extra, dp=prod_dp)
    cons = RealDpEngine(tiny_model, "kv_consumer", engine_runner(cons_dp, 80, 4), extra, dp=cons_dp)
    g = cons.geometry
    bs = g.block_size
    try:
        def before(dp, seed):
            return [dp_glob(dp_caches(g, [], fill_seed=seed)[:dp], layer) for layer in range(LAYERS)]

        src_before, dst_before = before(prod_dp, 90), before(cons_dp, 80)
        # (request, tokens, producer rank, consumer rank): tpu-inference routes each to a rank.
        reqs = [("r1", 70, 1 % prod_dp, 0), ("r2", 41, 0, 1 % cons_dp), ("r3", 100, 1 % prod_dp, 1 % cons_dp)]
        prompts = {rid: tokens(n, seed=n) for rid, n, *_ in reqs}
        for rid, n, pr, _ in reqs:
            prod.scheds[pr].add_request(request(rid, prompts[rid], {"do_remote_decode": True}, max_tokens=1))
        prod.run_until(lambda: all(rid in prod.params for rid, *_ in reqs))
        assert prod.worker.stats["registered"] == 3, prod.worker.stats
        for rid, *_ in reqs:
            assert (prod.params[rid].get("remote_describe") is True) == (prod_dp > 1), prod.params[rid]
        # r3's first two blocks computed on its consumer rank by an earlier request.
        cons.scheds[1 % cons_dp].add_request(request("warm", prompts["r3"][:2 * bs] + tokens(9, seed=5), max_tokens=1))
        cons.run_until(lambda: len(cons.tokens.get("warm", ())) == 1)
        for rid, n, _, cr in reqs:
            cons.scheds[cr].add_request(request(rid, prompts[rid], dict(prod.params[rid]), max_tokens=2))
        cons.run_until(lambda: all(len(cons.tokens.get(rid, ())) == 2 for rid, *_ in reqs))
        # Both at once (a router sends the prompt to both sides; compat.pair_params from an
        # earlier answer of the producer): the consumer waits for the producer's registration.
        nonce = "pair-nonce-r4"
        reqs.append(("r4", 50, 0, cons_dp - 1))
        prompts["r4"] = tokens(50, seed=50)
        prod.scheds[0].add_request(request("r4", prompts["r4"], {"do_remote_decode": True, PAIR_KEY: nonce},
                                           max_tokens=1))
        cons.scheds[cons_dp - 1].add_request(request("r4", prompts["r4"], pair_params(prod.params["r1"], nonce),
                                                      max_tokens=2))
        for _ in range(400):
            cons.step()
            prod.step()
            if len(cons.tokens.get("r4", ())) == 2:
                break
        assert cons.worker.stats["pulls_done"] == 4 and cons.worker.stats["pulls_failed"] == 0, cons.worker.stats
        assert cons.worker.stats["pulls_deferred"] == 1 + 3 * (prod_dp > 1)  # described by the producer
        sides = [s.connector.scheduler_side for s in cons.scheds]
        assert sum(s.stats["p2p_tokens"] for s in sides) == 70 + 41 + 100 - 2 * bs + 50
        assert sum(s.stats["p2p_partial"] for s in sides) == 1
        assert cons.blocks_of["r3"][:2] == cons.blocks_of["warm"][:2]
        # The producer frees the blocks once the consumers released them (reported to their rank).
        prod.run_until(lambda: not any(s.requests for s in prod.scheds))
        for layer in range(LAYERS):
            got = bits(cons.runner.kv_caches[layer])
            exp = dst_before[layer].copy()
            for rid, n, pr, cr in reqs:
                src, dst = prod.blocks_of[rid], cons.blocks_of[rid]
                for t in range(2 * bs if rid == "r3" else 0, n):
                    exp[cr * NB + dst[t // bs], t % bs] = src_before[layer][pr * NB + src[t // bs], t % bs]
            assert np.array_equal(got, exp), (layer, sorted({int(i[0]) for i in np.argwhere(got != exp)}))
            assert np.array_equal(bits(prod.runner.kv_caches[layer]), src_before[layer])
    finally:
        cons.shutdown()
        prod.shutdown()


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
def test_pd_with_kv_cache_groups_and_vllms_schedulers_under_the_dp_scheduler(tiny_model, tpu_platform, backend):
    """A hybrid model (layer 0 sliding-window, 40 tokens; layer 1 full attention; one array per
    replica shared by both, as the TPU engines bind them) with vLLM's own Scheduler per DP rank
    and its hybrid KV cache manager on both sides (DP=2 x TP=1): prompts prefilled on one
    producer rank are handed off (each group's held blocks, the sliding group's blocks before
    the window already vLLM's null block) and pulled on the other consumer rank, run to their
    tokens; the full layer's tokens land at the full group's blocks and the sliding layer's
    window at the sliding group's, byte-exact, every other block of both replicas unchanged."""
    window = 40
    extra = {"jax_backend": backend}

    def group_runner(fill_seed, first_device):
        def make(g):
            # One array per rank for both layers: layer 0's other KV as its content.
            reps = [[per[r][0] for r in range(g.tp)] for per in dp_caches(g, [], fill_seed=fill_seed)]
            return DpGroupRunner(g, reps, first_device)
        return make

    prod = RealDpEngine(tiny_model, "kv_producer", group_runner(90, 0), extra, window=window)
    cons = RealDpEngine(tiny_model, "kv_consumer", group_runner(80, 2), extra, window=window)
    g = cons.geometry
    assert [grp.get("sliding_window") for grp in g.groups] == [window, None], g.groups
    bs = g.block_size
    src_before, dst_before = bits(prod.runner.kv_caches[0]), bits(cons.runner.kv_caches[0])
    try:
        # (request, tokens, producer rank, consumer rank); r2's window starts in its block 1.
        reqs = [("r1", 70, 1, 0), ("r2", 100, 0, 1)]
        prompts = {rid: tokens(n, seed=n) for rid, n, *_ in reqs}
        for rid, n, pr, _ in reqs:
            prod.scheds[pr].add_request(request(rid, prompts[rid], {"do_remote_decode": True}, max_tokens=1))
        prod.run_until(lambda: all(rid in prod.params for rid, *_ in reqs))
        assert prod.worker.stats["registered"] == 2, prod.worker.stats
        for rid, n, _, cr in reqs:
            assert prod.params[rid]["remote_describe"] is True
            cons.scheds[cr].add_request(request(rid, prompts[rid], dict(prod.params[rid]), max_tokens=2))
        cons.run_until(lambda: all(len(cons.tokens.get(rid, ())) == 2 for rid, *_ in reqs))
        assert cons.worker.stats["pulls_done"] == 2 and cons.worker.stats["pulls_failed"] == 0, cons.worker.stats
        prod.run_until(lambda: not any(s.requests for s in prod.scheds))
        exp = dst_before.copy()
        for rid, n, pr, cr in reqs:
            src, dst = prod.group_blocks_of[rid], cons.group_blocks_of[rid]
            # The sliding layer: the window of token n - 1, which vLLM recomputes after the load.
            for layer, first in ((0, max(0, n - window)), (1, 0)):
                for t in range(first, n):
                    exp[cr * NB + dst[layer][t // bs], t % bs] = src_before[pr * NB + src[layer][t // bs], t % bs]
        got = bits(cons.runner.kv_caches[0])
        assert np.array_equal(got, exp), str(sorted({tuple(int(x) for x in i[:2]) for i in np.argwhere(got != exp)}))
        assert np.array_equal(bits(prod.runner.kv_caches[0]), src_before)
    finally:
        cons.shutdown()
        prod.shutdown()


@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
def test_host_tier_with_vllms_schedulers_under_the_dp_scheduler(tiny_model, tpu_platform, backend):
    """vLLM's own scheduler per DP rank (DP=2 x TP=1), offload: a prompt computed on rank 1 is
    saved (its blocks freed only once the save is reported, to rank 1 alone), then the same
    prompt on rank 0 hits the host tier, loads asynchronously into replica 0 and runs to its
    tokens; its blocks hold replica 1's bytes, every other block unchanged."""
    extra = {"jax_backend": backend, "host_capacity_bytes": 32 << 20}
    eng = RealDpEngine(tiny_model, "kv_both", lambda g: dp_runner(g, dp_caches(g, [], fill_seed=100), 0), extra)
    g = eng.geometry
    try:
        bs, n = g.block_size, 3 * g.block_size + 5
        before = [dp_glob(dp_caches(g, [], fill_seed=100), layer) for layer in range(LAYERS)]
        prompt = tokens(n, seed=7)
        eng.scheds[1].add_request(request("a", prompt, max_tokens=2))
        eng.run_until(lambda: len(eng.tokens.get("a", ())) == 2 and not eng.scheds[1].requests)
        assert eng.worker.stats["saved_blocks"] == 3, eng.worker.stats
        eng.scheds[0].add_request(request("b", prompt, max_tokens=2))
        eng.run_until(lambda: len(eng.tokens.get("b", ())) == 2)
        assert eng.worker.stats["loaded_blocks"] == 3 and eng.worker.stats["failed_loads"] == 0, eng.worker.stats
        side0 = eng.scheds[0].connector.scheduler_side
        assert side0.stats["host_hit_tokens"] == 3 * bs
        a, b = eng.blocks_of["a"], eng.blocks_of["b"]
        for layer in range(LAYERS):
            exp = before[layer].copy()
            for i in range(3):
                exp[b[i]] = before[layer][NB + a[i]]  # replica 1's block into replica 0's
            got = bits(eng.runner.kv_caches[layer])
            assert np.array_equal(got, exp), (layer, sorted({int(i[0]) for i in np.argwhere(got != exp)}))
    finally:
        eng.shutdown()


def test_a_request_finished_while_its_load_is_pending_under_dp(configs):
    """Under the DP scheduler a request with host-tier saves, preempted and readmitted with an
    asynchronous load of its own saved blocks, then finished (aborted) before that step's
    output: vLLM frees it when the load is reported (``finished_recving``), so the workers'
    report of its saves never names it afterwards (vLLM asserts it knows every request there)
    and the rank holds no block free pending (``has_pending_block_frees`` would otherwise stop
    preemption on that rank for good)."""
    g = geometry(8, 128, "bf16", 2)
    bs, n = g.block_size, 3 * g.block_size + 5
    reps = dp_caches(g, [(1, 3 * bs, [5, 9, 2], 61)], fill_seed=70)
    eng = DpEngine(configs, "kv_both", g, dp_runner(g, reps, 0), {"host_capacity_bytes": 64 << 20})
    try:
        s1 = eng.ranks[1]
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        r1 = tier_request("o1", hashes, n)
        s1.on_new_request(r1)
        s1.kv_cache_manager.ids["o1"] = [5, 9, 2]
        eng.step({1: {"o1": n}})  # its prefill: saves planned
        assert eng.worker.stats["saved_blocks"] == 3
        # Preempted (that step waited for its saves), readmitted: a hit of its own blocks.
        assert s1.get_num_new_matched_tokens(r1, 0) == (None, False)
        eng.step()
        assert s1.get_num_new_matched_tokens(r1, 0) == (3 * bs, True)
        s1.update_state_after_alloc(r1, blocks([3, 4, 8]), 3 * bs)
        # The step that loads it; the request is aborted before vLLM reads that step's output.
        out = worker_step(eng.worker, eng.runner, dp_merge([s.build_connector_meta(sched_out({})) for s in eng.ranks],
                                                           NB), set())
        s1.request_finished(r1, [3, 4, 8])
        seen = []
        for s, o in zip(eng.ranks, [pickle.loads(pickle.dumps(out)) for _ in eng.ranks]):
            s.update_connector_output(o)
            seen.append(o)
        assert seen[1].finished_recving == {"o1"} and not seen[1].finished_sending
        seen += eng.step(finished={"o1"})
        for _ in range(3):
            seen += eng.step()
        # After the finished_recving that freed it, no report names the request again.
        assert not any("o1" in (o.finished_sending or ()) for o in seen), [o.finished_sending for o in seen]
        assert s1.pending_frees() == 0 and not s1._dp_own and not s1._dp_finished
    finally:
        eng.shutdown()


def test_a_failed_load_under_dp_is_not_tried_again(tiny_model, tpu_platform, monkeypatch):
    """vLLM's own Scheduler per DP rank, ``kv_load_failure_policy="recompute"``: a prompt
    whose host-tier entry cannot be read (the tier's reads fail) is loaded once, reported as
    ``failed_recving``, returned by vLLM to the waiting queue and then computed locally to its
    tokens, instead of the same failing load answered again at every step."""
    eng = RealDpEngine(tiny_model, "kv_both", engine_runner(DP, 100, 0), {"host_capacity_bytes": 32 << 20},
                       policy="recompute")
    try:
        prompt = tokens(3 * eng.geometry.block_size + 5, seed=7)
        eng.scheds[1].add_request(request("a", prompt, max_tokens=2))
        eng.run_until(lambda: len(eng.tokens.get("a", ())) == 2 and not eng.scheds[1].requests)
        assert eng.worker.stats["saved_blocks"] == 3, eng.worker.stats

        def broken(*a, **k):
            raise OSError("tier entry unreadable")

        monkeypatch.setattr(eng.worker.tier, "get", broken)
        eng.scheds[0].add_request(request("b", prompt, max_tokens=2))
        eng.run_until(lambda: len(eng.tokens.get("b", ())) == 2, limit=60)
        assert eng.worker.stats["failed_loads"] == 1, eng.worker.stats
        assert eng.tokens["b"] == eng.tokens["a"]
    finally:
        eng.shutdown()


def test_described_params_are_pulled_whole_by_a_layerwise_consumer(configs):
    """Params of a producer under the DP scheduler name no blocks (``remote_describe``): a
    layer-wise consumer (DP 1) cannot read them within the step that computes the request, so
    it answers asynchronously and pulls the request whole, as for a both-at-once request."""
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import RequestStatus

    from tpu_sync.vllm.metadata import TpuSyncHandshake
    from tpu_sync.vllm.scheduler import SchedulerSide

    g = geometry(8, 128, "bf16", 2)
    kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[])
    prod = SchedulerSide(dp_vllm_config(configs, "kv_producer", DP), kcc, ConnectorConfig.parse("kv_producer", {}), g)
    prod.kv_cache_manager = FakeManager()
    prod.set_handshake({0: TpuSyncHandshake(tp_rank=0, address="127.0.0.1:1", block_format=g.block_format,
                                            num_blocks=DP * NB, tp_ranks=list(range(DP * g.tp)), dp=DP)})
    t = tokens(40, seed=3)
    r = request("p1", t, {"do_remote_decode": True}, max_tokens=1)
    prod.on_new_request(r)
    r.num_computed_tokens, r.status = 40, RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = prod.request_finished(r, [5, 9, 2])
    assert params["remote_describe"] is True and "remote_block_ids" not in params
    cons = SchedulerSide(configs["kv_consumer"], kcc, ConnectorConfig.parse("kv_consumer", {"layerwise": True}), g)
    cons.kv_cache_manager = FakeManager()
    d = request("d1", t, dict(params))
    cons.on_new_request(d)
    assert cons.get_num_new_matched_tokens(d, 0) == (40, True)
    cons.update_state_after_alloc(d, blocks([1, 2, 3]), 40)
    meta = cons.build_connector_meta(sched_out({}))
    assert [x.req_id for x in meta.recvs] == ["d1"] and not meta.layer_recvs
    assert meta.recvs[0].src_block_ids is None and meta.recvs[0].dst_block_ids == [1, 2, 3]


def test_a_dp_producer_without_an_endpoint_does_not_wait_for_one(configs):
    """A producer rank under the DP scheduler waits (answers None) for the workers' addresses
    only until their handshake arrives: workers without a P/D endpoint (address None) end the
    wait, and the request is computed and finished without a hand-off (logged), never left
    waiting for good."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tpu_sync.vllm.metadata import TpuSyncHandshake
    from tpu_sync.vllm.scheduler import SchedulerSide

    g = geometry(8, 128, "bf16", 2)
    kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[])
    prod = SchedulerSide(dp_vllm_config(configs, "kv_producer", DP), kcc, ConnectorConfig.parse("kv_producer", {}), g)
    r = request("p1", tokens(40, seed=3), {"do_remote_decode": True}, max_tokens=1)
    prod.on_new_request(r)
    assert prod.get_num_new_matched_tokens(r, 0) == (None, False)
    prod.set_handshake({0: TpuSyncHandshake(tp_rank=0, address=None, block_format=g.block_format,
                                            num_blocks=DP * NB, tp_ranks=list(range(DP * g.tp)), dp=DP)})
    assert prod.get_num_new_matched_tokens(r, 0) == (0, False)


def test_a_cluster_tier_with_a_runner_of_several_ranks_is_refused(configs):
    """The cluster tier shares one host-tier store per TP rank, described in the directory as
    that rank's; a JAX runner of several ranks in one process keeps entries of every rank's
    bytes, which a peer would read as one rank's: refused at ``register_runner`` by name (TP=2,
    and DP=2 x TP=1), before anything is published."""
    g = geometry(8, 128, "bf16", 2)
    cluster = {"cluster": {"endpoints": ["http://127.0.0.1:9"], "advertise": "127.0.0.1:9"},
               "host_capacity_bytes": 16 << 20}
    caches = rank_caches(g, 0, [], seed=0, fill_seed=3)
    w = WorkerSide(configs["kv_both"], ConnectorConfig.parse("kv_both", cluster), g)
    try:
        with pytest.raises(ValueError, match=r"2 ranks \(DP 1 x TP 2\).*cluster tier"):
            w.register_runner(runner(g, caches, 0))
        assert w.caches is None and w.tier is None
    finally:
        w.shutdown()
    g1 = geometry(8, 128, "bf16", 1)
    w = WorkerSide(dp_vllm_config(configs, "kv_both", DP), ConnectorConfig.parse("kv_both", cluster), g1)
    try:
        with pytest.raises(ValueError, match=r"2 ranks \(DP 2 x TP 1\).*cluster tier"):
            w.register_runner(dp_runner(g1, dp_caches(g1, [], fill_seed=5), 0))
    finally:
        w.shutdown()


def test_a_data_parallel_runner_needs_the_dp_scheduler(configs):
    """A runner whose caches are split over the mesh's data axis (DP=2) in an engine whose
    scheduler is not tpu-inference's DP scheduler (no ``sharding_config``, or another DP) is
    refused at ``register_runner``, naming both (its one scheduler would hand out ids of one
    replica's size); the DP scheduler's engine takes it."""
    g = geometry(8, 128, "bf16", 2)
    devs = devices_or_skip(8)
    mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("data", "model"))
    rows, packing, lanes = g.layer_shape()[1:]
    a = jax.device_put(np.zeros((2 * NB, BS, rows * 2, packing, lanes), JAX_DTYPE["bf16"]),
                       NamedSharding(mesh, P("data", None, "model")))
    for vc in (configs["kv_both"], dp_vllm_config(configs, "kv_both", 4)):
        w = WorkerSide(vc, ConnectorConfig.parse("kv_both", {"host_capacity_bytes": 16 << 20}), g)
        try:
            with pytest.raises(ValueError, match=r"2 data-parallel replica\(s\).*DP scheduler has [14]"):
                w.register_runner(Runner([a, a + 0]))
        finally:
            w.shutdown()
    w = WorkerSide(dp_vllm_config(configs, "kv_both", 2),
                   ConnectorConfig.parse("kv_both", {"host_capacity_bytes": 16 << 20}), g)
    try:
        w.register_runner(Runner([a, a + 0]))
        assert w.handshake().dp == 2 and w.caches.num_blocks == 2 * NB and w.caches.entry_ranks == 2
    finally:
        w.shutdown()


def _sibling(name):
    """The module ``tests/vllm/<name>.py`` by its path, under a name of its own."""
    import importlib.util

    key = f"tests_vllm_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                        f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


def _ti_reorder(x, split_sizes, n_shards):
    """tpu-inference's ``reorder_concatenated_tensor_for_sharding(x, split_sizes, n_shards, -1)``
    (``tpu_inference/layers/common/utils.py`` 0.32.0), restated by slicing: the last dimension
    holds parts of ``split_sizes`` one after another; the result holds, for each of ``n_shards``
    equal shards in order, every part's ``1 / n_shards`` chunk of that shard's index, the parts
    in order (``AAAABBCC`` -> ``AABC AABC`` at two shards)."""
    parts, at = [], 0
    for n in split_sizes:
        parts.append(x[..., at:at + n])
        at += n
    return np.concatenate([p[..., r * (p.shape[-1] // n_shards):(r + 1) * (p.shape[-1] // n_shards)]
                           for r in range(n_shards) for p in parts], axis=-1)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tpu_inference_gdn_state_shards_are_the_connectors_rank_slots(tp):
    """A tpu-inference gated-delta-net layer's state on its mesh holds, on TP rank ``r``'s device,
    exactly rank ``r``'s slot of vLLM's state at that TP as the connector describes it (the
    q, k and v channel shares of the convolution state, then the rank's value heads of the
    recurrent state): each shard can be moved as that rank's slot, with no reordering, to and
    from engines of any TP (issue 25; docs/tpu.md, tpu-inference's GDN hybrids).

    Facts of the 0.32.0 wheel, restated (the wheel is never imported here):
    ``worker/tpu_worker.py`` initializes vLLM's model-parallel group with TP 1, so a GDN layer's
    ``MambaSpec.shapes`` are the whole model's (vLLM's calculator at ``tp_world_size=1``);
    ``runner/kv_cache_manager.py`` ``initialize_kv_cache`` allocates each state as
    ``(mamba_num_blocks, *shape)`` sharded ``P(ATTN_DATA, None, ATTN_HEAD)`` (conv) and
    ``P(ATTN_DATA, ATTN_HEAD, None, None)`` (recurrent); ``layers/vllm/custom_ops/
    gdn_attention_op.py`` reorders the convolution's input channels ``[key_dim, key_dim,
    value_dim]`` for the mesh's TP before the convolution whose tail the conv state keeps.
    The whole-model state's values are distinct and non-zero; the reference slot is cut from it
    by plain slicing (``test_groups._rank_state``, which the library's resharding of such a
    state is checked against), the byte counts are ``compat.state_rank_bytes`` of the
    connector's description at that TP."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc

    groups = _sibling("test_groups")  # tests/vllm's (bindings/python/tests has a module of that name)
    _gdn_case, _rank_state = groups._gdn_case, groups._rank_state
    from tpu_sync.vllm.compat import state_components, state_rank_bytes

    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        if is_conv_state_dim_first():
            pytest.skip("VLLM_SSM_CONV_STATE_LAYOUT=DS: tpu-inference's conv state is (state_len, channels)")
    except ImportError:
        pass
    method, args = _gdn_case()
    whole = calc.gated_delta_net_state_shape(**args, tp_world_size=1)  # tpu-inference's spec
    key_dim, value_dim = 4 * 8, 8 * 8
    assert tuple(whole[0]) == (3, 2 * key_dim + value_dim) and tuple(whole[1]) == (8, 8, 8)
    rng = np.random.default_rng(11)
    conv = rng.permutation(np.arange(1, 1 + 3 * 128)).reshape(3, 128).astype(np.float32)
    rec = rng.permutation(np.arange(1, 1 + 8 * 8 * 8)).reshape(8, 8, 8).astype(np.float32)
    slots, slot = 5, 3
    conv_arr = -rng.integers(1, 1 << 20, (slots, 3, 128)).astype(np.float32)
    rec_arr = -rng.integers(1, 1 << 20, (slots, 8, 8, 8)).astype(np.float32)
    conv_arr[slot] = _ti_reorder(conv, [key_dim, key_dim, value_dim], tp)
    rec_arr[slot] = rec
    devs = devices_or_skip(8)[:tp]
    mesh = Mesh(np.array(devs).reshape(1, tp), ("data", "model"))
    conv_j = jax.device_put(conv_arr, NamedSharding(mesh, P("data", None, "model")))
    rec_j = jax.device_put(rec_arr, NamedSharding(mesh, P("data", "model", None, None)))

    per_rank = calc.gated_delta_net_state_shape(**args, tp_world_size=tp)
    kind = dict(type="state", components=state_components(method, dict(args, tp_world_size=tp), per_rank,
                                                          ["f32", "f32"], tp))
    conv_bytes, rec_bytes = state_rank_bytes(kind, tp)

    def shard_of(a, dim, r):
        (s,) = [s for s in a.addressable_shards if (s.index[dim].start or 0) == r * a.shape[dim] // tp]
        return np.asarray(s.data)

    parts = [(4, 8), (4, 8), (8, 8)]
    for r in range(tp):
        c, h = shard_of(conv_j, 2, r)[slot], shard_of(rec_j, 1, r)[slot]
        assert (c.nbytes, h.nbytes) == (conv_bytes, rec_bytes), f"rank {r}"
        want = _rank_state(torch.from_numpy(conv), torch.from_numpy(rec), parts, r, tp).numpy()
        assert c.tobytes() + h.tobytes() == want.tobytes(), f"TP rank {r}'s shard of slot {slot}"


# ---- tpu-inference's gated-delta-net hybrids (Mamba state groups) ---------------------------------

def test_a_whole_model_state_spec_is_described_at_the_mesh_tp():
    """tpu-inference's ``MambaSpec`` holds the whole model's state shapes (vLLM's TP group is 1
    there): ``compat.mamba_state_group`` at the mesh's TP describes it as a spec of one rank's
    shapes at that TP would be; a spec of neither form is refused at TP > 1."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc
    from vllm.v1.kv_cache_interface import MambaSpec

    from tpu_sync.vllm.compat import mamba_state_group

    groups = _sibling("test_groups")
    method, args = groups._gdn_case()

    def spec(tp):
        return MambaSpec(block_size=64, shapes=calc.gated_delta_net_state_shape(**args, tp_world_size=tp),
                         dtypes=(torch.float32, torch.float32), page_size_padded=8192)

    for tp in (2, 4):
        split = (method, dict(args, tp_world_size=tp))
        per_rank, _ = mamba_state_group(spec(tp), tp, split)
        whole, slot = mamba_state_group(spec(1), tp, split)
        assert whole == per_rank and slot == 8192
    with pytest.raises(ValueError):
        mamba_state_group(spec(2), 4, (method, dict(args, tp_world_size=4)))


def gdn_hybrid_geometry(tp):
    """Layer 0 a gated-delta-net layer (4 key heads, 8 value heads of 8 x 8, f32: its state
    group), layer 1 full attention in an RPA v3 cache (8 heads of 128, bf16)."""
    import dataclasses

    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc

    from tpu_sync.vllm.compat import state_components

    method, args = _sibling("test_groups")._gdn_case()
    comps = state_components(method, dict(args, tp_world_size=tp),
                             calc.gated_delta_net_state_shape(**args, tp_world_size=tp), ["f32", "f32"], tp)
    return dataclasses.replace(geometry(8, 128, "bf16", tp), groups=(
        dict(kind="state", layers=[0], state=dict(type="state", components=comps, replicated=False),
             slot_bytes=GDN_SLOT_BYTES),
        dict(kind="attention", layers=[1], sliding_window=None)))


GDN_SLOT_BYTES, GDN_SLOTS = 4096, 5
GDN_KEY, GDN_CONV = 32, 128


def gdn_whole_state(seed):
    rng = np.random.default_rng(seed)
    v = (rng.permutation(3 * GDN_CONV + 8 * 8 * 8) + 1).astype(np.float32)
    return v[:3 * GDN_CONV].reshape(3, GDN_CONV), v[3 * GDN_CONV:].reshape(8, 8, 8)


class GdnRunner:
    """tpu-inference's runner around a gated-delta-net hybrid's arrays: ``kv_caches[0]`` the GDN
    layer's ``(conv, recurrent)`` tuple (the whole model's shapes, ``GDN_SLOTS`` runner-owned
    slots, slot 0 the null slot), ``kv_caches[1]`` the attention layer's RPA v3 cache; its
    ``input_batch`` maps the requests in the persistent batch to their slots, as
    ``InputBatch.add_request`` / ``remove_request`` do (``runner/input_batch.py`` 0.32.0)."""

    def __init__(self, g, attn_per_rank, first_device, fill_seed, state=None, dp=1):
        from test_tpu_engine_layouts import NAMES

        devs = devices_or_skip(8)[first_device:first_device + dp * g.tp]
        mesh = Mesh(np.array(devs).reshape(dp, g.tp), ("data", "model"))
        rng = np.random.default_rng(fill_seed)
        conv = -rng.integers(1, 1 << 22, (GDN_SLOTS * dp, 3, GDN_CONV)).astype(np.float32)
        rec = -rng.integers(1, 1 << 22, (GDN_SLOTS * dp, 8, 8, 8)).astype(np.float32)
        if state is not None:
            slot, (c, h) = state
            conv[slot], rec[slot] = _ti_reorder(c, [GDN_KEY, GDN_KEY, 64], g.tp), h
        # attn_per_rank: one replica's per-rank arrays (every replica the same), or with DP a list
        # of them, one per replica.
        reps = attn_per_rank if dp > 1 and isinstance(attn_per_rank[0], list) else [attn_per_rank] * dp
        attn = np.concatenate([np.concatenate(rep, axis=2) for rep in reps]).view(JAX_DTYPE[g.dtype])
        self.kv_caches = [
            (jax.device_put(conv, NamedSharding(mesh, P("data", None, "model"))),
             jax.device_put(rec, NamedSharding(mesh, P("data", "model", None, None)))),
            jax.device_put(attn, NamedSharding(mesh, P("data", None, "model")))]
        self.layer_name_to_kvcache_index = {NAMES[0]: 0, NAMES[1]: 1}
        self.input_batch = SimpleNamespace(req_id_to_index={}, mamba_state_indices_cpu=np.zeros(4, np.int32))
        self._step = jax.jit(lambda c: c, donate_argnums=0)

    def add(self, req_id, slot):
        i = len(self.input_batch.req_id_to_index)
        self.input_batch.req_id_to_index[req_id] = i
        self.input_batch.mamba_state_indices_cpu[i] = slot

    def remove(self, req_id):
        i = self.input_batch.req_id_to_index.pop(req_id)
        self.input_batch.mamba_state_indices_cpu[i] = 0

    def forward(self):
        """A step: every batched request's state slot read as the forward reads its initial
        state (kept in ``seen``), then the arrays donated and put back."""
        conv, rec = self.state()
        self.seen = {r: (conv[s].copy(), rec[s].copy()) for r, i in self.input_batch.req_id_to_index.items()
                     for s in [int(self.input_batch.mamba_state_indices_cpu[i])]}
        self.kv_caches = [jax.tree_util.tree_map(self._step, e) for e in self.kv_caches]

    def state(self):
        return [np.asarray(jax.device_get(a)).view(np.uint32).copy() for a in self.kv_caches[0]]


def engine_step(w, runner, meta=None):
    """One engine step as vLLM 0.32 drives the connector around the runner's forward in a step
    without synchronous loads (``_get_kv_connector_output``): the metadata bound, the forward,
    then ``start_load_kv`` and ``wait_for_save``."""
    meta = meta if meta is not None else TpuSyncMetadata()
    w.bind(meta)
    runner.forward()
    w.start_load_kv(meta)
    w.wait_for_save(meta)


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 4), (4, 2)])
def test_pd_of_a_gdn_hybrid_between_jax_runners(configs, src_tp, dst_tp):
    """P/D of a gated-delta-net hybrid between tpu-inference runners of different TP through the
    worker sides (``mamba_cache_mode="none"``: runner-owned state slots), each step driven as
    vLLM 0.32 drives the hooks (``start_load_kv`` after the forward). The producer stages the
    request's state from its slot while the request is in its batch (registered right after the
    forward that completes the prefill); after that its slot is overwritten and it leaves the
    batch, and the pull still gets the staged state. The consumer's pulled state waits in its
    mirror while the request is not in its batch (every slot unchanged), and is in the slot the
    request gets when it enters the batch by the time that step's forward reads it: byte-exact
    in the consumer's TP layout (its conv channels ordered for its TP), every other slot
    unchanged; the attention layer's blocks byte-exact, every other block unchanged; the
    producer's arrays unchanged."""
    tokens = 40
    gs, gd = gdn_hybrid_geometry(src_tp), gdn_hybrid_geometry(dst_tp)
    ids_src, ids_dst = [2, 9, 4], [7, 3, 12]
    held_src, held_dst = [[11], ids_src], [[5], ids_dst]
    whole = gdn_whole_state(17)
    src_attn = [per[1] for per in rank_caches(gs, tokens, ids_src, seed=3, fill_seed=11)]
    dst_attn0 = [per[1] for per in rank_caches(gd, 0, ids_dst, seed=3, fill_seed=12)]
    want_attn = np.concatenate([per[1] for per in rank_caches(gd, tokens, ids_dst, seed=3, fill_seed=12)], axis=2)
    pr = GdnRunner(gs, src_attn, 0, fill_seed=1, state=(3, whole))
    cr = GdnRunner(gd, dst_attn0, 4, fill_seed=2)
    pr.add("p1", 3)
    src_before, dst_before = pr.state(), cr.state()
    prod = worker(configs, "kv_producer", gs)
    cons = worker(configs, "kv_consumer", gd)
    try:
        prod.register_runner(pr)
        cons.register_runner(cr)
        peers = {r: prod.handshake().address for r in prod.handshake().tp_ranks}
        # The step that completes the prefill: registered right after its forward.
        engine_step(prod, pr, TpuSyncMetadata(layer_sends=[SendSpec("p1", 97, held_src, tokens, 60.0, dst_tp)]))
        assert prod.stats["registered"] == 1, prod.stats
        # The next step: the request leaves the batch, its slot goes to another request.
        pr.remove("p1")
        pr.kv_caches[0] = (pr.kv_caches[0][0].at[3].set(-1.0), pr.kv_caches[0][1].at[3].set(-1.0))
        pr.forward()
        cr.forward()
        pull_groups(cons, "d1", 97, peers, gs.tpu_sync_layout(NB), held_src, held_dst, tokens)
        assert np.array_equal(bits(cr.kv_caches[1]), np.where(
            np.isin(np.arange(NB), ids_dst)[:, None, None, None, None], want_attn,
            np.concatenate(dst_attn0, axis=2))), "attention blocks"
        assert all(np.array_equal(a, b) for a, b in zip(cr.state(), dst_before)), "state written before a slot"
        assert cons.jax_stats["pending_state_requests"] == 1
        # The request enters the consumer's batch (slot 2): its forward reads the pulled state.
        cr.add("d1", 2)
        engine_step(cons, cr)
        want_conv, want_rec = dst_before[0].copy(), dst_before[1].copy()
        want_conv[2] = _ti_reorder(whole[0], [GDN_KEY, GDN_KEY, 64], dst_tp).view(np.uint32)
        want_rec[2] = whole[1].view(np.uint32)
        assert [np.array_equal(a, b) for a, b in zip(cr.seen["d1"], (want_conv[2], want_rec[2]))] == [True, True], \
            "the state the consumer's forward read"
        conv, rec = cr.state()
        assert np.array_equal(conv, want_conv) and np.array_equal(rec, want_rec), "the consumer's state slots"
        assert cons.jax_stats["pending_state_requests"] == 0 and cons.stats["states_placed"] == 1
        # The producer's arrays: unchanged but for the slot the test overwrote.
        s_conv, s_rec = pr.state()
        assert np.array_equal(np.delete(s_conv, 3, 0), np.delete(src_before[0], 3, 0))
        assert np.array_equal(np.delete(s_rec, 3, 0), np.delete(src_before[1], 3, 0))
    finally:
        cons.shutdown()
        prod.shutdown()


def test_gdn_hybrid_state_that_cannot_be_placed_fails_cleanly(configs):
    """A producer whose request already left its runner's batch (its slot is gone) does not
    register it rather than send another request's state, and refuses it: the consumer's pull
    fails at once (not after its pull timeout) and it recomputes; a consumer's pulled state
    whose request finishes before it is scheduled is dropped; the host tier, speculative
    decoding and a producer without early registration are refused with a JAX runner of such a
    model."""
    tokens = 20
    g = gdn_hybrid_geometry(2)
    attn = [per[1] for per in rank_caches(g, tokens, [1, 2], seed=3, fill_seed=11)]
    pr = GdnRunner(g, attn, 0, fill_seed=1, state=(3, gdn_whole_state(5)))
    prod = worker(configs, "kv_producer", g)
    cons = worker(configs, "kv_consumer", g)
    try:
        prod.register_runner(pr)
        prod.start_load_kv(TpuSyncMetadata(sends=[SendSpec("p1", 98, [[11], [1, 2]], tokens, 60.0, 2)]))
        assert prod.stats["registered"] == 0 and prod.stats["register_failed"] == 1, prod.stats
        assert prod.stats["refused"] == 1, prod.stats
        cr = GdnRunner(g, attn, 4, fill_seed=2)
        cons.register_runner(cr)
        # Its consumer's pull (waiting up to 600 s for a registration) fails at once with the
        # producer's reason: within wait_pulled's 30 s, reported in failed_recving (vLLM 0.32
        # recomputes a request of a model with KV cache groups by its id).
        peers = {r: prod.handshake().address for r in prod.handshake().tp_ranks}
        cons.start_load_kv(TpuSyncMetadata(recvs=[RecvSpec("d1", 98, peers, g.tpu_sync_layout(NB), [[11], [1, 2]],
                                                           [[6], [4, 5]], tokens, 600.0)]))
        res = wait_pulled(cons, "d1")
        assert res.failed_recving == {"d1"} and cons.stats["pulls_failed"] == 1, cons.stats
        pr.add("p2", 3)
        prod.start_load_kv(TpuSyncMetadata(sends=[SendSpec("p2", 99, [[11], [1, 2]], tokens, 60.0, 2)]))
        assert prod.stats["registered"] == 1, prod.stats
        before = cr.state()
        pull_groups(cons, "d2", 99, peers, g.tpu_sync_layout(NB), [[11], [1, 2]], [[6], [4, 5]], tokens)
        assert cons.jax_stats["pending_state_requests"] == 1
        cons.get_transfer_results({"d2"})  # finished (aborted) before it was scheduled
        assert cons.jax_stats["pending_state_requests"] == 0
        cr.add("d2", 2)
        engine_step(cons, cr)
        assert all(np.array_equal(a, b) for a, b in zip(cr.state(), before))
    finally:
        cons.shutdown()
        prod.shutdown()
    from tpu_sync.vllm.worker import WorkerSide

    spec_config = dp_vllm_config(configs, "kv_consumer", 1)
    spec_config.speculative_config = SimpleNamespace(num_speculative_tokens=2)
    for w, match in [(worker(configs, "kv_both", g, {"host_capacity_bytes": 16 << 20}), "host tier"),
                     (worker(configs, "kv_producer", g, {"early_register": False}), "early_register"),
                     (WorkerSide(spec_config, ConnectorConfig.parse("kv_consumer", {}), g), "speculative decoding")]:
        try:
            with pytest.raises(NotImplementedError, match=match):
                w.register_runner(GdnRunner(g, attn, 0, fill_seed=1))
        finally:
            w.shutdown()


def test_pd_of_a_gdn_hybrid_into_a_data_parallel_runner(configs):
    """P/D of a gated-delta-net hybrid from a TP=2 runner into replica 1 of a DP=2 x TP=2 runner
    (global block ids and global state slots, as tpu-inference's DP scheduler and input batch
    give them): the state lands in the request's slot of replica 1 once the request enters the
    batch, the attention blocks in replica 1's blocks; replica 0 and every other slot and block
    unchanged."""
    from tpu_sync.vllm.worker import WorkerSide

    tokens = 40
    gs, gd = gdn_hybrid_geometry(2), gdn_hybrid_geometry(2)
    ids_src, ids_dst = [2, 9, 4], [7, 3, 12]
    held_src = [[11], ids_src]
    held_dst = [[NB + 5], [NB + b for b in ids_dst]]
    whole = gdn_whole_state(23)
    src_attn = [per[1] for per in rank_caches(gs, tokens, ids_src, seed=3, fill_seed=11)]
    dst_attn0 = [per[1] for per in rank_caches(gd, 0, ids_dst, seed=3, fill_seed=12)]
    want_attn = np.concatenate([per[1] for per in rank_caches(gd, tokens, ids_dst, seed=3, fill_seed=12)], axis=2)
    pr = GdnRunner(gs, src_attn, 0, fill_seed=1, state=(3, whole))
    cr = GdnRunner(gd, dst_attn0, 4, fill_seed=2, dp=2)
    pr.add("p1", 3)
    dst_before, attn_before = cr.state(), bits(cr.kv_caches[1])
    prod = worker(configs, "kv_producer", gs)
    cons = WorkerSide(dp_vllm_config(configs, "kv_consumer", 2), ConnectorConfig.parse("kv_consumer", {}), gd)
    try:
        prod.register_runner(pr)
        cons.register_runner(cr)
        assert cons.jax_stats["dp"] == 2
        peers = {r: prod.handshake().address for r in prod.handshake().tp_ranks}
        prod.start_load_kv(TpuSyncMetadata(sends=[SendSpec("p1", 96, held_src, tokens, 60.0, 2)]))
        assert prod.stats["registered"] == 1, prod.stats
        pull_groups(cons, "d1", 96, peers, gs.tpu_sync_layout(NB), held_src, held_dst, tokens)
        want = attn_before.copy()
        want[[NB + b for b in ids_dst]] = want_attn[ids_dst]
        cr.forward()  # new arrays (a pjrt-view pull wrote the shards behind JAX's cached host copy)
        assert np.array_equal(bits(cr.kv_caches[1]), want), "attention blocks of replica 1 only"
        slot = GDN_SLOTS + 2  # replica 1's local slot 2
        cr.add("d1", slot)
        engine_step(cons, cr)
        conv, rec = cr.state()
        want_conv, want_rec = dst_before[0].copy(), dst_before[1].copy()
        want_conv[slot] = _ti_reorder(whole[0], [GDN_KEY, GDN_KEY, 64], 2).view(np.uint32)
        want_rec[slot] = whole[1].view(np.uint32)
        assert np.array_equal(conv, want_conv) and np.array_equal(rec, want_rec), "the consumer's state slots"
    finally:
        cons.shutdown()
        prod.shutdown()


def test_pd_of_a_gdn_hybrid_under_tpu_inferences_dp_scheduler(configs):
    """P/D of a gated-delta-net hybrid between two engines under tpu-inference's DP scheduler
    (DP=2 x TP=2 each; the connector's scheduler sides per DP rank, block ids through the DP
    merge only): the producer's request on DP rank 1 (its prompt less the last token prefilled,
    its state staged from its slot in replica 1 when it registers), the consumer's on DP rank 0
    (answered ``(T - 1, True)``); once the request enters the consumer's batch, its forward
    reads the producer's state from its slot in replica 0, and the full attention layer's
    ``T - 1`` tokens are at its blocks, byte-exact; every other block unchanged."""
    T = 40
    g = gdn_hybrid_geometry(2)
    p_local, d_local = [[5], [2, 9, 4]], [[7], [11, 3, 12]]
    whole = gdn_whole_state(29)
    rep_fill = [[per[1] for per in rank_caches(g, 0, [0], seed=0, fill_seed=40 + d)] for d in range(DP)]
    p_rep1 = [per[1] for per in rank_caches(g, T - 1, p_local[1], seed=8, fill_seed=41)]
    d_rep0 = [per[1] for per in rank_caches(g, T - 1, d_local[1], seed=8, fill_seed=60)]
    c_fill = [[per[1] for per in rank_caches(g, 0, [0], seed=0, fill_seed=60 + d)] for d in range(DP)]
    p_slot = GDN_SLOTS + 3  # replica 1's slot 3
    pr = GdnRunner(g, [rep_fill[0], p_rep1], 0, fill_seed=1, state=(p_slot, whole), dp=DP)
    cr = GdnRunner(g, c_fill, 4, fill_seed=2, dp=DP)
    prod = DpEngine(configs, "kv_producer", g, pr, {})
    cons = DpEngine(configs, "kv_consumer", g, cr, {})
    for s in prod.ranks + cons.ranks:
        s.kv_cache_manager = GroupManager()
    attn_before, state_before = bits(cr.kv_caches[1]), cr.state()
    try:
        prod.step()
        from vllm.v1.request import RequestStatus

        side = prod.ranks[1]
        r = request("p1", tokens(T, seed=len("p1") + T), {"do_remote_decode": True}, max_tokens=1)
        side.on_new_request(r)  # a state model: the prompt less its last token is prefilled
        assert r.num_prompt_tokens == T - 1
        side.kv_cache_manager.ids["p1"] = p_local
        pr.add("p1", p_slot)  # in the producer's batch while its prefill completes
        prod.step({1: {"p1": T - 1}})
        assert prod.worker.stats["registered"] == 1, prod.worker.stats
        r.num_computed_tokens, r.status = T - 1, RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = side.request_finished_all_groups(r, tuple(p_local))
        assert delay is True and params["remote_num_tokens"] == T - 1, params
        params = {"p1": params}
        pr.remove("p1")
        pr.kv_caches[0] = (pr.kv_caches[0][0].at[p_slot].set(-1.0), pr.kv_caches[0][1].at[p_slot].set(-1.0))
        outs = prod.step()
        assert [set(o.finished_sending or ()) for o in outs] == [set(), {"p1"}]
        cons.step()
        side = cons.ranks[0]
        r = request("d1", tokens(T, seed=len("p1") + T), dict(params["p1"]))
        side.on_new_request(r)
        assert side.get_num_new_matched_tokens(r, 0) == (T - 1, True)
        side.update_state_after_alloc(r, group_blocks(d_local), T - 1)
        deadline, done = time.monotonic() + 60, set()
        while time.monotonic() < deadline and "d1" not in done:
            for o in cons.step():
                done |= set(o.finished_recving or ())
                assert not o.failed_recving, cons.worker.stats
            time.sleep(0.01)
        assert "d1" in done, cons.worker.stats
        cr.add("d1", 2)  # vLLM schedules it (its last token): the runner gives it slot 2
        cons.step()
        want_conv = _ti_reorder(whole[0], [GDN_KEY, GDN_KEY, 64], 2).view(np.uint32)
        assert np.array_equal(cr.seen["d1"][0], want_conv) and np.array_equal(
            cr.seen["d1"][1], whole[1].view(np.uint32)), "the state the consumer's forward read"
        conv, rec = cr.state()
        assert np.array_equal(np.delete(conv, 2, 0), np.delete(state_before[0], 2, 0))
        assert np.array_equal(np.delete(rec, 2, 0), np.delete(state_before[1], 2, 0))
        want = attn_before.copy()
        want[d_local[1]] = np.concatenate(d_rep0, axis=2)[d_local[1]]
        assert np.array_equal(bits(cr.kv_caches[1]), want), "attention blocks"
    finally:
        cons.shutdown()
        prod.shutdown()
