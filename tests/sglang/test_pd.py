"""The data path of the tpu_sync P/D backend without engines: SGLang's real device KV pools
(``MHATokenToKVPool`` on CPU) as zero-copy typed views, the backend's layouts and placements,
and :class:`tpu_sync.Endpoint` register/pull between them, resharded from TP=2 to TP=1 and
from TP=1 to TP=2, byte-exact; the reshard pairs the backend derives its expected releases and
pull sources from; a pull of an unknown request fails and writes nothing."""

import pytest
import torch

import tpu_sync
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from pools import pattern
from tpu_sync.sglang import pd
from tpu_sync.sglang._devpool import DevicePool

PAGE, LAYERS, HEADS, DIM, TOKENS = 16, 2, 2, 32, 256


def pool(heads, seed):
    p = MHATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.float32, head_num=heads, head_dim=DIM,
                         layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    for i, t in enumerate(list(p.k_buffer) + list(p.v_buffer)):
        t.copy_(pattern(tuple(t.shape), seed + i))
    return p


def geometry(dev):
    return dict(buffers=dev.planes * dev.layers, kv_heads=HEADS, head_dim=dev.head_dim, dtype=dev.layout_dtype,
                page_size=dev.page_size)


def rows(p, plane, layer, page):
    t = (p.k_buffer if plane == 0 else p.v_buffer)[layer]
    return t[page * PAGE:(page + 1) * PAGE]


def test_pull_pairs():
    g = dict(buffers=4, kv_heads=2, head_dim=DIM, dtype="f32", page_size=PAGE)

    def pairs(src_tp, dst_tp):
        src = pd.placement_of(pd.layout_of(g, src_tp, 17), [3, 4])
        dst = pd.placement_of(pd.layout_of(g, dst_tp, 17), [5, 6])
        return pd.pull_pairs(src, dst, 2 * PAGE)

    assert pairs(1, 1) == {0: [0]}
    assert pairs(2, 1) == {0: [0, 1]}
    assert pairs(1, 2) == {0: [0], 1: [0]}
    assert pairs(2, 2) == {0: [0], 1: [1]}
    # TP=4 over 2 heads replicates them: one replica of each head is pulled.
    four = pairs(4, 1)[0]
    assert len(four) == 2, four


def test_request_ids():
    assert pd.request_id_of(0) == 1
    assert 1 <= pd.request_id_of(2 ** 63 - 1) <= (1 << 53) - 1
    assert pd.request_id_of(2005) == pd.request_id_of(2005)


def _transfer(src_pools, dst_pools, src_pages, dst_pages):
    """Registers ``src_pages`` of every source rank (one endpoint each, as separate prefill
    ranks) and pulls them into every destination rank's ``dst_pages``."""
    src_devs = [DevicePool(p) for p in src_pools]
    dst_devs = [DevicePool(p) for p in dst_pools]
    n = len(src_pages) * PAGE
    src = pd.placement_of(pd.layout_of(geometry(src_devs[0]), len(src_pools), src_devs[0].num_pages), src_pages)
    dst = pd.placement_of(pd.layout_of(geometry(dst_devs[0]), len(dst_pools), dst_devs[0].num_pages), dst_pages)
    pairs = pd.pull_pairs(src, dst, n)
    prefill = [tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=20) for _ in src_pools]
    decode = tpu_sync.Endpoint(listen=None, timeout=20)
    try:
        for r, (ep, dev) in enumerate(zip(prefill, src_devs)):
            pullers = sum(1 for srcs in pairs.values() if r in srcs)
            ep.register(77, src, n, {r: dev.typed_views()}, expected_releases=pullers)
        stats = []
        for d, dev in enumerate(dst_devs):
            peers = {s: prefill[s].address for s in pairs[d]}
            stats.append(decode.pull(77, peers, src, dst, n, {d: dev.typed_views()}).wait(30))
        return stats
    finally:
        decode.close()
        for ep in prefill:
            ep.close()


def test_tp2_prefill_to_tp1_decode_byte_exact():
    srcs = [pool(1, 10), pool(1, 20)]  # prefill rank r holds KV head r
    dst = pool(HEADS, 90)
    src_pages, dst_pages = [3, 5, 6], [7, 1, 2]
    untouched = rows(dst, 0, 0, 4).clone()
    (st,) = _transfer(srcs, [dst], src_pages, dst_pages)
    assert st["device_bytes"] == len(dst_pages) * 2 * LAYERS * PAGE * HEADS * DIM * 4
    for plane in (0, 1):
        for layer in range(LAYERS):
            for sp, dp in zip(src_pages, dst_pages):
                for h, src in enumerate(srcs):
                    assert torch.equal(rows(dst, plane, layer, dp)[:, h], rows(src, plane, layer, sp)[:, 0])
    assert torch.equal(rows(dst, 0, 0, 4), untouched)  # nothing outside the request's pages


def test_tp1_prefill_to_tp2_decode_byte_exact():
    src = pool(HEADS, 30)
    dsts = [pool(1, 60), pool(1, 70)]
    src_pages, dst_pages = [2, 9], [4, 8]
    _transfer([src], dsts, src_pages, dst_pages)
    for plane in (0, 1):
        for layer in range(LAYERS):
            for sp, dp in zip(src_pages, dst_pages):
                for h, dst in enumerate(dsts):
                    assert torch.equal(rows(dst, plane, layer, dp)[:, 0], rows(src, plane, layer, sp)[:, h])


def test_pull_of_an_unregistered_request_fails_and_writes_nothing():
    dst = pool(HEADS, 40)
    dev = DevicePool(dst)
    before = rows(dst, 1, 1, 3).clone()
    src = pd.placement_of(pd.layout_of(geometry(dev), 1, dev.num_pages), [1])
    dstp = pd.placement_of(pd.layout_of(geometry(dev), 1, dev.num_pages), [3])
    prefill = tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=10)
    decode = tpu_sync.Endpoint(listen=None, timeout=10)
    try:
        t = decode.pull(99, prefill.address, src, dstp, PAGE, {0: dev.typed_views()})
        with pytest.raises(tpu_sync.TpuSyncError):
            t.wait(30)
        assert t.error is not None
    finally:
        decode.close()
        prefill.close()
    assert torch.equal(rows(dst, 1, 1, 3), before)


def test_hooks_add_the_backend():
    from sglang.srt.arg_groups import choices
    from sglang.srt.plugins import load_plugins

    load_plugins()  # the tpu_sync entry point installs the hooks
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    assert "tpu_sync" in choices.DISAGG_TRANSFER_BACKEND_CHOICES
    tb = TransferBackend("tpu_sync")
    assert get_kv_class(tb, KVClassType.MANAGER) is pd.TpuSyncKVManager
    assert get_kv_class(tb, KVClassType.RECEIVER) is pd.TpuSyncKVReceiver
    assert get_kv_class(tb, KVClassType.SENDER) is pd.TpuSyncKVSender
    assert get_kv_class(tb, KVClassType.BOOTSTRAP_SERVER) is pd.TpuSyncKVBootstrapServer
    # SGLang's own backends are untouched.
    from sglang.srt.disaggregation.fake import FakeKVManager

    assert get_kv_class(TransferBackend("fake"), KVClassType.MANAGER) is FakeKVManager


def test_metadata_rows_from_the_wire_are_checked_before_any_copy():
    """Issue 24: a prefill's READY carries a metadata row and its item lengths; the decode copies
    it into its own metadata buffers only after checking every length and index, so a short row
    (a heap over-read before the fix), a length that differs from ours, a negative or
    non-integer length, or a row index outside the buffers is refused with a clear error."""
    item_lens = [8, 16]
    data_lens = [8 * 4, 16 * 4]
    row = bytes(range(1, 25))
    assert pd.aux_copies(row, [8, 16], item_lens, data_lens, 3) == [(0, 24, 0, 8), (1, 48, 8, 16)]
    with pytest.raises(ValueError, match="shorter than its items"):
        pd.aux_copies(row[:20], [8, 16], item_lens, data_lens, 0)
    with pytest.raises(ValueError, match="prefill item 9 bytes"):
        pd.aux_copies(row, [9, 16], item_lens, data_lens, 0)
    with pytest.raises(ValueError, match="list of ints"):
        pd.aux_copies(row, [8, "16"], item_lens, data_lens, 0)
    with pytest.raises(ValueError, match="prefill item -8 bytes"):
        pd.aux_copies(row, [-8, 16], item_lens, data_lens, 0)
    with pytest.raises(ValueError, match="outside buffer 0"):
        pd.aux_copies(row, [8, 16], item_lens, data_lens, 4)
    with pytest.raises(ValueError, match="is not a row"):
        pd.aux_copies(row, [8, 16], item_lens, data_lens, -1)
    with pytest.raises(ValueError, match="not bytes"):
        pd.aux_copies("x" * 24, [8, 16], item_lens, data_lens, 0)


def test_peer_registrations_and_waiting_rooms_are_bounded(monkeypatch):
    """Issue 24, item 7: what decode peers' messages make a prefill keep is bounded. Registered
    decode peers past ``MAX_DECODE_PEERS`` and rooms waiting past ``MAX_PENDING_ROOMS`` are refused
    (the caps lowered here to 2 and 3), a re-registration of a known peer is not a new one, a TP
    rank outside its size, more ranks than announced for a room, or a rank count outside
    1..``MAX_RANKS`` are refused; what was accepted before stays. The prefill's control handlers
    run on a manager without an engine (only the state they touch is set up)."""
    import json
    import threading

    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll

    monkeypatch.setattr(pd, "MAX_DECODE_PEERS", 2)
    monkeypatch.setattr(pd, "MAX_PENDING_ROOMS", 3)
    g = dict(buffers=4, planes=2, layers=2, kv_heads=HEADS, head_dim=DIM, dtype="f32", page_size=PAGE, mla=False)
    m = object.__new__(pd.TpuSyncKVManager)
    m.geometry = lambda: g
    m._lock = threading.Lock()
    m._decode_peers, m.transfer_infos, m.req_to_decode_prefix_len = {}, {}, {}
    failed, statuses = {}, {}
    m._fail = lambda room, why: failed.__setitem__(room, why)
    m.update_status = lambda room, st: statuses.__setitem__(room, st)
    m._count = lambda **kw: None

    def reg(port, rank=0, size=1):
        return [pd.REG_TAG, b"10.0.0.1", str(port).encode(), str(rank).encode(), str(size).encode(),
                json.dumps(g).encode()]

    def meta(room, port, ranks):
        return [pd.META_TAG, str(room).encode(), b"10.0.0.1", str(port).encode(), b"0",
                np.arange(4, dtype=np.int32).tobytes(), b"", str(ranks).encode(), b"0", b"0"]

    m._on_register(reg(7001))
    m._on_register(reg(7002))
    m._on_register(reg(7001))
    with pytest.raises(ValueError, match="2 decode peers are registered"):
        m._on_register(reg(7003))
    with pytest.raises(ValueError, match="TP rank 5 of 2"):
        m._on_register(reg(7003, 5, 2))
    with pytest.raises(ValueError, match="TP rank 0 of 5000"):
        m._on_register(reg(7003, 0, 5000))
    assert sorted(m._decode_peers) == [("10.0.0.1", 7001), ("10.0.0.1", 7002)]

    for room in (1, 2, 3):
        m._on_meta(meta(room, 7001, 2))
    with pytest.raises(ValueError, match="3 rooms are waiting"):
        m._on_meta(meta(4, 7001, 2))
    for n in (0, pd.MAX_RANKS + 1):
        with pytest.raises(ValueError, match="decode ranks announced"):
            m._on_meta(meta(5, 7001, n))
    m._on_meta(meta(1, 7002, 2))
    assert statuses == {1: KVPoll.WaitingForInput}
    with pytest.raises(ValueError, match="more decode ranks than the 2 announced"):
        m._on_meta(meta(1, 7003, 2))
    assert sorted(m.transfer_infos) == [1, 2, 3]
    assert sorted(m.transfer_infos[1]) == [("10.0.0.1", 7001), ("10.0.0.1", 7002)]
    assert failed == {}
