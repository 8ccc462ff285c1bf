"""``tpu_sync.torch_kv.TorchKv`` (issue 25): which back end a worker's KV tensors get and why,
and ``framework-copy`` byte-exact on torch CPU tensors, both copy APIs: blocks staged from the
tensors into the host mirrors (consecutive and scattered ids), mirrors committed into the
tensors, nothing else touched, mirror pages given back.

torch_tpu is never imported here (it would load libtpu). Its batched copies are stood in for by
:func:`install_batch_transfer_stand_in`: a module at ``torch_tpu._internal.batch_transfer`` with
the functions vLLM-TorchTPU 0.29.0's ``TPUConnector`` calls
(``vllm_torchtpu/distributed/kv_transfer/tpu_connector.py``: ``batch_transfer_d2h(device
tensors, host tensors)`` returning a future to ``wait()`` on, its ``_sync`` variant, and
``batch_transfer_h2d_sync(host tensors, device tensors)``), which copy with ``Tensor.copy_``
after checking the arguments as that call shape needs them (lists of equal length, pairwise
equal shapes and dtypes, host tensors on the CPU); the asynchronous D2H copies only when waited
for. The bytes are real tensors'
bytes either way; the stand-in replaces only the device runtime this machine lacks."""

import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tpu_sync  # noqa: E402
from tpu_sync import errors  # noqa: E402
from tpu_sync.torch_kv import TorchKv  # noqa: E402

NB, SHAPE = 12, (8, 2, 2, 128)  # blocks, then one block of an RPA v3 cache (fp8 4 KiB: whole pages)


def install_batch_transfer_stand_in(monkeypatch):
    """Puts the stand-in module at ``torch_tpu._internal.batch_transfer`` for this test; returns
    the list its calls are recorded in."""
    calls = []

    def check(src, dst, host_side):
        assert isinstance(src, list) and isinstance(dst, list) and len(src) == len(dst) > 0
        for s, d in zip(src, dst):
            assert s.shape == d.shape and s.dtype == d.dtype, (s.shape, d.shape, s.dtype, d.dtype)
            host = d if host_side == "dst" else s
            assert host.device.type == "cpu"

    def d2h(src, dst):
        check(src, dst, "dst")
        calls.append(("d2h", [tuple(s.shape) for s in src]))
        for s, d in zip(src, dst):
            d.copy_(s)

    def h2d(src, dst):
        check(src, dst, "src")
        calls.append(("h2d", [tuple(s.shape) for s in src]))
        for s, d in zip(src, dst):
            d.copy_(s)

    class Future:
        """``batch_transfer_d2h``'s future: the copy happens only in ``wait()`` here, so a reader
        that did not wait sees the mirror without the blocks."""

        def __init__(self, src, dst):
            self.pending = (src, dst)

        def wait(self):
            if self.pending is not None:
                for s, d in zip(*self.pending):
                    d.copy_(s)
                self.pending = None

    def d2h_async(src, dst):
        check(src, dst, "dst")
        calls.append(("d2h_async", [tuple(s.shape) for s in src]))
        return Future(src, dst)

    mod = types.ModuleType("torch_tpu._internal.batch_transfer")
    mod.batch_transfer_d2h_sync, mod.batch_transfer_h2d_sync = d2h, h2d
    mod.batch_transfer_d2h = d2h_async
    for name in ("torch_tpu", "torch_tpu._internal"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "torch_tpu._internal.batch_transfer", mod)
    return calls


def layers(seed, n=3, dtype=torch.bfloat16):
    """Per-layer caches of distinct, non-repeating bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = torch.empty((NB,) + SHAPE, dtype=dtype)
        t.view(torch.uint8).numpy()[:] = rng.integers(1, 256, size=t.numel() * t.element_size(),
                                                      dtype=np.uint8).reshape(t.view(torch.uint8).shape)
        out.append(t)
    return out


def raw(t):
    return t.view(torch.uint8).numpy().copy()


def test_back_end_follows_the_tensors_device():
    cpu = layers(1)
    tk = TorchKv(cpu)
    assert (tk.backend, tk.copy_api) == ("pjrt-view", "none")
    assert "host memory" in tk.backend_reason
    tk.close()
    # A tensor tpu_sync's client cannot address (torch's "meta" device stands for any accelerator
    # here): framework-copy, with torch's copies (batch_transfer only on a "tpu" device).
    meta = [torch.empty((NB,) + SHAPE, dtype=torch.bfloat16, device="meta") for _ in range(2)]
    tk = TorchKv(meta)
    assert (tk.backend, tk.copy_api) == ("framework-copy", "torch")
    assert "meta" in tk.backend_reason
    assert tk.stats()["device"] == "meta"
    with pytest.raises(errors.UnsupportedError, match="host memory"):
        TorchKv(meta, backend="pjrt-view")


def test_bad_tensors_and_settings_are_clear_errors(monkeypatch):
    a = layers(2, n=2)
    with pytest.raises(errors.InvalidArgumentError, match="differs"):
        TorchKv([a[0], a[1][:6]])
    # Blocks that are not contiguous inside: a logical view only framework copies can move.
    with pytest.raises(errors.InvalidArgumentError, match="contiguous"):
        TorchKv([a[0].transpose(1, 2)], backend="pjrt-view")
    assert TorchKv([a[0].transpose(1, 2)]).backend == "framework-copy"
    with pytest.raises(errors.InvalidArgumentError, match="dtype"):
        TorchKv([torch.zeros((NB, 4), dtype=torch.int64)])
    with pytest.raises(errors.InvalidArgumentError, match="backend"):
        TorchKv(a, backend="mmap")
    with pytest.raises(errors.InvalidArgumentError, match="copy_api"):
        TorchKv(a, copy_api="dma")
    with pytest.raises(errors.InvalidArgumentError, match="no KV tensors"):
        TorchKv([])
    monkeypatch.delitem(sys.modules, "torch_tpu._internal.batch_transfer", raising=False)
    with pytest.raises(errors.UnsupportedError, match="batch_transfer"):
        TorchKv(a, backend="framework-copy", copy_api="batch_transfer")
    tk = TorchKv(a, backend="framework-copy")
    with pytest.raises(IndexError, match="out of range"):
        tk.stage([NB])
    tk.close()


@pytest.mark.parametrize("api", ["torch", "batch_transfer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_framework_copy_stages_and_commits_exactly_the_blocks(monkeypatch, api, dtype):
    calls = install_batch_transfer_stand_in(monkeypatch) if api == "batch_transfer" else []
    kv = layers(3, dtype=dtype)
    before = [raw(t) for t in kv]
    tk = TorchKv(kv, backend="framework-copy", copy_api=api, block_size=4)
    assert (tk.backend, tk.copy_api) == ("framework-copy", api)
    views = tk.views()
    assert len(views) == 3
    bb = tk.block_bytes
    assert bb == int(np.prod(SHAPE)) * kv[0].element_size()
    # Stage consecutive ids, then scattered ones: the mirrors hold exactly those blocks.
    for ids in ([4, 5, 6], [9, 1, 7]):
        tk.stage(ids)
        for layer, v in enumerate(views):
            got = np.frombuffer(v.read(), dtype=np.uint8)
            for b in range(NB):
                want = before[layer][b].reshape(-1) if b in ids else np.zeros(bb, np.uint8)
                assert np.array_equal(got[b * bb:(b + 1) * bb], want), (ids, layer, b)
        tk.drop(ids)
    assert all(not np.frombuffer(v.read(), dtype=np.uint8).any() for v in views), "drop gave the pages back"
    # tpu_sync writes blocks into the mirrors (as a pull does); commit puts exactly those blocks
    # into the tensors, consecutive and scattered.
    rng = np.random.default_rng(4)
    new = rng.integers(1, 256, size=(3, NB, bb), dtype=np.uint8)
    for ids in ([2, 3], [11, 0, 8]):
        assert tk.before_write(ids, 2 * 4) == ()
        for layer, v in enumerate(views):
            for b in ids:
                v.write(b * bb, new[layer, b].tobytes())
        tk.after_write(ids)
    for layer, t in enumerate(kv):
        want = before[layer].copy()
        for b in (2, 3, 11, 0, 8):
            want[b] = new[layer, b].reshape(want[b].shape)
        assert np.array_equal(raw(t), want), layer
    st = tk.stats()
    assert (st["stages"], st["commits"]) == (2, 2)
    assert (st["d2h_bytes"], st["h2d_bytes"]) == (6 * bb * 3, 5 * bb * 3)
    if api == "batch_transfer":
        # One batched call per stage or commit, every layer in it.
        assert [c[0] for c in calls] == ["d2h_async", "d2h_async", "h2d", "h2d"]
        assert all(len(c[1]) == 3 for c in calls)
        assert calls[1][1][0] == (3,) + SHAPE and calls[3][1][0] == (3,) + SHAPE
    tk.close()


def test_a_partial_last_block_keeps_its_other_token_slots(monkeypatch):
    kv = layers(5, n=2)
    before = [raw(t) for t in kv]
    tk = TorchKv(kv, backend="framework-copy", block_size=4)
    views = tk.views()
    bb = tk.block_bytes
    # 6 tokens into blocks [7, 3]: block 3 gets 2 of its 4 token slots (the first half here).
    tk.before_write([7, 3], 6)
    for v in views:
        v.write(7 * bb, b"\x5a" * bb)
        v.write(3 * bb, b"\xa5" * (bb // 2))
    tk.after_write([7, 3])
    for layer, t in enumerate(kv):
        got = raw(t)
        assert (got[7] == 0x5A).all()
        assert (got[3].reshape(-1)[:bb // 2] == 0xA5).all()
        assert np.array_equal(got[3].reshape(-1)[bb // 2:], before[layer][3].reshape(-1)[bb // 2:])
        for b in set(range(NB)) - {3, 7}:
            assert np.array_equal(got[b], before[layer][b]), (layer, b)
    tk.close()


@pytest.mark.parametrize("api", ["torch", "batch_transfer"])
def test_kv_cache_groups_copy_each_layer_at_its_own_groups_blocks(monkeypatch, api):
    """Two KV cache groups (vLLM's hybrid allocator: layer 0 sliding window, layers 1 and 2 full
    attention) where layers 0 and 1 share one tensor, as vLLM binds the layers at one position of
    every group to the same memory: a stage reads, and a commit writes, each layer only at its own
    group's blocks (vLLM's null block 0 skipped), so the other group's blocks in the shared tensor
    stay as they were. Copying the union of the ids for every layer would write layer 1's (stale)
    mirror over blocks 5 and 9 of the shared tensor, which this test checks byte for byte."""
    calls = install_batch_transfer_stand_in(monkeypatch) if api == "batch_transfer" else []
    a, b = layers(11, n=2)
    kv = [a, a, b]  # layers 0 (group 0) and 1 (group 1) share tensor a
    before = {id(t): raw(t) for t in (a, b)}
    tk = TorchKv(kv, backend="framework-copy", copy_api=api, block_size=4, layer_group=[0, 1, 1])
    views = tk.views()
    bb = tk.block_bytes
    groups = [[0, 5, 9], [2, 3, 10]]  # the sliding group holds no block at position 0
    tk.stage(groups)
    for layer, v in enumerate(views):
        got = np.frombuffer(v.read(), dtype=np.uint8)
        own = [5, 9] if layer == 0 else [2, 3, 10]
        src = before[id(kv[layer])]
        for blk in range(NB):
            want = src[blk].reshape(-1) if blk in own else np.zeros(bb, np.uint8)
            assert np.array_equal(got[blk * bb:(blk + 1) * bb], want), (layer, blk)
    tk.drop(groups)
    # A pull into both groups: tpu_sync writes each layer's own blocks into its mirror.
    rng = np.random.default_rng(12)
    new = rng.integers(1, 256, size=(3, NB, bb), dtype=np.uint8)
    dst = [[0, 6, 1], [4, 7, 8]]
    assert tk.before_write(dst, 12) == ()
    for layer, v in enumerate(views):
        for blk in (dst[0] if layer == 0 else dst[1]):
            if blk:
                v.write(blk * bb, new[layer, blk].tobytes())
    tk.after_write(dst)
    want_a, want_b = before[id(a)].copy(), before[id(b)].copy()
    for blk in (6, 1):
        want_a[blk] = new[0, blk].reshape(want_a[blk].shape)
    for blk in (4, 7, 8):
        want_a[blk] = new[1, blk].reshape(want_a[blk].shape)
        want_b[blk] = new[2, blk].reshape(want_b[blk].shape)
    assert np.array_equal(raw(a), want_a)
    assert np.array_equal(raw(b), want_b)
    st = tk.stats()
    assert (st["stages"], st["commits"]) == (1, 1)
    assert (st["d2h_bytes"], st["h2d_bytes"]) == ((2 + 3 * 2) * bb, (2 + 3 * 2) * bb)
    if api == "batch_transfer":
        # One batched call per stage or commit for every group's layers (each at its own ids).
        assert [(c[0], len(c[1])) for c in calls] == [("d2h_async", 3), ("h2d", 3)]
    with pytest.raises(errors.InvalidArgumentError, match="3 KV cache groups; the layers are in 2"):
        tk.stage([[1], [2], [3]])
    with pytest.raises(IndexError):
        tk.commit([[NB], [1]])
    # One list for layers of two groups would copy each layer at the other group's blocks too.
    with pytest.raises(errors.InvalidArgumentError, match="flat list of block ids for layers in 2 KV cache groups"):
        tk.commit([5])
    with pytest.raises(errors.InvalidArgumentError, match="without a gap"):
        TorchKv(kv, backend="framework-copy", layer_group=[0, 2, 2])
    tk.close()


def test_connector_settings_are_validated():
    pytest.importorskip("vllm")
    from tpu_sync.vllm.config import ConfigError, ConnectorConfig

    with pytest.raises(ConfigError, match="torch_backend"):
        ConnectorConfig.parse("kv_both", {"torch_backend": "dma"})
    with pytest.raises(ConfigError, match="torch_copy_api"):
        ConnectorConfig.parse("kv_both", {"torch_copy_api": "nccl"})
    with pytest.raises(ConfigError, match="jax_backend"):
        ConnectorConfig.parse("kv_both", {"jax_backend": "view"})
    cfg = ConnectorConfig.parse("kv_both", {"torch_backend": "framework-copy", "torch_copy_api": "batch_transfer"})
    assert cfg.extra["torch_backend"] == "framework-copy"


def test_mirror_memory_is_given_back_once_nothing_is_in_flight():
    """Blocks smaller than a page share pages: a dropped block's page stays while a neighbour is
    in flight, and every page goes back once none is."""
    small = (2, 2, 2, 128)  # fp8: 1 KiB blocks, 4 per page
    rng = np.random.default_rng(9)
    kv = [torch.from_numpy(rng.integers(1, 256, size=(NB,) + small, dtype=np.uint8)).view(torch.float8_e4m3fn)
          for _ in range(2)]
    tk = TorchKv(kv, backend="framework-copy", block_size=4)
    bufs = tk.views()
    bb = tk.block_bytes
    tk.stage([1, 2])
    tk.drop([1])  # block 2 (same page) still in flight: its bytes stay
    for v, t in zip(bufs, kv):
        got = np.frombuffer(v.read(), dtype=np.uint8)
        assert np.array_equal(got[2 * bb:3 * bb], t.view(torch.uint8).numpy()[2].reshape(-1))
    tk.drop([2])
    assert all(not np.frombuffer(v.read(), dtype=np.uint8).any() for v in bufs), "every page given back"
    # A pull's blocks are held from before_write to after_write.
    tk.before_write([5, 6], 6)  # partial: block 6 staged first
    tk.stage([9])
    tk.drop([9])
    got = np.frombuffer(bufs[0].read(), dtype=np.uint8)
    assert np.array_equal(got[6 * bb:7 * bb], kv[0].view(torch.uint8).numpy()[6].reshape(-1))
    tk.after_write([5, 6])
    assert all(not np.frombuffer(v.read(), dtype=np.uint8).any() for v in bufs)
    tk.close()


def test_strided_views_of_a_block_major_bundle(monkeypatch):
    """Per-layer views ``bundle[:, layer]`` of a ``[blocks, layers, ...]`` bundle (vLLM-TorchTPU's
    ``VLLM_TPU_BLOCK_MAJOR_KV``): framework-copy chosen even on the CPU (a PJRT buffer cannot view
    them), per-layer contiguous mirrors, and a commit writes exactly its blocks of its layer
    into the bundle."""
    rng = np.random.default_rng(7)
    bundle = torch.empty((NB, 3) + SHAPE, dtype=torch.bfloat16)
    bundle.view(torch.uint8).numpy()[:] = rng.integers(1, 256, size=bundle.view(torch.uint8).shape, dtype=np.uint8)
    before = bundle.view(torch.uint8).numpy().copy()
    views = [bundle[:, i] for i in range(3)]
    tk = TorchKv(views, block_size=4)
    assert tk.backend == "framework-copy" and tk.strided and "strided" in tk.backend_reason
    assert tk.block_bytes == int(np.prod(SHAPE)) * 2
    with pytest.raises(errors.InvalidArgumentError, match="contiguous"):
        TorchKv(views, backend="pjrt-view")
    # Blocks overlapping each other are refused.
    t0 = bundle[:, 0]
    with pytest.raises(errors.InvalidArgumentError, match="strides"):
        TorchKv([t0.as_strided(t0.shape, (int(np.prod(SHAPE)) // 2,) + tuple(t0.stride()[1:]))])
    bufs = tk.views()
    bb = tk.block_bytes
    tk.stage([6, 2])
    for layer, v in enumerate(bufs):
        got = np.frombuffer(v.read(), dtype=np.uint8)
        for b in (6, 2):
            assert np.array_equal(got[b * bb:(b + 1) * bb], before[b, layer].reshape(-1)), (layer, b)
    new = rng.integers(1, 256, size=(3, bb), dtype=np.uint8)
    for layer, v in enumerate(bufs):
        v.write(10 * bb, new[layer].tobytes())
    tk.after_write([10])
    want = before.copy()
    for layer in range(3):
        want[10, layer] = new[layer].reshape(want[10, layer].shape)
    assert np.array_equal(bundle.view(torch.uint8).numpy(), want)
    tk.close()


@pytest.mark.parametrize("copy_api", ["torch", "batch_transfer"])
def test_a_bundle_moves_every_layer_of_a_block_in_one_copy(monkeypatch, copy_api):
    """The per-layer views of one bundle, in layer order: each device copy moves every layer of
    its blocks (a stage of blocks 6, 2 and 3: one copy per run with ``Tensor.copy_``, one
    batched D2H of ``[3, layers, ...]``; a commit likewise), byte-exact in both directions, only
    those blocks written. Views in another order, or of a part of the layers, get one copy per
    layer and the same bytes."""
    calls = install_batch_transfer_stand_in(monkeypatch) if copy_api == "batch_transfer" else []
    rng = np.random.default_rng(17)
    bundle = torch.empty((NB, 3) + SHAPE, dtype=torch.bfloat16)
    bundle.view(torch.uint8).numpy()[:] = rng.integers(1, 256, size=bundle.view(torch.uint8).shape, dtype=np.uint8)
    before = bundle.view(torch.uint8).numpy().copy()
    for order, wide in (([0, 1, 2], True), ([1, 0, 2], False), ([0, 1], False)):
        tk = TorchKv([bundle[:, i] for i in order], backend="framework-copy", copy_api=copy_api, block_size=8)
        assert (tk.bundle is not None) == wide and tk.stats()["bundle_wide"] == wide, order
        if wide:
            assert tk.bundle.data_ptr() == bundle.data_ptr() and tuple(tk.bundle.shape) == tuple(bundle.shape)
        bufs, bb = tk.views(), tk.block_bytes
        del calls[:]
        tk.stage([6, 2, 3])
        runs = 2  # [6], [2, 3]
        per_op = 1 if copy_api == "batch_transfer" else runs
        assert tk.stats()["device_copies"] == (per_op if wide else per_op * len(order)), (order, tk.stats())
        if copy_api == "batch_transfer":
            assert calls[0][1] == ([(3, 3) + SHAPE] if wide else [(3,) + SHAPE] * len(order)), calls
        for i, layer in enumerate(order):
            got = np.frombuffer(bufs[i].read(), dtype=np.uint8)
            for b in (6, 2, 3):
                assert np.array_equal(got[b * bb:(b + 1) * bb], before[b, layer].reshape(-1)), (order, layer, b)
        tk.drop([6, 2, 3])
        new = rng.integers(1, 256, size=(len(order), 2, bb), dtype=np.uint8)
        tk.before_write([10, 4], 16)
        for i in range(len(order)):
            bufs[i].write(10 * bb, new[i, 0].tobytes())
            bufs[i].write(4 * bb, new[i, 1].tobytes())
        copies = tk.stats()["device_copies"]
        tk.after_write([10, 4])
        assert tk.stats()["device_copies"] - copies == (per_op if wide else per_op * len(order)), (order, tk.stats())
        want = before.copy()
        for i, layer in enumerate(order):
            want[10, layer] = new[i, 0].reshape(want[10, layer].shape)
            want[4, layer] = new[i, 1].reshape(want[4, layer].shape)
        assert np.array_equal(bundle.view(torch.uint8).numpy(), want), order
        assert tk.stats()["h2d_bytes"] == 2 * bb * len(order)
        tk.close()
        # The next order starts from this one's bytes.
        before = want


def test_the_cpu_client_refuses_to_view_an_accelerator_tensor():
    """A device tensor's data pointer is not host memory: the CPU plugin's client refuses to view
    it (what the SGLang and vLLM integrations would otherwise have done with CUDA or torch_tpu
    tensors), naming the way that works."""
    t = torch.empty((NB,) + SHAPE, dtype=torch.bfloat16, device="meta")
    with pytest.raises(errors.UnsupportedError, match="framework-copy"):
        tpu_sync.Client().view(t)


def test_stage_async_issues_now_and_completes_in_finish(monkeypatch):
    """``stage_async`` with batch_transfer: the D2H is issued on the calling thread and the
    mirrors hold the blocks only after ``finish()`` (here called on another thread, as the
    worker's saver does); the blocks stay in flight until dropped."""
    import threading

    calls = install_batch_transfer_stand_in(monkeypatch)
    kv = layers(11, n=2)
    tk = TorchKv(kv, backend="framework-copy", copy_api="batch_transfer", block_size=4)
    bufs = tk.views()
    bb = tk.block_bytes
    finish = tk.stage_async([3, 8])
    assert calls == [("d2h_async", [(2,) + SHAPE, (2,) + SHAPE])]
    assert not np.frombuffer(bufs[0].read(), dtype=np.uint8).any(), "nothing before finish()"
    t = threading.Thread(target=finish)
    t.start()
    t.join()
    for v, layer in zip(bufs, kv):
        got = np.frombuffer(v.read(), dtype=np.uint8)
        for b in (3, 8):
            assert np.array_equal(got[b * bb:(b + 1) * bb], layer.view(torch.uint8).numpy()[b].reshape(-1))
    assert tk.stats()["stages"] == 1
    tk.drop([3, 8])
    assert not any(np.frombuffer(v.read(), dtype=np.uint8).any() for v in bufs)
    tk.close()
