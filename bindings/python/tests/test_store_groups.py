"""The host tier's KV cache groups through the Python API (``Store.lookup_groups`` /
``pin_groups`` / ``put_groups_from_device`` / ``get_groups_to_device``, over
``tpu_sync::store::groups``): a sliding-window group (window 48 tokens) and a full-attention
group of a two-layer model at 32 tokens per block, real XLA CPU PJRT buffers. A prefix is a hit
only when every group's part it needs is present: a window part removed reports the shorter
hit, a get delivers only whole leading parts with their own bytes (never another prefix's),
and a re-attached shm segment serves the same hits with the same bytes."""

import uuid

import pytest

import tpu_sync
from tpu_sync import errors

BT = 32  # tokens per block
NB = 8  # blocks per layer buffer
LBB = 2 * BT * 64 * 4  # one block of one layer: [2 heads, 32 tokens, K|V 64] f32
GROUPS = [dict(role="window", window_tokens=48, part_bytes=LBB), dict(role="full", part_bytes=LBB)]


def store(client, **kw):
    return tpu_sync.Store(namespace="py-test groups sw48:0;full:1", block_bytes=LBB, capacity_bytes=64 * LBB,
                          lock_memory=False, populate=False, client=client, **kw)


def part(buf, block):
    return [(buf, block * LBB, LBB)]


def parts(layers, ids):
    """Parts ``(block index, group, pieces)``: group ``g`` (layer ``g``) of chain block ``i``
    in device block ``ids[g][i]`` (None: no part)."""
    return [(i, g, part(layers[g], b)) for g in (1, 0) for i, b in enumerate(ids[g]) if b is not None]


def test_grouped_prefix_rule_and_warm_restart(data):
    c = tpu_sync.Client(cpu_devices=1)
    src = [c.buffer_from_host(data(NB * LBB, 70 + layer), shape=(NB, 2, BT, 64), dtype="f32") for layer in (0, 1)]
    other = [c.buffer_from_host(data(NB * LBB, 80 + layer), shape=(NB, 2, BT, 64), dtype="f32") for layer in (0, 1)]
    dst = [c.buffer_from_host(bytes(NB * LBB), shape=(NB, 2, BT, 64), dtype="f32") for _ in (0, 1)]
    name = f"tpusync-groups-{uuid.uuid4().hex[:8]}"
    src_b = [b.read() for b in src]
    try:
        with store(c, shm_name=name) as s:
            a = s.chain_keys(list(range(4 * BT)), BT)
            b = s.chain_keys(list(range(5000, 5000 + 4 * BT)), BT)
            # a: every full part; window parts of blocks 1..3 (a window of 48 tokens at the end
            # of block 3, tokens [81, 128), needs blocks 2 and 3).
            r = s.put_groups_from_device(GROUPS, BT, a, parts(src, [[None, 1, 2, 3], [4, 5, 6, 7]]))
            assert r["stored"] == 7 and r["full_at"] is None and r["missed"] == 0, r
            assert s.put_groups_from_device(GROUPS, BT, b, parts(other, [[0, 1, 2, 3], [4, 5, 6, 7]]))["stored"] == 8
            assert s.lookup_groups(GROUPS, BT, a) == 4 and s.lookup_groups(GROUPS, BT, b) == 4
            # Bad input is refused: a full part missing, a part of the wrong size, a bad role.
            with pytest.raises(errors.InvalidArgumentError):
                s.put_groups_from_device(GROUPS, BT, b[:1], parts(other, [[0], [None]]))
            with pytest.raises(errors.InvalidArgumentError):
                s.put_groups_from_device(GROUPS, BT, b[:1], [(0, 1, [(other[1], 0, LBB - 4)])])
            with pytest.raises(errors.InvalidArgumentError):
                s.lookup_groups([dict(role="sliding", part_bytes=LBB)], BT, a)
            # The window group's part of block 3 of a goes (group 0's part is the block key
            # itself): a prefix of 4 blocks lacks a window part; 3 blocks (window [49, 96):
            # blocks 1, 2) is the hit.
            assert s.remove([a[3]]) >= 1
            assert s.lookup_groups(GROUPS, BT, a) == 3 and s.lookup_groups(GROUPS, BT, b) == 4
            assert s.pin_groups(GROUPS, BT, a, 4) is None
            lease = s.pin_groups(GROUPS, BT, a, 3)
            assert lease is not None
            # Load a's prefix of 3 into other blocks: full blocks 0..2, window blocks 1, 2;
            # then the missing window part of block 3: the get stops there, its destination
            # untouched (never b's bytes).
            want = [bytearray(NB * LBB) for _ in (0, 1)]
            got = s.get_groups_to_device(GROUPS, BT, a, parts(dst, [[None, 6, 7, 5], [0, 1, 2, None]]))
            assert got.delivered == 5, got  # 3 full parts, 2 window parts, not block 3's
            for g, (s_ids, d_ids) in enumerate((([1, 2], [6, 7]), ([4, 5, 6], [0, 1, 2]))):
                for sb, db in zip(s_ids, d_ids):
                    want[g][db * LBB:(db + 1) * LBB] = src_b[g][sb * LBB:(sb + 1) * LBB]
            assert [d.read() for d in dst] == [bytes(w) for w in want]
            lease.close()
        # Warm restart: the segment re-attached serves the same hits and bytes.
        with store(c, shm_name=name) as s:
            s.wait_ready(30)
            assert s.lookup_groups(GROUPS, BT, a) == 3 and s.lookup_groups(GROUPS, BT, b) == 4
            got = s.get_groups_to_device(GROUPS, BT, b, parts(dst, [[None, None, 3, 4], [0, 1, 2, 5]]))
            assert got.delivered == 6, got
            ob = [x.read() for x in other]
            for g, (s_ids, d_ids) in enumerate((([2, 3], [3, 4]), ([4, 5, 6, 7], [0, 1, 2, 5]))):
                for sb, db in zip(s_ids, d_ids):
                    want[g][db * LBB:(db + 1) * LBB] = ob[g][sb * LBB:(sb + 1) * LBB]
            assert [d.read() for d in dst] == [bytes(w) for w in want]
    finally:
        try:
            tpu_sync.remove_segment(name, force=True)
        except Exception:
            pass
        for x in src + other + dst:
            x.close()
        c.close()


SB = 3 * 288 * 4 + 4 * 64 * 16 * 4  # a Mamba2 layer's state slot: conv (3, 288) + SSM (4, 64, 16) f32
NS = 6  # state slots in the state buffer
STATE_GROUPS = [dict(role="state", part_bytes=SB), dict(role="full", part_bytes=LBB)]


def test_state_part_belongs_to_the_block_it_was_taken_at(data):
    """A Mamba-style state group beside a full-attention group: a state part is stored at the
    block after which the state was taken, and a prefix of ``n`` blocks needs the state part of
    block ``n - 1``. With state parts at blocks 1 and 3 of a, the hit is 4 blocks; once block
    3's state part is gone it is 2 (block 2 has none), never 3, and a get of that prefix gives
    a's own state slot, never b's."""
    c = tpu_sync.Client(cpu_devices=1)
    kv = c.buffer_from_host(data(NB * LBB, 90), shape=(NB, 2, BT, 64), dtype="f32")
    states = c.buffer_from_host(data(NS * SB, 91), shape=(NS, SB // 4), dtype="f32")
    other_states = c.buffer_from_host(data(NS * SB, 92), shape=(NS, SB // 4), dtype="f32")
    dst_kv = c.buffer_from_host(bytes(NB * LBB), shape=(NB, 2, BT, 64), dtype="f32")
    dst_states = c.buffer_from_host(bytes(NS * SB), shape=(NS, SB // 4), dtype="f32")
    kv_b, st_b, ost_b = kv.read(), states.read(), other_states.read()
    try:
        with tpu_sync.Store(namespace="py-test groups state:0;full:1", block_bytes=LBB, capacity_bytes=64 * LBB,
                            lock_memory=False, populate=False, client=c) as s:
            a = s.chain_keys(list(range(4 * BT)), BT)
            b = s.chain_keys(list(range(7000, 7000 + 4 * BT)), BT)

            def put(keys, state_buf, at):
                ps = [(i, 1, [(kv, (4 + i) * LBB, LBB)]) for i in range(4)]
                ps += [(i, 0, [(state_buf, slot * SB, SB)]) for i, slot in at.items()]
                return s.put_groups_from_device(STATE_GROUPS, BT, keys, ps)

            # (A state part larger than one tier block takes several slots: ``stored`` counts
            # slots, ``bytes`` the parts' bytes.)
            assert put(a, states, {1: 2, 3: 4})["bytes"] == 4 * LBB + 2 * SB
            assert put(b, other_states, {0: 0, 1: 1, 2: 2, 3: 3})["bytes"] == 4 * LBB + 4 * SB
            assert s.lookup_groups(STATE_GROUPS, BT, a) == 4
            assert s.lookup_groups(STATE_GROUPS, BT, a[:3]) == 2  # block 2 holds no state
            assert s.lookup_groups(STATE_GROUPS, BT, b) == 4
            # A state part of the wrong size is refused, nothing stored.
            with pytest.raises(errors.InvalidArgumentError):
                s.put_groups_from_device(STATE_GROUPS, BT, a[:1], [(0, 1, [(kv, 0, LBB)]),
                                                                   (0, 0, [(states, 0, SB - 4)])])
            assert s.remove([a[3]]) >= 1  # the state part taken after block 3
            assert s.lookup_groups(STATE_GROUPS, BT, a) == 2
            assert s.pin_groups(STATE_GROUPS, BT, a, 3) is None
            lease = s.pin_groups(STATE_GROUPS, BT, a, 2)
            assert lease is not None
            got = s.get_groups_to_device(STATE_GROUPS, BT, a, [(0, 1, [(dst_kv, 0, LBB)]),
                                                               (1, 1, [(dst_kv, LBB, LBB)]),
                                                               (1, 0, [(dst_states, 5 * SB, SB)])])
            assert got.delivered == 3, got
            lease.close()
            want_kv = bytearray(NB * LBB)
            want_kv[:2 * LBB] = kv_b[4 * LBB:6 * LBB]
            want_st = bytearray(NS * SB)
            want_st[5 * SB:] = st_b[2 * SB:3 * SB]  # a's state after block 1 (slot 2), not b's
            assert dst_kv.read() == bytes(want_kv)
            assert dst_states.read() == bytes(want_st)
            assert bytes(want_st[5 * SB:]) != ost_b[1 * SB:2 * SB]
    finally:
        for x in (kv, states, other_states, dst_kv, dst_states):
            x.close()
        c.close()
