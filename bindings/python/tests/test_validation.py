"""Every KV buffer is checked against the layout it is registered or pulled under, before any
byte moves: a buffer whose element type, dims, on-device size or physical layout disagree with
the layout is refused with ``MismatchError`` (naming rank, layer and both values), the endpoint
stays usable, and a correct transfer on it afterwards is byte-exact. Python API only, one
process, two endpoints over loopback TCP, the real XLA CPU plugin."""

import time

import pytest

import tpu_sync
from tpu_sync import errors

# 2 layers, 2 KV heads of 8 bf16, K and V; TP=1, 16-token NHD blocks, 6 blocks per buffer;
# 40 tokens = 3 blocks, the last one partial.
TOKENS = 40
MODEL = tpu_sync.model("toy", num_layers=2, num_kv_heads=2, head_dim=8)
LAYOUT = tpu_sync.layout(MODEL, block_size=16, order="nhd", num_blocks=6)
DIMS = [2, 6, 16, 2, 8]  # planes, blocks, tokens, heads, head_dim
BYTES = 2 * 6 * 16 * 2 * 8 * 2
SRC = tpu_sync.placement(LAYOUT, [[4, 1, 5]])
DST = tpu_sync.placement(LAYOUT, [[2, 0, 3]])


@pytest.fixture(scope="module")
def client():
    c = tpu_sync.Client(cpu_devices=1)
    yield c
    c.close()


@pytest.fixture
def pair():
    prod = tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=10, name="validation-producer")
    cons = tpu_sync.Endpoint(listen=None, timeout=10, name="validation-consumer")
    yield prod, cons
    cons.close()
    prod.close()


def layers(client, data, seed, dims=DIMS, dtype="bf16", elem=2):
    n = elem
    for d in dims:
        n *= d
    return [client.buffer_from_host(data(n, seed + layer), shape=dims, dtype=dtype) for layer in range(2)]


def bad_kinds(client, data):
    """(name, per-layer buffers) for each kind of disagreement with LAYOUT."""
    more_blocks = [2, 8, 16, 2, 8]  # a layer holding more blocks than the layout says
    padded = [2, 6, 16, 2, 12]  # each row padded: a larger block stride
    fewer_blocks = [2, 4, 16, 2, 8]
    flat = [BYTES // 2]  # right size and dtype, no block structure
    return [
        ("more blocks", layers(client, data, 50, more_blocks)),
        ("padded block stride", layers(client, data, 60, padded)),
        ("f16 under bf16", layers(client, data, 70, DIMS, "f16")),
        ("f32 under bf16", layers(client, data, 75, [2, 6, 16, 2, 4], "f32", 4)),
        ("fewer blocks", layers(client, data, 80, fewer_blocks)),
        ("flat", layers(client, data, 85, flat)),
        ("one layer missing", layers(client, data, 90)[:1]),
    ]


def expected_after_pull(src_bufs, dst_init):
    """The destination's bytes after a correct pull: the plan's spans copied, the rest as it was."""
    src = [b.read() for b in src_bufs]
    out = [bytearray(b) for b in dst_init]
    with tpu_sync.Plan(SRC, DST, TOKENS) as plan:
        for s in plan.spans():
            for i in range(s.count):
                a, b = s.src_offset + i * s.src_stride, s.dst_offset + i * s.dst_stride
                out[s.dst_buffer][b:b + s.len] = src[s.src_buffer][a:a + s.len]
    return [bytes(b) for b in out]


def test_consumer_refuses_every_disagreement_then_pulls_byte_exact(client, pair, data):
    prod, cons = pair
    src = layers(client, data, 10)
    prod.register(7, SRC, TOKENS, {0: src})
    for name, bad in bad_kinds(client, data):
        before = [b.read() for b in bad]
        with pytest.raises(errors.MismatchError) as e:
            cons.pull(7, prod.address, SRC, DST, TOKENS, {0: bad})
        assert "rank 0" in e.value.message, (name, e.value.message)
        assert [b.read() for b in bad] == before, name  # nothing written
        assert cons.stats()["bytes_received"] == 0, name  # nothing moved
    # The producer's registration is untouched; a correct pull on the same endpoints is exact.
    assert prod.registration_state(7) == "active"
    dst = layers(client, data, 20)
    init = [b.read() for b in dst]
    stats = cons.pull(7, prod.address, SRC, DST, TOKENS, {0: dst}).wait(timeout=30)
    assert stats["bytes"] == stats["device_bytes"] == TOKENS * 2 * 2 * 8 * 2 * 2
    assert [b.read() for b in dst] == expected_after_pull(src, init)


def test_producer_refuses_every_disagreement_and_keeps_other_registrations(client, pair, data):
    prod, cons = pair
    src = layers(client, data, 30)
    prod.register(8, SRC, TOKENS, {0: src})
    staged = prod.stats()["staged_bytes"]
    for i, (name, bad) in enumerate(bad_kinds(client, data)):
        with pytest.raises(errors.MismatchError) as e:
            prod.register(100 + i, SRC, TOKENS, {0: bad})
        assert "layer" in e.value.message, (name, e.value.message)
        assert prod.registration_state(100 + i) == "unknown", name
        with pytest.raises(errors.MismatchError):
            prod.push(200 + i, "127.0.0.1:9", SRC, DST, TOKENS, {0: bad})
    assert prod.stats()["staged_bytes"] == staged  # nothing staged for the refused ones
    dst = layers(client, data, 40)
    init = [b.read() for b in dst]
    cons.pull(8, prod.address, SRC, DST, TOKENS, {0: dst}).wait(timeout=30)
    assert [b.read() for b in dst] == expected_after_pull(src, init)
    # The delivering release follows the pull's completion (off its critical path).
    deadline = time.monotonic() + 10
    while prod.registration_state(8) == "active" and time.monotonic() < deadline:
        time.sleep(0.005)
    assert prod.registration_state(8) == "released"


def test_expect_push_refuses_disagreement(client, pair, data):
    prod, cons = pair
    for name, bad in bad_kinds(client, data):
        with pytest.raises(errors.MismatchError):
            prod.expect_push(300, SRC, DST, TOKENS, {0: bad})
    # A correct push afterwards lands byte-exact.
    src = layers(client, data, 45)
    dst = layers(client, data, 46)
    init = [b.read() for b in dst]
    rx = prod.expect_push(300, SRC, DST, TOKENS, {0: dst})
    cons.push(300, prod.address, SRC, DST, TOKENS, {0: src}).wait(timeout=30)
    rx.wait(timeout=30)
    assert [b.read() for b in dst] == expected_after_pull(src, init)


def test_unknown_keys_in_placement_json_are_refused(client, pair, data):
    prod, cons = pair
    src = layers(client, data, 10)
    typo = dict(SRC, dp_rnak=0)
    with pytest.raises(errors.InvalidArgumentError) as e:
        prod.register(9, typo, TOKENS, {0: src})
    assert "dp_rnak" in e.value.message
    bad_layout = dict(SRC, layout=dict(LAYOUT, num_blokcs=6))
    with pytest.raises(errors.InvalidArgumentError):
        prod.register(9, bad_layout, TOKENS, {0: src})
    bad_spec = dict(SRC, layout=dict(LAYOUT, spec=dict(LAYOUT["spec"], tpp=2)))
    with pytest.raises(errors.InvalidArgumentError):
        tpu_sync.Plan(bad_spec, DST, TOKENS)
