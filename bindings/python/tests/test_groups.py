"""KV cache groups (hybrid models) through the Python API: ``tpu_sync.hybrid_model`` /
``layout`` / ``placement`` build the groups form; a pull between two endpoints over loopback TCP
is byte-exact (the plan's spans copied, every other byte unchanged) with buffers of different
shapes per group; a buffer of another group's shape is refused with ``MismatchError``; a
consumer whose groups differ (another sliding window) is refused by the producer at the
handshake before any byte moves, and the producer still serves the right consumer. The real
XLA CPU plugin."""

import time

import pytest

import tpu_sync
from tpu_sync import errors

TOKENS = 40


def model(window=8):
    attn = dict(type="attention", num_kv_heads=2, head_dim=4, dtype="bf16")
    return tpu_sync.hybrid_model("tiny", [
        dict(name="sliding", layers=[0, 2], kind=dict(attn, sliding_window=window)),
        dict(name="full", layers=[1], kind=attn),
        dict(name="linear", layers=[3], kind=dict(type="state", components=[
            dict(name="conv", dtype="bf16", rows=3, segments=[dict(heads=2, head_elems=4)]),
            dict(name="ssm", dtype="f32", segments=[dict(heads=2, head_elems=16)])])),
    ])


def layout(window=8):
    # Different block counts per group: 4 (sliding), 6 (full), 3 state slots.
    return tpu_sync.layout(model(window), block_size=16, num_blocks=[4, 6, 3])


# 40 tokens: the full group's 3 blocks; the 8-token window [33, 40) lies in block 2 only; one slot.
SRC = tpu_sync.placement(layout(), [[[3]], [[4, 1, 5]], [[2]]])
DST = tpu_sync.placement(layout(), [[[1]], [[2, 0, 3]], [[0]]])
# Per cache layer: (dims, dtype, bytes). Attention NHD [planes, blocks, tokens, heads, head_dim];
# the state slot mixes bf16 and f32 components, so it is u8 [slots, 3*2*4*2 + 2*16*4 bytes].
SHAPES = {
    0: ([2, 4, 16, 2, 4], "bf16", 2 * 4 * 16 * 2 * 4 * 2),
    1: ([2, 6, 16, 2, 4], "bf16", 2 * 6 * 16 * 2 * 4 * 2),
    2: ([2, 4, 16, 2, 4], "bf16", 2 * 4 * 16 * 2 * 4 * 2),
    3: ([3, 176], "u8", 3 * 176),
}
# Bytes the destination needs: the sliding window's 7 tokens in 2 layers, 40 tokens of the full
# layer (K and V, 2 heads of 4 bf16), one state slot.
NEEDED = 2 * 7 * 2 * 2 * 4 * 2 + 40 * 2 * 2 * 4 * 2 + 176


@pytest.fixture(scope="module")
def client():
    c = tpu_sync.Client(cpu_devices=1)
    yield c
    c.close()


def buffers(client, data, seed, order=(0, 1, 2, 3)):
    return [client.buffer_from_host(data(SHAPES[l][2], seed + l), shape=SHAPES[l][0], dtype=SHAPES[l][1])
            for l in order]


def expected_after_pull(src_bufs, dst_init):
    src = [b.read() for b in src_bufs]
    out = [bytearray(b) for b in dst_init]
    moved = 0
    with tpu_sync.Plan(SRC, DST, TOKENS) as plan:
        for s in plan.spans():
            for i in range(s.count):
                a, b = s.src_offset + i * s.src_stride, s.dst_offset + i * s.dst_stride
                out[s.dst_buffer][b:b + s.len] = src[s.src_buffer][a:a + s.len]
                moved += s.len
    assert moved == NEEDED
    return [bytes(b) for b in out]


def test_groups_form_of_layout_and_placement():
    assert SRC["layout"]["groups"] == [dict(num_blocks=4), dict(num_blocks=6), dict(num_blocks=3)]
    assert SRC["block_ids"][1] == [[4, 1, 5]]
    with tpu_sync.Plan(SRC, DST, TOKENS) as plan:
        assert plan.total_bytes == NEEDED
    with pytest.raises(errors.InvalidArgumentError):
        tpu_sync.layout(model(), num_blocks=[4, 6])  # one count per group
    with pytest.raises(errors.TpuSyncError):
        tpu_sync.Plan(SRC, tpu_sync.placement(layout(16), DST["block_ids"]), TOKENS)


def test_grouped_pull_is_byte_exact_and_mismatched_groups_are_refused_at_the_handshake(client, data):
    prod = tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=10, staging_budget_bytes=1 << 30)
    cons = tpu_sync.Endpoint(listen=None, timeout=10)
    try:
        src = buffers(client, data, 10)
        # Another group's buffer for a layer (the full layer's buffer at the sliding layer 0).
        with pytest.raises(errors.MismatchError) as e:
            prod.register(31, SRC, TOKENS, {0: buffers(client, data, 10, order=(1, 0, 2, 3))})
        assert "layer 0" in str(e.value) and "sliding" in str(e.value)
        prod.register(31, SRC, TOKENS, {0: src})

        # Another window on the consumer (4 tokens: still inside block 2), which believes the
        # producer has it too: its own plan passes, the producer refuses the pull before any
        # byte moves.
        bad_src = tpu_sync.placement(layout(4), SRC["block_ids"])
        bad_dst = tpu_sync.placement(layout(4), DST["block_ids"])
        dst = buffers(client, data, 20)
        init = [b.read() for b in dst]
        with pytest.raises(errors.MismatchError) as e:
            cons.pull(31, prod.address, bad_src, bad_dst, TOKENS, {0: dst}).wait(timeout=30)
        assert "sliding window" in str(e.value)
        assert [b.read() for b in dst] == init
        assert prod.registration_state(31) == "active"

        stats = cons.pull(31, prod.address, SRC, DST, TOKENS, {0: dst}).wait(timeout=30)
        assert stats["bytes"] == stats["device_bytes"] == NEEDED
        assert [b.read() for b in dst] == expected_after_pull(src, init)
        deadline = time.monotonic() + 10
        while prod.registration_state(31) != "released" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prod.registration_state(31) == "released"
    finally:
        cons.close()
        prod.close()


def test_grouped_pull_after_a_prefix_hit_moves_only_the_tokens_after_it(client, data):
    """A destination that holds the request's first 32 tokens (a prefix-cache hit of 2 blocks)
    lists only the blocks after them (``first_token``): the full group its block 2, the sliding
    group its window's block, the state group its slot. The pull over loopback TCP moves exactly
    tokens 32..40 of the full layer, the window's 7 tokens of the sliding layers and the state
    slot, byte-exact; the hit's blocks (the full layer's blocks 2 and 0 of the destination's
    first placement) and every other byte unchanged. An unaligned hit is refused by name."""
    dst_hit = tpu_sync.placement(layout(), [[[1]], [[3]], [[0]]], first_token=32)
    assert dst_hit["first_token"] == 32
    needed = 2 * 7 * 2 * 2 * 4 * 2 + 8 * 2 * 2 * 4 * 2 + 176
    with tpu_sync.Plan(SRC, dst_hit, TOKENS) as plan:
        assert plan.total_bytes == needed
        spans = list(plan.spans())
    with pytest.raises(errors.InvalidArgumentError, match="multiple of the block size 16"):
        tpu_sync.Plan(SRC, tpu_sync.placement(layout(), [[[1]], [[3]], [[0]]], first_token=24), TOKENS)
    prod = tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=10, staging_budget_bytes=1 << 30)
    cons = tpu_sync.Endpoint(listen=None, timeout=10)
    try:
        src = buffers(client, data, 30)
        prod.register(32, SRC, TOKENS, {0: src})
        dst = buffers(client, data, 40)
        init = [b.read() for b in dst]
        stats = cons.pull(32, prod.address, SRC, dst_hit, TOKENS, {0: dst}).wait(timeout=30)
        assert stats["bytes"] == needed
        want = [bytearray(b) for b in init]
        srcb = [b.read() for b in src]
        for s in spans:
            for i in range(s.count):
                a, d = s.src_offset + i * s.src_stride, s.dst_offset + i * s.dst_stride
                want[s.dst_buffer][d:d + s.len] = srcb[s.src_buffer][a:a + s.len]
        got = [b.read() for b in dst]
        assert got == [bytes(b) for b in want]
        # The full layer's blocks 0 and 2 (the hit's blocks in DST) were not written.
        blk = 16 * 2 * 4 * 2
        for plane in range(2):
            for b in (0, 2):
                o = (plane * 6 + b) * blk
                assert got[1][o:o + blk] == init[1][o:o + blk]
        assert got[1] != init[1] and got[3] != init[3]  # the test can fail
    finally:
        cons.close()
        prod.close()


def test_a_destination_recomputing_its_last_token_gets_that_tokens_window():
    """``next_token`` 39 of 40 (vLLM recomputes the last prompt token after a whole-prompt
    load): the sliding layers get the window of token 39, ``[32, 40)``, one token more than the
    next token's (token 32 shares block 2 with the window, so the source holds it); a source
    whose blocks start after the window the destination reads is a MismatchError naming the
    group."""
    dst = tpu_sync.placement(layout(), DST["block_ids"], next_token=39)
    with tpu_sync.Plan(SRC, dst, TOKENS) as plan:
        assert plan.total_bytes == NEEDED + 2 * 1 * 2 * 2 * 4 * 2  # token 32 of both sliding layers
    # 48 tokens with a window of 16: the next token's window [33, 48) starts in block 2, token
    # 47's [32, 48) too; with a window of 17 ([32, 48) and [31, 48)) token 31 is in block 1,
    # which the source does not hold.
    src = tpu_sync.placement(layout(17), [[[3]], [[4, 1, 5]], [[2]]])
    dst = tpu_sync.placement(layout(17), [[[1, 2]], [[2, 0, 3]], [[0]]], next_token=47)
    with pytest.raises(errors.MismatchError, match="sliding"):
        tpu_sync.Plan(src, dst, 48)


def test_presets_come_from_the_native_library_and_plan_their_own_bytes():
    names = tpu_sync.PRESET_NAMES
    assert set(tpu_sync.PRESETS) | set(tpu_sync.HYBRID_PRESETS) == set(names)
    assert {"qwen3-next-80b", "qwen3.5-9b", "gpt-oss-120b", "gemma-3-27b", "deepseek-v3.2"} <= set(
        tpu_sync.HYBRID_PRESETS)
    # A uniform preset is a plain model dict, as before (dtype selectable).
    m = tpu_sync.preset("llama-3.1-8b", dtype="f16")
    assert (m["num_layers"], m["num_kv_heads"], m["head_dim"], m["dtype"]) == (32, 8, 128, "f16")
    # gemma-3-27b: 62 layers, every 6th global (10), 52 sliding with a 1024-token window.
    g = tpu_sync.preset("gemma-3-27b")
    kinds = {grp["name"]: grp for grp in g["groups"]}
    assert len(kinds["full_attention"]["layers"]) == 10
    assert len(kinds["sliding_attention"]["layers"]) == 52
    assert kinds["sliding_attention"]["kind"]["sliding_window"] == 1024
    # gpt-oss-120b resharded TP=2 -> TP=1 at 256 tokens: the sliding layers move only the 127
    # tokens of their 128-token window ([129, 256): blocks 8..15 of 16 tokens).
    gpt = tpu_sync.preset("gpt-oss-120b")
    src = tpu_sync.placement(tpu_sync.layout(gpt, tp=2, num_blocks=32),
                             [[list(range(16))] * 2, [list(range(8, 16))] * 2])
    dst = tpu_sync.placement(tpu_sync.layout(gpt, tp=1, block_size=32, num_blocks=32),
                             [[list(range(31, 23, -1))], [[4, 9, 2, 7]]])
    with tpu_sync.Plan(src, dst, 256) as p:
        per_token = 2 * 8 * 64 * 2
        assert p.total_bytes == 18 * 256 * per_token + 18 * 127 * per_token
    for bad in ("no-such-model", 7):
        with pytest.raises(errors.InvalidArgumentError):
            tpu_sync.preset(bad)
    with pytest.raises(errors.InvalidArgumentError, match="own dtype"):
        tpu_sync.preset("qwen3.5-9b", dtype="bf16")
