"""tpu-inference-shaped Mamba / gated-delta-net state layers (tuples of sharded ``jax.Array`` s in
``runner.kv_caches``), moved between two model runners of different TP and DP through
:class:`tpu_sync.jax_state.JaxStateKv` and two :class:`tpu_sync.Endpoint` s (issue 25).

JAX runs on CPU with 8 host devices: the producer's runner on devices 0.., the consumer's on
devices 4... Each state layer is ``(conv, recurrent)`` as tpu-inference 0.32.0 allocates it
(``runner/kv_cache_manager.py`` ``initialize_kv_cache``: ``(slots, *shape)`` per ``MambaSpec``
shape, the whole model's shapes, sharded ``P("data", None, "model")`` and ``P("data", "model",
None, None)``), the conv state's channels in the order its GDN op gives them for the mesh's TP
(``reorder_concatenated_tensor_for_sharding`` of q, k and v; restated here by slicing). The
state is described to tpu_sync as vLLM's (``tpu_sync.vllm.compat.state_components`` of a gated
delta net with 4 key heads and 8 value heads of 8 x 8, written out here: this environment has no
vLLM), so each shard is one rank's slot.

Checked, byte for byte: the consumer's destination slot holds the whole-model state in the
layout of its own TP, every other slot of its layers and every other entry of its runner is
unchanged, the producer's arrays are unchanged, and the bytes moved are exactly the state's.
"""

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Read when JAX creates its CPU client (the first use, not the import).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
jax.config.update("jax_platforms", "cpu")

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import tpu_sync  # noqa: E402
from tpu_sync.errors import InvalidArgumentError, UnsupportedError  # noqa: E402
from tpu_sync.jax_state import JaxStateKv  # noqa: E402

K_HEADS, V_HEADS, DK, DV, STATE_LEN = 4, 8, 8, 8, 3
KEY_DIM, VALUE_DIM = K_HEADS * DK, V_HEADS * DV
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
LAYERS, SLOTS, SLOT_BYTES = 2, 6, 4096
#: vLLM's gated-delta-net state in the whole model's heads (compat.state_components, vLLM's SD
#: conv layout): each rank's q, k and v channel shares in each of the conv state's rows, then its
#: value heads of the recurrent state
STATE_KIND = dict(type="state", components=[
    dict(name="conv", rows=STATE_LEN, dtype="f32", segments=[dict(heads=K_HEADS, head_elems=DK),
                                                             dict(heads=K_HEADS, head_elems=DK),
                                                             dict(heads=V_HEADS, head_elems=DV)]),
    dict(name="recurrent", rows=1, dtype="f32", segments=[dict(heads=V_HEADS, head_elems=DK * DV)])])


def devices_or_skip(n):
    d = jax.devices("cpu")
    if len(d) < n:
        pytest.skip(f"JAX has {len(d)} CPU devices (XLA_FLAGS was set after JAX started)")
    return d


def ti_reorder(conv, tp):
    """The conv state's channels as tpu-inference's GDN op orders them for ``tp`` shards: shard
    ``r`` holds the ``r``-th ``1 / tp`` of q, then of k, then of v."""
    parts = [conv[..., :KEY_DIM], conv[..., KEY_DIM:2 * KEY_DIM], conv[..., 2 * KEY_DIM:]]
    return np.concatenate([p[..., r * (p.shape[-1] // tp):(r + 1) * (p.shape[-1] // tp)]
                           for r in range(tp) for p in parts], axis=-1)


def whole_state(layer, seed):
    """A layer's whole-model state: distinct, non-zero, non-repeating f32 values."""
    rng = np.random.default_rng(seed * 100 + layer)
    n = STATE_LEN * CONV_DIM + V_HEADS * DK * DV
    v = (rng.permutation(n) + 1 + layer * n).astype(np.float32)
    return v[:STATE_LEN * CONV_DIM].reshape(STATE_LEN, CONV_DIM), v[STATE_LEN * CONV_DIM:].reshape(V_HEADS, DK, DV)


class Runner:
    """What tpu-inference's runner offers: ``kv_caches``, entry 0 an attention cache (left
    alone), then one ``(conv, recurrent)`` tuple per state layer; a forward replaces them all."""

    def __init__(self, entries):
        self.kv_caches = [jax.tree_util.tree_map(jnp.copy, e) for e in entries]
        self._step = jax.jit(lambda c: c, donate_argnums=0)

    def forward(self):
        self.kv_caches = [self._step(e) for e in self.kv_caches]


def make_runner(dp, tp, first_device, slot_of, seed, fill_seed):
    """A runner on ``dp x tp`` devices from ``first_device``: every state slot holds other
    values (``fill_seed``), global slot ``slot_of`` the request's state (``seed``)."""
    devs = devices_or_skip(8)[first_device:first_device + dp * tp]
    mesh = Mesh(np.array(devs).reshape(dp, tp), ("data", "model"))
    rng = np.random.default_rng(fill_seed)
    n = SLOTS * dp
    attn = jax.device_put(rng.standard_normal((n, 4, 2 * tp, 8)).astype(np.float32),
                          NamedSharding(mesh, P("data", None, "model")))
    entries = [attn]
    for layer in range(LAYERS):
        conv = -rng.integers(1, 1 << 22, (n, STATE_LEN, CONV_DIM)).astype(np.float32)
        rec = -rng.integers(1, 1 << 22, (n, V_HEADS, DK, DV)).astype(np.float32)
        if slot_of is not None:
            c, h = whole_state(layer, seed)
            conv[slot_of], rec[slot_of] = ti_reorder(c, tp), h
        entries.append((jax.device_put(conv, NamedSharding(mesh, P("data", None, "model"))),
                        jax.device_put(rec, NamedSharding(mesh, P("data", "model", None, None)))))
    return Runner(entries)


def host(entry):
    return [np.asarray(jax.device_get(a)).copy() for a in entry]


def layout(dp, tp):
    model = tpu_sync.hybrid_model("gdn", [dict(name="gdn", layers=list(range(LAYERS)), kind=STATE_KIND)])
    return tpu_sync.layout(model, tp=tp, dp=dp, block_size=16, num_blocks=[dict(num_blocks=SLOTS,
                                                                                 slot_bytes=SLOT_BYTES)])


@pytest.mark.parametrize("src,dst", [((1, 2), (1, 4)), ((1, 4), (1, 2)), ((1, 1), (2, 2)), ((2, 2), (1, 1))],
                         ids=["tp2-tp4", "tp4-tp2", "tp1-dp2xtp2", "dp2xtp2-tp1"])
def test_pd_of_gdn_state_between_tpu_inference_runners_reshards_byte_exact(src, dst):
    (s_dp, s_tp), (d_dp, d_tp) = src, dst
    s_slot = SLOTS * (s_dp - 1) + 4  # the last replica's slot 4
    d_slot = SLOTS * (d_dp - 1) + 2
    prod = make_runner(s_dp, s_tp, 0, s_slot, seed=7, fill_seed=1)
    cons = make_runner(d_dp, d_tp, 4, None, seed=7, fill_seed=2)
    before = [host(e) for e in cons.kv_caches[1:]]
    prod_before = [host(e) for e in prod.kv_caches[1:]]
    attn_before = np.asarray(jax.device_get(cons.kv_caches[0])).copy()
    client = tpu_sync.Client()
    pk = JaxStateKv(prod, range(1, 1 + LAYERS), SLOT_BYTES, view_dtype="f32", client=client)
    ck = JaxStateKv(cons, range(1, 1 + LAYERS), SLOT_BYTES, view_dtype="f32", client=client)
    assert (pk.tp, pk.dp, ck.tp, ck.dp) == (s_tp, s_dp, d_tp, d_dp)
    assert ck.part_bytes == [STATE_LEN * CONV_DIM * 4 // d_tp, V_HEADS * DK * DV * 4 // d_tp]
    prod.forward()
    cons.forward()  # the arrays are read again after a forward
    sd, slocal = pk.split([s_slot])
    dd, dlocal = ck.split([d_slot])
    src_p = tpu_sync.placement(layout(s_dp, s_tp), [[slocal] * s_tp], dp_rank=sd)
    dst_p = tpu_sync.placement(layout(d_dp, d_tp), [[dlocal] * d_tp], dp_rank=dd)
    with tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=20, name="prefill", client=client) as pe, \
            tpu_sync.Endpoint(listen=None, timeout=20, name="decode", client=client) as de:
        pk.stage([s_slot])
        pe.register(9, src_p, 16, pk.replica_views(sd), expected_releases=d_tp)
        pk.drop([s_slot])
        prod.forward()  # the producer's next step: the slot was staged
        ptrs = ck.before_write([d_slot], 16)
        report = de.pull(9, pe.address, src_p, dst_p, 16, ck.replica_views(dd)).wait(60)
        ck.after_write([d_slot], ptrs)
    # Every rank's share of both components of every layer, once.
    assert report["bytes"] == (STATE_LEN * CONV_DIM + V_HEADS * DK * DV) * 4 * LAYERS
    for layer in range(LAYERS):
        got = host(cons.kv_caches[1 + layer])
        c, h = whole_state(layer, 7)
        want = [x.copy() for x in before[layer]]
        want[0][d_slot], want[1][d_slot] = ti_reorder(c, d_tp), h
        assert got[0].view(np.uint32).tolist() == want[0].view(np.uint32).tolist(), f"layer {layer} conv"
        assert np.array_equal(got[1].view(np.uint32), want[1].view(np.uint32)), f"layer {layer} recurrent"
        assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32))
                   for a, b in zip(host(prod.kv_caches[1 + layer]), prod_before[layer])), f"layer {layer}: producer"
    assert np.array_equal(np.asarray(jax.device_get(cons.kv_caches[0])), attn_before)
    st = ck.stats()
    assert st["commits"] == 1 and st["h2d_bytes"] == report["bytes"]
    pk.close()
    ck.close()


def test_stage_and_commit_move_exactly_the_named_slots():
    """A slot staged from one runner and committed into another of the same geometry: the
    mirrors hold the components' shard bytes one after another from the slot's start (zero
    after them), and only the named slot changes."""
    a = make_runner(1, 2, 0, 3, seed=5, fill_seed=1)
    b = make_runner(1, 2, 4, None, seed=5, fill_seed=2)
    client = tpu_sync.Client()
    ka = JaxStateKv(a, [1, 2], SLOT_BYTES, client=client)
    kb = JaxStateKv(b, [1, 2], SLOT_BYTES, client=client)
    ka.stage([3])
    c, h = whole_state(0, 5)
    va = ka.rank_views()
    for r in range(2):
        slot = np.frombuffer(va[r][0].read(), dtype=np.uint8).reshape(SLOTS, SLOT_BYTES)[3]
        conv_r = ti_reorder(c, 2)[:, r * CONV_DIM // 2:(r + 1) * CONV_DIM // 2]
        want = np.concatenate([conv_r.reshape(-1), h[r * V_HEADS // 2:(r + 1) * V_HEADS // 2].reshape(-1)])
        assert slot[:want.nbytes].tobytes() == want.tobytes() and not slot[want.nbytes:].any(), f"rank {r}"
    before = [host(e) for e in b.kv_caches[1:]]
    kb.rank_views()
    # Copy through numpy (the mirrors are plain host memory): slot 3 of a -> slot 1 of b.
    for r in range(2):
        for layer in range(LAYERS):
            src = np.frombuffer(ka._mirrors[0][r][layer], dtype=np.uint8).reshape(SLOTS, SLOT_BYTES)
            dst = np.frombuffer(kb._mirrors[0][r][layer], dtype=np.uint8).reshape(SLOTS, SLOT_BYTES)
            dst[1] = src[3]
    kb.after_write([1])
    for layer in range(LAYERS):
        got = host(b.kv_caches[1 + layer])
        c, h = whole_state(layer, 5)
        want = [x.copy() for x in before[layer]]
        want[0][1], want[1][1] = ti_reorder(c, 2), h
        assert all(np.array_equal(g.view(np.uint32), w.view(np.uint32)) for g, w in zip(got, want)), f"layer {layer}"
    # After the commit the mirrors' pages of the slot are given back (they read as zero).
    assert not np.frombuffer(kb._mirrors[0][0][0], dtype=np.uint8).any()
    ka.close()
    kb.close()


def test_unmapped_state_shardings_and_bad_arguments_are_refused():
    devs = devices_or_skip(8)
    mesh = Mesh(np.array(devs[:2]).reshape(1, 2), ("data", "model"))
    conv = jax.device_put(np.ones((SLOTS, STATE_LEN, CONV_DIM), np.float32), NamedSharding(mesh, P("data", None,
                                                                                                  "model")))
    rep = jax.device_put(np.ones((SLOTS, V_HEADS, DK, DV), np.float32), NamedSharding(mesh, P()))
    client = tpu_sync.Client()
    with pytest.raises(UnsupportedError, match="replicated over the 'model' axis"):
        JaxStateKv(Runner([(conv, rep)]), [0], SLOT_BYTES, client=client)
    on_slots = jax.device_put(np.ones((SLOTS + 2, V_HEADS, DK, DV), np.float32), NamedSharding(mesh, P("model")))
    with pytest.raises(UnsupportedError, match="split on its slots"):
        JaxStateKv(Runner([(on_slots,)]), [0], SLOT_BYTES, client=client)
    rec = jax.device_put(np.ones((SLOTS, V_HEADS, DK, DV), np.float32), NamedSharding(mesh, P("data", "model")))
    r = Runner([(conv, rec), conv])
    with pytest.raises(InvalidArgumentError, match="not a state layer's tuple"):
        JaxStateKv(r, [1], SLOT_BYTES, client=client)
    with pytest.raises(InvalidArgumentError, match="state shards of"):
        JaxStateKv(r, [0], 1024, client=client)
    with pytest.raises(InvalidArgumentError, match="state layer arrays"):
        JaxStateKv(r, [0, 0], SLOT_BYTES, client=client)
    k = JaxStateKv(r, [0], SLOT_BYTES, client=client)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        k.stage([SLOTS])
    with pytest.raises(InvalidArgumentError, match="twice"):
        k.commit([2, 2])
    k.close()


def test_a_failed_commit_leaves_the_runner_valid(monkeypatch):
    """A commit whose copy of the second component fails raises, and the runner's entry is a
    valid tuple (the first component written, the second as it was), not a donated array; a
    hybrid's pending state that fails to be written is named in the error, after every other
    request's state was written."""
    from tpu_sync.jax_kv import JaxKv
    from tpu_sync.jax_state import JaxHybridKv

    run = make_runner(1, 2, 0, 3, seed=5, fill_seed=1)
    k = JaxStateKv(run, [1, 2], SLOT_BYTES, view_dtype="f32", client=tpu_sync.Client())
    before = [host(e) for e in run.kv_caches[1:]]
    k.stage([3])
    real = JaxStateKv._update

    def failing(self, c, a, rows):
        if c == 1:
            raise RuntimeError("injected copy failure")
        return real(self, c, a, rows)

    monkeypatch.setattr(JaxStateKv, "_update", failing)
    with pytest.raises(RuntimeError, match="injected"):
        k.commit([3], [1])
    conv, rec = host(run.kv_caches[1])  # readable: nothing deleted
    assert np.array_equal(conv[1].view(np.uint32), before[0][0][3].view(np.uint32)), "component 0 written"
    assert np.array_equal(rec.view(np.uint32), before[0][1].view(np.uint32)), "component 1 as it was"
    run.forward()  # the runner's next step can use every array
    monkeypatch.setattr(JaxStateKv, "_update", real)

    # Two requests' pulled states waiting for their slots; writing the first one's fails.
    from types import SimpleNamespace

    k.stage([2], [3])
    k.stage([4], [3])
    attn = SimpleNamespace(tp=k.tp, dp=k.dp, ranks=k.ranks, num_blocks=k.num_blocks, mla=False, view_shape=(),
                           model_dtype="f32", buffer_dtype="f32", client=k.client, backend="framework-copy",
                           backend_reason="", block_size=16, physical_layout="",
                           after_write=lambda ids, ptrs: None, stats=dict, close=lambda: None)
    slots = {}
    hyb = JaxHybridKv(attn, {0: k}, [(0, 0), (0, 1)], ["state"], slots.get)
    for req, row in (("r1", 2), ("r2", 4)):
        hyb.map_request(req, [[row]])
        hyb.after_write([[row]], (), req_id=req)
    assert hyb.commit_pending() == [] and hyb.stats()["pending_state_requests"] == 2
    slots.update(r1=1, r2=2)
    real_commit = JaxStateKv.commit

    def commit(self, rows, device_slots=None):
        if list(device_slots or ()) == [1]:
            raise RuntimeError("injected copy failure")
        return real_commit(self, rows, device_slots)

    monkeypatch.setattr(JaxStateKv, "commit", commit)
    with pytest.raises(RuntimeError, match="r1 .*injected"):
        hyb.commit_pending()
    assert hyb.stats()["pending_state_requests"] == 0
    conv, rec = host(run.kv_caches[1])
    c, h = whole_state(0, 5)
    assert np.array_equal(conv[2], ti_reorder(c, 2)) and np.array_equal(rec[2], h), "r2's state written"
    hyb.close()
