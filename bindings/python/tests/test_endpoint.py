"""The network endpoint through the Python API only: two-process pull and push transfers with
resharding, verified byte by byte against the plan; failures are typed and bounded."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import tpu_sync
from tpu_sync import errors

# A toy model: 2 layers, 4 KV heads of 8 bf16, K and V. The producer runs TP=2 (16-token blocks,
# NHD), the consumer TP=1 (32-token blocks, HND); the request has 100 tokens.
TOKENS = 100
MODEL = tpu_sync.model("toy", num_layers=2, num_kv_heads=4, head_dim=8)
SRC_LAYOUT = tpu_sync.layout(MODEL, tp=2, block_size=16, order="nhd", num_blocks=8)
DST_LAYOUT = tpu_sync.layout(MODEL, tp=1, block_size=32, order="hnd", num_blocks=6)
SRC = tpu_sync.placement(SRC_LAYOUT, [[7, 2, 5, 0, 3, 6, 1], [1, 4, 0, 6, 2, 7, 5]])
DST = tpu_sync.placement(DST_LAYOUT, [[5, 1, 3, 0]])
SRC_BYTES = 2 * 8 * 16 * 2 * 8 * 2  # planes x blocks x tokens x heads/rank x dim x bf16
DST_BYTES = 2 * 6 * 32 * 4 * 8 * 2
# Buffers have exactly the layouts' shapes (anything else is refused with MismatchError).
SRC_DIMS = [2, 8, 16, 2, 8]  # NHD: planes, blocks, tokens, heads, head_dim
DST_DIMS = [2, 6, 4, 32, 8]  # HND: planes, blocks, heads, tokens, head_dim

HERE = os.path.dirname(os.path.abspath(__file__))

# The producer process: only the Python API. Its buffers hold pattern(SRC_BYTES, 10 + rank*2 + layer).
PRODUCER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {here!r})
    from conftest import pattern
    import tpu_sync
    mode, request_id, src, dst, tokens, target = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), \\
        json.loads(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    # Optional: TLS with this pre-shared key (hex) instead of plain TCP.
    secure = dict(transport="tls", psk=bytes.fromhex(sys.argv[7])) if len(sys.argv) > 7 else {{}}
    c = tpu_sync.Client(cpu_devices=2)
    kv = {{r: [c.buffer_from_host(pattern({n}, 10 + r * 2 + l), device=r, shape={dims}, dtype="bf16")
              for l in range(2)] for r in (0, 1)}}
    ep = tpu_sync.Endpoint(listen="127.0.0.1:0" if mode in ("serve", "layers") else None, timeout=20, name="producer",
                           **secure)
    if mode == "layers":
        # Layer-wise: layer 0 now, layer 1 once the test says so (a line on stdin).
        ep.register_layers(request_id, src, tokens, kv, layers_ready=1)
        print("ADDRESS", ep.address, flush=True)
        sys.stdin.readline()
        print("PUBLISHED", ep.publish_layers(request_id, 2), flush=True)
    if mode == "serve":
        ep.register(request_id, src, tokens, kv)
        print("ADDRESS", ep.address, flush=True)
    if mode in ("serve", "layers"):
        deadline = time.monotonic() + 60
        while ep.registration_state(request_id) == "active" and time.monotonic() < deadline:
            time.sleep(0.02)
        print("STATE", ep.registration_state(request_id), flush=True)
    if mode == "push":
        t = ep.push(request_id, target, src, dst, tokens, kv)
        print("PUSHED", t.wait(timeout=60)["bytes"], flush=True)
    ep.close()
""").format(here=HERE, n=SRC_BYTES, dims=SRC_DIMS)


def start_producer(mode, request_id, target="", psk=None):
    import json

    args = [sys.executable, "-c", PRODUCER, mode, str(request_id), json.dumps(SRC), json.dumps(DST), str(TOKENS),
            target] + ([psk.hex()] if psk is not None else [])
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_line(p, prefix, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.split(None, 1)[1].strip()
    p.kill()
    raise AssertionError(f"producer said no {prefix}: {p.stderr.read()}")


@pytest.fixture
def consumer(data):
    c = tpu_sync.Client(cpu_devices=1)
    init = [data(DST_BYTES, 100 + layer) for layer in range(2)]
    bufs = [c.buffer_from_host(b, shape=DST_DIMS, dtype="bf16") for b in init]
    yield c, bufs, init
    for b in bufs:
        b.close()
    c.close()


def check_against_plan(bufs, init, data, dst=DST):
    """Every span of the plan holds its source bytes; every other byte is as it was."""
    src = {(r, layer): data(SRC_BYTES, 10 + r * 2 + layer) for r in (0, 1) for layer in (0, 1)}
    got = [bytearray(b.read()) for b in bufs]
    covered = [bytearray(DST_BYTES) for _ in bufs]
    moved = 0
    with tpu_sync.Plan(SRC, dst, TOKENS) as plan:
        for s in plan.spans():
            assert s.dst_rank == 0
            for i in range(s.count):
                a, b = s.src_offset + i * s.src_stride, s.dst_offset + i * s.dst_stride
                assert got[s.dst_buffer][b:b + s.len] == src[(s.src_rank, s.src_buffer)][a:a + s.len]
                covered[s.dst_buffer][b:b + s.len] = b"\x01" * s.len
                moved += s.len
    for layer in range(2):
        for i in range(DST_BYTES):
            if not covered[layer][i]:
                assert got[layer][i] == init[layer][i], (layer, i)
    return moved


def pull_from_producer(rid, bufs, dst=DST, more=None, psk=None, **consumer_options):
    """Starts a serving producer of request ``rid`` (TLS with ``psk`` if given, else plain TCP),
    pulls it into ``bufs`` as ``dst`` says with a consumer endpoint of ``consumer_options``, runs
    ``more(ep, addr)`` (if given) on it, and checks the producer's registration ended released.
    Returns the pull's stats."""
    p = start_producer("serve", rid, psk=psk)
    if psk is not None:
        consumer_options.update(transport="tls", psk=psk)
    try:
        addr = read_line(p, "ADDRESS")
        with tpu_sync.Endpoint(listen=None, timeout=20, **consumer_options) as ep:
            t = ep.pull(rid, addr, SRC, dst, TOKENS, {0: bufs})
            stats = t.wait(timeout=60)
            assert t.done and t.error is None
            assert ep.stats()["transfers_completed"] == 1
            t.close()
            if more is not None:
                more(ep, addr)
        assert read_line(p, "STATE") == "released"  # the pull released the producer's blocks
        assert p.wait(30) == 0
        return stats
    finally:
        p.kill()


def test_two_process_pull(consumer, data):
    c, bufs, init = consumer

    def counted(ep, addr):
        s = ep.stats()
        assert s["bytes_received"] == TOKENS * 2 * 2 * 4 * 8 * 2
        assert s["bytes_received_unhashed"] == 0  # plain TCP: every frame's xxh3 is checked

    stats = pull_from_producer(42, bufs, more=counted)
    assert stats["bytes"] == stats["device_bytes"] == TOKENS * 2 * 2 * 4 * 8 * 2
    assert check_against_plan(bufs, init, data) == stats["bytes"]


@pytest.mark.parametrize("hash_encrypted_frames", [None, True])
def test_two_process_pull_over_tls(consumer, data, hash_encrypted_frames):
    """Over TLS the frames' xxh3 is left to the AEAD unless the consumer asks for it."""
    c, bufs, init = consumer
    moved = TOKENS * 2 * 2 * 4 * 8 * 2

    def counted(ep, addr):
        s = ep.stats()
        assert s["bytes_received"] == moved
        assert s["bytes_received_unhashed"] == (0 if hash_encrypted_frames else moved)
        assert s["checksum_failures"] == 0

    stats = pull_from_producer(43, bufs, more=counted, psk=bytes(range(1, 33)),
                               hash_encrypted_frames=hash_encrypted_frames)
    assert stats["bytes"] == moved
    assert check_against_plan(bufs, init, data) == moved


def test_describe_then_pull_with_the_producers_placement(consumer, data):
    """A consumer that does not know the producer's blocks (a router sent the prompt to both
    at once) asks the producer for its placement: an unknown id is UnknownRequestError; the
    registered one comes back exactly as registered (layout and block ids of both ranks) with
    its token count, and a pull with it moves every span of the plan."""
    c, bufs, init = consumer
    p = start_producer("serve", 43)
    try:
        addr = read_line(p, "ADDRESS")
        with tpu_sync.Endpoint(listen=None, timeout=20) as ep:
            with pytest.raises(errors.UnknownRequestError):
                ep.describe(44, addr)
            with pytest.raises(errors.InvalidArgumentError):
                ep.describe(0, addr)
            placement, tokens = ep.describe(43, addr)
            assert tokens == TOKENS
            assert placement["block_ids"] == SRC["block_ids"]
            assert placement == SRC, placement
            t = ep.pull(43, addr, placement, DST, tokens, {0: bufs})
            stats = t.wait(timeout=60)
            t.close()
        assert read_line(p, "STATE") == "released"
        assert p.wait(30) == 0
    finally:
        p.kill()
    assert check_against_plan(bufs, init, data) == stats["bytes"] > 0


def test_two_process_pull_past_a_prefix_hit(consumer, data):
    """A consumer that already holds the request's first block (32 tokens, a prefix-cache hit)
    pulls only tokens 32..100 into its blocks 1, 3 and 0; its block 5 (where the hit is) and
    every other byte stay as they were."""
    c, bufs, init = consumer
    dst = tpu_sync.placement(DST_LAYOUT, [[1, 3, 0]], first_token=32)

    def refused(ep, addr):
        # Refused before anything moves: unaligned, past the request, ids of the whole request.
        for bad in (tpu_sync.placement(DST_LAYOUT, [[1, 3, 0]], first_token=16),
                    tpu_sync.placement(DST_LAYOUT, [[1, 3, 0]], first_token=128),
                    tpu_sync.placement(DST_LAYOUT, [[5, 1, 3, 0]], first_token=32)):
            with pytest.raises((errors.InvalidArgumentError, errors.BlockRangeError)):
                ep.pull(46, addr, SRC, bad, TOKENS, {0: bufs})

    stats = pull_from_producer(45, bufs, dst, refused)
    assert stats["bytes"] == (TOKENS - 32) * 2 * 2 * 4 * 8 * 2
    assert check_against_plan(bufs, init, data, dst) == stats["bytes"]


def test_two_process_layerwise_pull(consumer, data):
    """A request registered with only layer 0 staged: the layer-wise pull writes layer 0 and
    waits for layer 1 until the producer publishes it; then every span is exact."""
    c, bufs, init = consumer
    p = start_producer("layers", 43)
    try:
        addr = read_line(p, "ADDRESS")
        with tpu_sync.Endpoint(listen=None, timeout=20) as ep:
            t = ep.pull(43, addr, SRC, DST, TOKENS, {0: bufs}, layerwise=True)
            assert t.wait_layers(1, timeout=30)
            assert t.layers_written == 1
            assert not t.wait_layers(2, timeout=0.3)  # layer 1 is not published yet
            assert not t.done and t.layers_written == 1
            p.stdin.write("go\n")
            p.stdin.flush()
            assert read_line(p, "PUBLISHED") == "2"
            assert t.wait_layers(2, timeout=30)
            stats = t.wait(timeout=60)
            assert t.layers_written == 2
            t.close()
        assert check_against_plan(bufs, init, data) == stats["bytes"]
        assert read_line(p, "STATE") == "released"
        assert p.wait(30) == 0
    finally:
        p.kill()


def test_two_process_push(consumer, data):
    c, bufs, init = consumer
    with tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=20) as ep:
        rx = ep.expect_push(43, SRC, DST, TOKENS, {0: bufs})
        done = []
        rx.add_done_callback(lambda t: done.append(t.error))
        p = start_producer("push", 43, ep.address)
        try:
            stats = rx.wait(timeout=60)
            assert int(read_line(p, "PUSHED")) == stats["bytes"]
            assert p.wait(30) == 0
        finally:
            p.kill()
        deadline = time.monotonic() + 5
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == [None]
        rx.close()
    assert check_against_plan(bufs, init, data) == stats["bytes"]


def test_producer_killed_before_the_pull_fails_cleanly(consumer):
    c, bufs, init = consumer
    p = start_producer("serve", 44)
    addr = read_line(p, "ADDRESS")
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)
    with tpu_sync.Endpoint(listen=None, timeout=5, heartbeat_timeout=3) as ep:
        t = ep.pull(44, addr, SRC, DST, TOKENS, {0: bufs})
        t0 = time.monotonic()
        with pytest.raises(errors.TpuSyncError) as e:
            t.wait(timeout=30)
        assert not isinstance(e.value, errors.PendingError) and time.monotonic() - t0 < 25
        assert t.done and isinstance(t.error, type(e.value))
    assert [b.read() for b in bufs] == init  # nothing was written


def test_local_errors_and_cancel(consumer):
    c, bufs, init = consumer
    with tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=5) as ep:
        assert ep.address.startswith("127.0.0.1:")
        assert ep.registration_state(7) == "unknown"
        with pytest.raises(errors.InvalidArgumentError):
            ep.pull(0, ep.address, SRC, DST, TOKENS, {0: bufs})  # id 0
        with pytest.raises(errors.InvalidArgumentError):
            ep.pull(2**53, ep.address, SRC, DST, TOKENS, {0: bufs})
        bad = dict(DST, block_ids=[[5, 1, 3, 99]])
        with pytest.raises(errors.BlockRangeError):
            ep.pull(1, ep.address, SRC, bad, TOKENS, {0: bufs})
        with pytest.raises(errors.InvalidArgumentError):
            ep.pull(1, {}, SRC, DST, TOKENS, {0: bufs})
        with pytest.raises(errors.InvalidArgumentError):
            ep.register(1, SRC, TOKENS, {5: bufs})  # rank outside the replica
        # A pull of a request nobody registered fails, with the typed error of the producer.
        t = ep.pull(9, ep.address, SRC, DST, TOKENS, {0: bufs})
        with pytest.raises(errors.TpuSyncError) as e:
            t.wait(timeout=20)
        assert not isinstance(e.value, errors.PendingError)
        t.close()
        # A peer that accepts and never answers: pending until cancelled.
        import socket

        hole = socket.socket()
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        t = ep.pull(10, "127.0.0.1:%d" % hole.getsockname()[1], SRC, DST, TOKENS, {0: bufs})
        with pytest.raises(errors.PendingError):
            t.wait(timeout=0.3)
        t.cancel()
        with pytest.raises(errors.CancelledError):
            t.wait(timeout=5)
        t.close()
        hole.close()
    with pytest.raises(errors.InvalidHandleError):
        ep.stats()
    with pytest.raises(errors.InvalidArgumentError):
        tpu_sync.Endpoint(transport="quic")  # QUIC needs credentials
    with pytest.raises(errors.InvalidArgumentError):  # at least one QUIC connection per peer
        tpu_sync.Endpoint(transport="quic", psk=bytes(range(32)), quic_connections_per_peer=0)
    with pytest.raises(errors.InvalidArgumentError):
        tpu_sync.Endpoint(transport="quic", psk=bytes(range(32)), quic_connections_per_peer=-1)
    with pytest.raises(errors.InvalidArgumentError):
        tpu_sync.Endpoint(transport="tls", psk=bytes(range(32)), hash_encrypted_frames="yes")
    with pytest.raises(errors.InvalidArgumentError):
        tpu_sync.Endpoint(transport="pigeon")
