"""tpu-inference-shaped KV caches as sharded ``jax.Array`` s (issue 25), moved between two
model runners through :class:`tpu_sync.jax_kv.JaxKv` and two :class:`tpu_sync.Endpoint` s.

JAX runs on CPU with 8 host devices (``--xla_force_host_platform_device_count=8``): the
producer's runner holds its caches on devices 0..TP-1, the consumer's on devices 4..; each
layer is one global array ``[num_blocks, block_size, TP * R, P, D']`` sharded
``NamedSharding(mesh, P("data", None, "model"))`` as tpu-inference shards it
(``tpu_inference/layers/common/sharding.py``), so every shard is one TP rank's RPA v3 cache.
The bytes come from the kernels' ``merge_kv`` reference of ``test_tpu_layouts`` (random,
never-zero bit patterns); the runner objects stand in for tpu-inference's runner around the
arrays only (``runner.kv_caches``, re-assigned by a donating jitted step as a forward does).

Checked per case, byte for byte: the consumer's destination blocks equal the reference of its
own TP (padding zero), every other block of its caches is unchanged, the producer's caches are
unchanged, and the bytes moved are exactly the real heads' and tokens'.
"""

import os
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Read when JAX creates its CPU client (the first use, not the import).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
jax.config.update("jax_platforms", "cpu")

import ml_dtypes  # noqa: E402  (installed with jax)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import tpu_sync  # noqa: E402
from tpu_sync.errors import UnsupportedError  # noqa: E402
from tpu_sync.jax_kv import JaxKv, xla_layout  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tpu_layouts import DTYPES, rank_caches  # noqa: E402

JAX_DTYPE = {"bf16": ml_dtypes.bfloat16, "fp8": ml_dtypes.float8_e4m3fn, "f32": np.float32}
HEADS, DIM, LAYERS, TOKENS = 8, 128, 3, 70


def devices_or_skip(n):
    d = jax.devices("cpu")
    if len(d) < n:
        pytest.skip(f"JAX has {len(d)} CPU devices (XLA_FLAGS was set after JAX started)")
    return d


class Runner:
    """What tpu-inference's model runner offers a connector: ``kv_caches``, a list of per-layer
    arrays that each forward replaces."""

    def __init__(self, caches):
        # XLA's own buffers, as an engine allocates its caches: jax.device_put of a host array
        # may alias the array's memory (f32 on the CPU devices, when it is aligned), and the
        # first donating forward then moves the cache to a buffer of XLA's, failing a transfer
        # that was writing into it (correctly: the caches moved), 1 run in 2.
        self.kv_caches = [jnp.copy(c) for c in caches]
        self._step = jax.jit(lambda c: c, donate_argnums=0)

    def forward(self):
        """A step: the caches are donated and the results put back (as the jitted model does)."""
        self.kv_caches = [self._step(c) for c in self.kv_caches]


def sharded(per_rank, devices, dtype):
    """One layer's global array from each rank's ``[N, BS, R, P, D']`` bit patterns."""
    tp = len(per_rank)
    mesh = Mesh(np.array(devices[:tp]).reshape(1, tp), ("data", "model"))
    glob = np.concatenate(per_rank, axis=2).view(JAX_DTYPE[dtype])
    return jax.device_put(glob, NamedSharding(mesh, P("data", None, "model")))


def host(a):
    """A global array's bit patterns (host copy), as unsigned integers."""
    return np.asarray(jax.device_get(a)).view(np.dtype(f"u{np.dtype(a.dtype).itemsize}"))


def runner_pair(dtype, s_tp, d_tp, s_bs, d_bs, dim=DIM, heads=HEADS):
    devs = devices_or_skip(8)
    s_nb, d_nb = 2 * -(-TOKENS // s_bs) + 3, 2 * -(-TOKENS // d_bs) + 3
    s_ids = [(5 * i + 2) % s_nb for i in range(-(-TOKENS // s_bs))]
    d_ids = [(d_nb - 1 - 2 * i) % d_nb for i in range(-(-TOKENS // d_bs))]
    assert len(set(s_ids)) == len(s_ids) and len(set(d_ids)) == len(d_ids)
    hd64 = dim == 64
    src = rank_caches(LAYERS, TOKENS, heads, dim, dtype, s_tp, s_bs, s_nb, [s_ids] * s_tp, hd64, seed=11)
    want = rank_caches(LAYERS, TOKENS, heads, dim, dtype, d_tp, d_bs, d_nb, [d_ids] * d_tp, hd64, seed=11)
    # The consumer's caches: other requests' bytes everywhere but the destination blocks (zero,
    # as a freshly allocated block of tpu-inference's zero-initialised caches).
    rng = np.random.default_rng(3)
    np_t = DTYPES[dtype]
    dst_init = []
    for r in range(d_tp):
        per = []
        for layer in range(LAYERS):
            c = rng.integers(1, np.iinfo(np_t).max, size=want[r][layer].shape, dtype=np_t)
            c[d_ids] = 0
            per.append(c)
        dst_init.append(per)
    prod = Runner([sharded([src[r][l] for r in range(s_tp)], devs[0:], dtype) for l in range(LAYERS)])
    cons = Runner([sharded([dst_init[r][l] for r in range(d_tp)], devs[4:], dtype) for l in range(LAYERS)])
    expect = []
    for layer in range(LAYERS):
        e = np.concatenate([dst_init[r][layer] for r in range(d_tp)], axis=2).copy()
        w = np.concatenate([want[r][layer] for r in range(d_tp)], axis=2)
        e[d_ids] = w[d_ids]
        expect.append(e)
    src_glob = [np.concatenate([src[r][l] for r in range(s_tp)], axis=2) for l in range(LAYERS)]
    return prod, cons, s_ids, d_ids, expect, src_glob


CASES = [
    # dtype, producer TP, consumer TP, producer block size, consumer block size, head_dim
    ("bf16", 4, 2, 16, 32, 128),
    ("bf16", 2, 4, 32, 16, 128),
    ("fp8", 4, 2, 16, 16, 128),
    ("fp8", 2, 4, 16, 32, 128),
    # The head_dim-64 kernel's cache (rpa3hd64: K and V of a head in one 128-lane row).
    ("bf16", 4, 2, 16, 32, 64),
    ("fp8", 2, 4, 32, 16, 64),
]
# Fewer KV heads than TP (2 heads, TP=4): tpu-inference pads the heads to TP by repeating each
# (``get_padded_num_heads``; ``repeat_interleave`` of the KV projection), one head per shard.
FEW_HEADS_CASES = [("bf16", 4, 2, 16, 32, 128), ("fp8", 2, 4, 16, 16, 128)]


@pytest.mark.parametrize("dtype,s_tp,d_tp,s_bs,d_bs,dim", CASES)
@pytest.mark.parametrize("backends", [("auto", "auto"), ("framework-copy", "framework-copy")])
def test_pd_between_tpu_inference_runners_reshards_byte_exact(dtype, s_tp, d_tp, s_bs, d_bs, dim, backends):
    prod, cons, s_ids, d_ids, expect, src_glob = runner_pair(dtype, s_tp, d_tp, s_bs, d_bs, dim)
    client = tpu_sync.Client()
    pk = JaxKv(prod, backend=backends[0], client=client)
    ck = JaxKv(cons, backend=backends[1], client=client)
    want_backend = "pjrt-view" if backends[0] == "auto" else backends[0]
    assert (pk.backend, ck.backend) == (want_backend, want_backend if backends[1] == "auto" else backends[1])
    assert "host memory" in pk.backend_reason or backends[0] != "auto"
    assert (pk.tp, pk.ranks, ck.tp, ck.ranks) == (s_tp, list(range(s_tp)), d_tp, list(range(d_tp)))
    assert pk.physical_layout == "{4,3,2,1,0}"
    model = tpu_sync.model("tpu-inference-test", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=dim, dtype=dtype)
    assert pk.layout(model)["spec"]["order"] == ("rpa3hd64" if dim == 64 else "rpa3")
    # Forwards between creating the adapters and using them: the caches are read again.
    prod.forward()
    cons.forward()
    with tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=20, name="prefill") as pe, \
            tpu_sync.Endpoint(listen=None, timeout=20, name="decode") as de:
        src_place = pk.register(pe, 77, model, s_ids, TOKENS)
        prod.forward()  # the producer's next step may overwrite the blocks: they are staged
        report = ck.pull(de, 77, pe.address, src_place, model, d_ids, TOKENS, timeout_s=60)
    real = TOKENS * HEADS * 2 * dim * np.dtype(DTYPES[dtype]).itemsize * LAYERS
    assert report["bytes"] == real
    for layer in range(LAYERS):
        got = host(cons.kv_caches[layer])
        assert got.shape == expect[layer].shape
        assert np.array_equal(got, expect[layer]), f"layer {layer}: consumer's caches differ"
        assert np.array_equal(host(prod.kv_caches[layer]), src_glob[layer]), f"layer {layer}: producer changed"
    st = ck.stats()
    assert st["backend"] == ck.backend and st["pulls"] == 1
    if ck.backend == "framework-copy":
        assert st["h2d_bytes"] == len(d_ids) * d_bs * np.prod(expect[0].shape[2:]) * expect[0].itemsize * LAYERS
    else:
        assert st["h2d_bytes"] == 0 and st["views_built"] >= 1


@pytest.mark.parametrize("dtype,s_tp,d_tp,s_bs,d_bs,dim", FEW_HEADS_CASES)
def test_pd_with_fewer_kv_heads_than_tp(dtype, s_tp, d_tp, s_bs, d_bs, dim):
    heads = 2
    prod, cons, s_ids, d_ids, expect, src_glob = runner_pair(dtype, s_tp, d_tp, s_bs, d_bs, dim, heads=heads)
    client = tpu_sync.Client()
    pk, ck = JaxKv(prod, client=client), JaxKv(cons, client=client)
    assert (pk.tp, ck.tp) == (s_tp, d_tp)
    model = tpu_sync.model("tpu-inference-test", num_layers=LAYERS, num_kv_heads=heads, head_dim=dim, dtype=dtype)
    with tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=20, name="prefill") as pe, \
            tpu_sync.Endpoint(listen=None, timeout=20, name="decode") as de:
        src_place = pk.register(pe, 79, model, s_ids, TOKENS)
        report = ck.pull(de, 79, pe.address, src_place, model, d_ids, TOKENS, timeout_s=60)
    # Every destination shard gets its head: replicated heads are moved once per replica.
    rep = max(1, d_tp // heads)
    assert report["bytes"] == TOKENS * heads * rep * 2 * dim * np.dtype(DTYPES[dtype]).itemsize * LAYERS
    for layer in range(LAYERS):
        assert np.array_equal(host(cons.kv_caches[layer]), expect[layer]), f"layer {layer}"
        assert np.array_equal(host(prod.kv_caches[layer]), src_glob[layer]), f"layer {layer}: producer changed"


def test_views_follow_a_forward_that_moves_the_caches():
    """A forward whose outputs are new buffers (no donation): the views are built again over the
    new memory, and a write through them lands in the runner's current arrays."""
    devs = devices_or_skip(8)
    mesh = Mesh(np.array(devs[:2]).reshape(1, 2), ("data", "model"))
    sh = NamedSharding(mesh, P("data", None, "model"))
    r = Runner([jax.device_put(np.zeros((4, 16, 4, 2, 128), ml_dtypes.bfloat16), sh) for _ in range(2)])
    k = JaxKv(r)
    v1 = k.views()
    assert k.views() is v1  # unchanged pointers: the same views
    r.kv_caches = [jax.device_put(np.ones((4, 16, 4, 2, 128), ml_dtypes.bfloat16), sh) + 0 for _ in range(2)]
    v2 = k.views()
    assert v2 is not v1 and k.stats()["views_built"] == 2
    n = 16 * 2 * 2 * 128  # elements of one block of one shard: [16, 2, 2, 128]
    data = np.arange(1, n + 1, dtype=np.uint16) | 0x4000
    v2[1][0].write(n * 2, data)  # block 1 of rank 1 (rows 2..4 of the global array), layer 0
    got = host(r.kv_caches[0])
    assert np.array_equal(got[1, :, 2:4].reshape(-1), data)
    assert np.all(got[0] == host(r.kv_caches[1])[0])


def test_unmapped_shardings_are_refused_by_name():
    devs = devices_or_skip(8)
    mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("data", "model"))
    # A data axis on another dimension than the blocks.
    a = jax.device_put(np.zeros((8, 16, 4, 2, 128), ml_dtypes.bfloat16), NamedSharding(mesh, P(None, "data", "model")))
    with pytest.raises(UnsupportedError, match="only a split of the blocks"):
        JaxKv(Runner([a]))
    # Replicated KV heads (fewer heads than TP devices).
    b = jax.device_put(np.zeros((8, 16, 4, 2, 128), ml_dtypes.bfloat16), NamedSharding(mesh, P(None, None, None)))
    with pytest.raises(UnsupportedError, match="more than one device"):
        JaxKv(Runner([b]))


def test_xla_layout_text():
    class L:
        major_to_minor = (0, 1, 2, 3, 4)
        tiling = ((4, 128), (4, 1))

    assert xla_layout(L(), 5) == "{4,3,2,1,0:T(4,128)(4,1)}"
    assert xla_layout(None, 3) == "{2,1,0}"


# ---- tpu-inference's MLA cache ----------------------------------------------------------------
# ``[num_blocks, block_size / K, K, D']`` per layer (``kernels/mla/v2/kernel.py``
# ``get_kv_cache_shape``, ``K = MLA_KV_PACKING_SIZE`` = 32 by default), token ``t`` of a block at
# ``[t / K, t % K]``, its 576 latent + rope elements in the first lanes of ``D' = 640`` (the
# kernel pads the 512 latent and the 64 rope lanes to 128 each), sharded ``P("data",
# "kv_context")``: replicated over the ``model`` axis.

MLA_DIM, MLA_K = 576, 32


def mla_cache(nb, bs, tokens, ids, dtype, seed, fill=None):
    """One layer's MLA cache as the kernel's ``prepare_kv_inputs`` lays tokens out: zero (or
    ``fill``), then the request's tokens of seed ``seed`` written at blocks ``ids``."""
    np_t = DTYPES[dtype]
    lanes = -(-MLA_DIM // 128) * 128
    c = np.zeros((nb, bs // MLA_K, MLA_K, lanes), dtype=np_t) if fill is None else fill.copy()
    rng = np.random.default_rng(seed)
    lat = rng.integers(1, np.iinfo(np_t).max, size=(tokens, MLA_DIM), dtype=np_t, endpoint=True)
    for t in range(tokens):
        k = t % bs
        c[ids[t // bs], k // MLA_K, k % MLA_K, :MLA_DIM] = lat[t]
        c[ids[t // bs], k // MLA_K, k % MLA_K, MLA_DIM:] = 0
    return c


def replicated(glob, devices, tp, dtype):
    mesh = Mesh(np.array(devices[:tp]).reshape(1, tp), ("data", "model"))
    return jax.device_put(glob.view(JAX_DTYPE[dtype]), NamedSharding(mesh, P("data", None)))


def replicas(a):
    """Every device's copy of a replicated array, as bit patterns."""
    u = np.dtype(f"u{np.dtype(a.dtype).itemsize}")
    return [np.asarray(s.data).view(u) for s in a.addressable_shards]


@pytest.mark.parametrize("dtype,s_tp,d_tp,s_bs,d_bs", [
    ("bf16", 4, 2, 64, 32),   # prefill TP=4 -> decode TP=2, other block sizes
    ("fp8", 2, 4, 32, 64),
    ("bf16", 1, 4, 32, 32),
])
@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
def test_pd_between_tpu_inference_mla_runners_writes_every_replica(dtype, s_tp, d_tp, s_bs, d_bs, backend):
    devs = devices_or_skip(8)
    s_nb, d_nb = 2 * -(-TOKENS // s_bs) + 3, 2 * -(-TOKENS // d_bs) + 3
    s_ids = [(5 * i + 2) % s_nb for i in range(-(-TOKENS // s_bs))]
    d_ids = [(d_nb - 1 - 2 * i) % d_nb for i in range(-(-TOKENS // d_bs))]
    np_t = DTYPES[dtype]
    rng = np.random.default_rng(5)
    src, expect, dst_init = [], [], []
    for layer in range(LAYERS):
        src.append(mla_cache(s_nb, s_bs, TOKENS, s_ids, dtype, seed=40 + layer))
        init = rng.integers(1, np.iinfo(np_t).max, size=(d_nb, d_bs // MLA_K, MLA_K, 640), dtype=np_t)
        init[d_ids] = 0
        dst_init.append(init)
        expect.append(mla_cache(d_nb, d_bs, TOKENS, d_ids, dtype, seed=40 + layer, fill=init))
    prod = Runner([replicated(src[l], devs[0:], s_tp, dtype) for l in range(LAYERS)])
    cons = Runner([replicated(dst_init[l], devs[4:], d_tp, dtype) for l in range(LAYERS)])
    client = tpu_sync.Client()
    pk = JaxKv(prod, backend=backend, client=client)
    ck = JaxKv(cons, backend=backend, client=client)
    assert (pk.mla, pk.tp, pk.ranks, ck.tp, ck.ranks) == (True, s_tp, list(range(s_tp)), d_tp, list(range(d_tp)))
    assert (pk.block_size, ck.block_size) == (s_bs, d_bs)
    model = tpu_sync.model("deepseek-mla-test", num_layers=LAYERS, num_kv_heads=1, head_dim=MLA_DIM, dtype=dtype,
                           kv_planes=1)
    assert pk.layout(model)["spec"]["order"] == "rpamla"
    prod.forward()
    cons.forward()
    with tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=20, name="prefill") as pe, \
            tpu_sync.Endpoint(listen=None, timeout=20, name="decode") as de:
        src_place = pk.register(pe, 78, model, s_ids, TOKENS)
        prod.forward()
        report = ck.pull(de, 78, pe.address, src_place, model, d_ids, TOKENS, timeout_s=60)
    # The latent of every token once per destination replica (TP rank), never the lane padding.
    assert report["bytes"] == TOKENS * MLA_DIM * np.dtype(np_t).itemsize * LAYERS * d_tp
    for layer in range(LAYERS):
        reps = replicas(cons.kv_caches[layer])
        assert len(reps) == d_tp
        for i, got in enumerate(reps):
            assert np.array_equal(got, expect[layer]), f"layer {layer} replica {i} differs"
        for got in replicas(prod.kv_caches[layer]):
            assert np.array_equal(got, src[layer]), f"layer {layer}: producer changed"
    if pk.backend == "framework-copy":
        # The replicas hold one latent: the producer copied the request's blocks of one of them.
        assert pk.stats()["d2h_bytes"] == len(s_ids) * s_bs * 640 * np.dtype(np_t).itemsize * LAYERS


def test_mla_caches_split_over_the_context_axis_are_refused():
    devs = devices_or_skip(8)
    mesh = Mesh(np.array(devs[:4]).reshape(1, 2, 2), ("data", "kv_context", "model"))
    a = jax.device_put(np.zeros((4, 2, 32, 640), ml_dtypes.bfloat16), NamedSharding(mesh, P("data", "kv_context")))
    with pytest.raises(UnsupportedError, match="kv_context"):
        JaxKv(Runner([a]))


def test_an_mla_cache_whose_rows_do_not_hold_the_block_size_is_refused():
    """tpu-inference pads a block to a multiple of K tokens ([N, align(BS, K) / K, K, D']): a
    16-token block in 32-slot rows is refused by name rather than read as 32 tokens."""
    devs = devices_or_skip(8)
    mesh = Mesh(np.array(devs[:2]).reshape(1, 2), ("data", "model"))
    a = jax.device_put(np.zeros((4, 1, 32, 640), ml_dtypes.bfloat16), NamedSharding(mesh, P("data", None)))
    with pytest.raises(UnsupportedError, match="multiple of 32"):
        JaxKv(Runner([a]), block_size=16)
    assert JaxKv(Runner([a]), block_size=32).block_size == 32


# ---- data parallelism: the ``data`` axis on the blocks ----------------------------------------
# tpu-inference with DP > 1 shards every layer ``P("data", None, "model")`` over a (data, model)
# mesh: DP replica ``d`` holds global blocks ``d * N .. (d + 1) * N - 1`` of its own requests
# (``core/sched/dp_scheduler.py`` offsets each rank's block ids by ``rank * num_blocks_per_rank``).

DP_NB = 12  # blocks per DP replica


def dp_runner(dtype, dp, tp, devices, per_replica):
    """A runner whose layers are ``[dp * DP_NB, BS, tp * R, P, D']`` on a (dp, tp) mesh, replica
    ``d``'s rank ``r`` holding ``per_replica[d][r][layer]``."""
    mesh = Mesh(np.array(devices[:dp * tp]).reshape(dp, tp), ("data", "model"))
    sh = NamedSharding(mesh, P("data", None, "model"))
    arrays = []
    for layer in range(LAYERS):
        rows = [np.concatenate([per_replica[d][r][layer] for r in range(tp)], axis=2) for d in range(dp)]
        arrays.append(jax.device_put(np.concatenate(rows, axis=0).view(JAX_DTYPE[dtype]), sh))
    return Runner(arrays)


@pytest.mark.parametrize("direction", ["dp->tp", "tp->dp"])
@pytest.mark.parametrize("backend", ["auto", "framework-copy"])
def test_pd_with_data_parallel_shards(direction, backend):
    """A DP=2 x TP=2 runner (global block ids, each request in one replica's shard) and a
    TP=2 runner, both directions: the request in DP replica 1 is pulled byte-exact into its
    destination; every other block, replica 0's shards included, and the producer unchanged."""
    devs = devices_or_skip(8)
    dtype, bs = "bf16", 16
    ids_local = [(5 * i + 2) % DP_NB for i in range(-(-TOKENS // bs))]
    nblocks = len(ids_local)
    src_dp = direction == "dp->tp"
    rng = np.random.default_rng(5)
    np_t = DTYPES[dtype]

    def filler(tp):
        return [[rng.integers(1, np.iinfo(np_t).max, size=(DP_NB, bs, 2 * HEADS // tp // 2, 2, DIM), dtype=np_t)
                 for _ in range(LAYERS)] for _ in range(tp)]

    req = rank_caches(LAYERS, TOKENS, HEADS, DIM, dtype, 2, bs, DP_NB, [ids_local] * 2, False, seed=13)
    if src_dp:
        src_rep = [filler(2), [[req[r][l] for l in range(LAYERS)] for r in range(2)]]
        prod = dp_runner(dtype, 2, 2, devs, src_rep)
        s_ids = [DP_NB + b for b in ids_local]  # global ids of replica 1
        dst_rep = [filler(2)]
        cons = dp_runner(dtype, 1, 2, devs[4:], dst_rep)
        d_ids = [(DP_NB - 1 - 2 * i) % DP_NB for i in range(nblocks)]
    else:
        src_rep = [[[req[r][l] for l in range(LAYERS)] for r in range(2)]]
        prod = dp_runner(dtype, 1, 2, devs, src_rep)
        s_ids = ids_local
        dst_rep = [filler(2), filler(2)]
        cons = dp_runner(dtype, 2, 2, devs[4:], dst_rep)
        d_ids = [DP_NB + (DP_NB - 1 - 2 * i) % DP_NB for i in range(nblocks)]  # into replica 1
    # From the inputs, not by reading the arrays: a jax.Array caches its host value once read,
    # and pjrt-view writes its memory behind JAX's back (a forward gives new arrays).
    def glob(rep):
        return [np.concatenate([np.concatenate([rep[d][r][layer] for r in range(2)], axis=2)
                                for d in range(len(rep))], axis=0) for layer in range(LAYERS)]

    before_src, before_dst = glob(src_rep), glob(dst_rep)
    client = tpu_sync.Client()
    pk = JaxKv(prod, backend=backend, client=client)
    ck = JaxKv(cons, backend=backend, client=client)
    assert (pk.dp, ck.dp) == ((2, 1) if src_dp else (1, 2))
    assert (pk.num_blocks, pk.tp) == (DP_NB, 2)
    assert (pk.ranks if src_dp else ck.ranks) == [0, 1, 2, 3]
    model = tpu_sync.model("tpu-inference-test", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=dtype)
    assert (pk if src_dp else ck).layout(model)["spec"]["dp"] == 2
    prod.forward()
    with tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=20, name="prefill") as pe, \
            tpu_sync.Endpoint(listen=None, timeout=20, name="decode") as de:
        src_place = pk.register(pe, 81, model, s_ids, TOKENS)
        assert src_place["dp_rank"] == (1 if src_dp else 0)
        prod.forward()
        report = ck.pull(de, 81, pe.address, src_place, model, d_ids, TOKENS, timeout_s=60)
    assert report["bytes"] == TOKENS * HEADS * 2 * DIM * 2 * LAYERS
    local_d = [b % DP_NB for b in d_ids]
    d_rep = 1 if not src_dp else 0
    for layer in range(LAYERS):
        want = before_dst[layer].copy()
        glob_req = np.concatenate([req[r][layer] for r in range(2)], axis=2)
        for t in range(TOKENS):
            want[d_rep * DP_NB + local_d[t // bs], t % bs] = glob_req[ids_local[t // bs], t % bs]
        got = host(cons.kv_caches[layer])
        assert np.array_equal(got, want), (layer, np.argwhere(got != want)[:4])
        assert np.array_equal(host(prod.kv_caches[layer]), before_src[layer]), f"layer {layer}: producer changed"
    # Ids of two replicas in one request are refused by name.
    with pytest.raises(tpu_sync.errors.InvalidArgumentError, match="DP replicas"):
        (pk if src_dp else ck).split([1, DP_NB + 1])


def test_data_axis_grouped_with_another_axis_counts_every_replica():
    """Attention DP may shard the blocks over the data axis grouped with another
    (``P(("data", "attn_dp"), None, "model")``): DP is the product of their sizes, every
    replica's shard maps to its own ranks, and a block of the last replica reads back its bytes
    (framework copies)."""
    devs = devices_or_skip(8)
    mesh = Mesh(np.array(devs[:8]).reshape(2, 2, 2), ("data", "attn_dp", "model"))
    nb = 16
    rng = np.random.default_rng(9)
    glob = rng.integers(1, 65535, size=(nb, 16, 8, 2, 128), dtype=np.uint16)
    a = jax.device_put(glob.view(ml_dtypes.bfloat16), NamedSharding(mesh, P(("data", "attn_dp"), None, "model")))
    k = JaxKv(Runner([a]), backend="framework-copy")
    assert (k.dp, k.tp, k.num_blocks, k.ranks) == (4, 2, 4, list(range(8)))
    assert k.split([13, 14]) == (3, [1, 2])
    got = k.gather([13, 14])
    assert sorted(got) == [6, 7]
    for t, r in enumerate((6, 7)):
        assert np.array_equal(got[r][0], glob[[13, 14], :, 4 * t:4 * (t + 1)]), r
