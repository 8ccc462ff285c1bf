"""The cluster prefix directory (a real etcd, started here on a free loopback port) and the remote
tier through the Python API: publish, lookup, fetch byte-exact, stale entries are misses, a closed
server is a clean error. Skipped when no etcd binary is installed (scripts/install-etcd.sh)."""

import os
import sys

import pytest

import tpu_sync
from tpu_sync import cluster, errors

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "cluster_util"))
from etcd import etcd_bin, etcd_server  # noqa: E402

BLOCK = 8192
NS = "py-cluster bf16 tp=1 block=16"


@pytest.fixture
def etcd():
    if etcd_bin() is None:
        pytest.skip("no etcd binary (scripts/install-etcd.sh)")
    with etcd_server("tsync-py-etcd") as curl:
        yield curl


def store():
    return tpu_sync.Store(namespace=NS, block_bytes=BLOCK, capacity_bytes=32 * BLOCK,
                          lock_memory=False, populate=False)


def test_publish_lookup_fetch(etcd, data):
    d = cluster.Directory([etcd], lease_ttl=2, batch_interval_ms=10)
    a = store()
    keys = a.chain_keys(list(range(7, 7 + 6 * 16)), 16)
    blocks = [data(BLOCK, 90 + i) for i in range(6)]
    assert a.put(keys, blocks).complete
    srv = cluster.RemoteServer(a, "127.0.0.1:0")
    p = d.publish(a, host_id="py-a", addr=srv.addr, meta="tp=1")
    p.sync(10)
    assert p.stats()["live_entries"] == 6
    c = d.lookup(NS, keys)
    assert c == [{"id": "py-a", "addr": srv.addr, "meta": "tp=1", "blocks": 6}]
    assert d.lookup("another namespace", keys) == []
    outs = [bytearray(BLOCK) for _ in keys]
    assert cluster.fetch(c[0]["addr"], NS, keys, outs) == 6
    assert [bytes(o) for o in outs] == [bytes(b) for b in blocks]
    # Evicted after the lookup: the fetch delivers the part still there.
    assert a.remove(keys[3:4]) == 3
    outs = [bytearray(BLOCK) for _ in keys]
    assert cluster.fetch(srv.addr, NS, keys, outs) == 3
    assert [bytes(o) for o in outs[:3]] == [bytes(b) for b in blocks[:3]]
    with pytest.raises(errors.MismatchError):
        cluster.fetch(srv.addr, "another namespace", keys, outs)
    # Closing the publisher revokes its lease; closing the server ends fetches cleanly.
    p.close()
    assert d.lookup(NS, keys) == []
    addr = srv.addr
    srv.close()
    with pytest.raises((errors.PeerClosedError, errors.TimeoutError)):
        cluster.fetch(addr, NS, keys, outs, timeout=2)
    d.close()
    a.close()


def test_remote_tier_credentials(data, tmp_path):
    """With a pre-shared key only holders fetch and offer, a holder takes bytes only from a server
    that proves the key, and a plain server beyond loopback needs ``insecure`` (issue 24)."""
    a = store()
    keys = a.chain_keys(list(range(3, 3 + 4 * 16)), 16)
    blocks = [data(BLOCK, 300 + i) for i in range(4)]
    assert a.put(keys, blocks).complete
    key_file = tmp_path / "fleet.psk"
    key_file.write_bytes(os.urandom(32).hex().encode())
    creds = {"psk_hex": key_file.read_text()}
    srv = cluster.RemoteServer(a, "127.0.0.1:0", remote=creds)
    outs = [bytearray(BLOCK) for _ in keys]
    assert cluster.fetch(srv.addr, NS, keys, outs, remote=creds) == 4
    assert [bytes(o) for o in outs] == [bytes(b) for b in blocks]
    for other in (None, {"psk_hex": "ab" * 32}):
        outs = [bytearray(BLOCK) for _ in keys]
        with pytest.raises((errors.ProtocolError, errors.PeerClosedError, errors.TimeoutError)):
            cluster.fetch(srv.addr, NS, keys, outs, timeout=3, remote=other)
        assert all(o == bytearray(BLOCK) for o in outs)
    plain = cluster.RemoteServer(a, "127.0.0.1:0")
    with pytest.raises((errors.ProtocolError, errors.PeerClosedError, errors.TimeoutError)):
        cluster.fetch(plain.addr, NS, keys, [bytearray(BLOCK) for _ in keys], timeout=3, remote=creds)
    with pytest.raises(errors.InvalidArgumentError, match="without credentials"):
        cluster.RemoteServer(a, "0.0.0.0:0")
    cluster.RemoteServer(a, "0.0.0.0:0", remote={"insecure": True}).close()
    cluster.RemoteServer(a, "0.0.0.0:0", remote={"psk_file": str(key_file)}).close()
    with pytest.raises(errors.InvalidArgumentError):
        cluster.RemoteServer(a, "127.0.0.1:0", remote={"psk_hex": "ab" * 4})  # too short
    with pytest.raises(errors.InvalidArgumentError):
        cluster.RemoteServer(a, "127.0.0.1:0", remote={"no_such_option": 1})
    for h in (srv, plain, a):
        h.close()


def test_bad_configuration():
    with pytest.raises(errors.InvalidArgumentError):
        cluster.Directory([])
    with pytest.raises(errors.InvalidArgumentError):
        cluster.Directory(["127.0.0.1:1"], no_such_option=1)
    d = cluster.Directory(["127.0.0.1:1"], request_timeout_ms=500, connect_timeout_ms=300)
    with pytest.raises((errors.PeerClosedError, errors.TimeoutError)):
        d.lookup(NS, [b"\x01" * 16])
    with pytest.raises(errors.InvalidArgumentError):
        d.lookup(NS, [b"short"])
    d.close()


@pytest.mark.parametrize("psk", [None, "5e" * 32], ids=["plain", "psk"])
def test_connector_cluster_tier_loads_a_peer_prefix(etcd, data, psk, monkeypatch):
    """The vLLM connector's host tier with ``cluster`` settings, without vLLM: engine A stores a
    prompt's blocks from its KV tensors; engine B (other block ids) finds them through the
    directory and loads them straight into its own KV tensors (tpu_sync.cluster.load) byte-exact,
    then holds them in its own tier; a peer gone between lookup and load is a miss. With a fleet
    PSK (``remote_psk_hex``) both the device path and the layer-wise host path
    (``get_host``) fetch over the authenticated remote tier."""
    np = pytest.importorskip("numpy")
    from tpu_sync.vllm.backends import KvCaches, make_host_tier
    from tpu_sync.vllm.cluster_tier import ClusterTier
    from tpu_sync.vllm.compat import KvGeometry
    from tpu_sync.vllm.config import ConfigError, ConnectorConfig

    g = KvGeometry(model="tiny", num_layers=2, num_kv_heads=2, heads_per_rank=2, head_dim=16, dtype="f32",
                   block_size=16, tp=1, block_format="test/f32")

    def engine(port_tag, nblocks):
        tensors = [tpu_sync.aligned_array((nblocks, 2, 16, 32), "float32") for _ in range(g.num_layers)]
        caches = KvCaches(names=[f"l{i}" for i in range(g.num_layers)], tensors=tensors, num_blocks=nblocks,
                          layer_block_bytes=g.layer_block_bytes, tp_rank=0)
        settings = {"endpoints": [etcd], "advertise": "127.0.0.1:0", "host_id": port_tag, "lease_ttl": 2}
        if psk:
            settings["remote_psk_hex"] = psk
        cfg = ConnectorConfig.parse("kv_both", {"host_capacity_bytes": 64 * g.block_bytes, "cluster": settings})
        return make_host_tier(cfg, g, caches), tensors

    # Two layouts of the same model: A's KV tensors have 12 blocks, B's 14.
    a, ta = engine("engine-a", 12)
    b, tb = engine("engine-b", 14)
    assert isinstance(a, ClusterTier) and isinstance(b, ClusterTier)
    assert bool(b.member.remote) == bool(psk)
    hashes = [bytes([i]) * 32 for i in range(1, 6)]
    src_ids, dst_ids = [3, 7, 0, 11, 5], [9, 1, 13, 10, 2]
    for li, t in enumerate(ta):
        t.view(np.uint8).reshape(-1)[:] = np.frombuffer(data(t.nbytes, 7 + li), np.uint8)
    for li, t in enumerate(tb):
        t.view(np.uint8).reshape(-1)[:] = np.frombuffer(data(t.nbytes, 70 + li), np.uint8)
    before = [t.copy() for t in tb]
    assert a.put(hashes, src_ids) == 5
    a.publisher.sync(10)
    assert b.lookup(hashes) == 5, "A's prefix found through the directory"
    assert b.stats()["remote_blocks"] == 0, "a lookup moves no bytes"
    assert b.get(hashes, dst_ids) == 5
    st = b.stats()
    assert st["remote_blocks"] == 5 and st["remote_loads"] == 1
    lbb = g.layer_block_bytes
    for t_a, t_b, t_0 in zip(ta, tb, before):
        ua, ub, u0 = (x.view(np.uint8).reshape(-1) for x in (t_a, t_b, t_0))
        for s, d in zip(src_ids, dst_ids):
            assert ub[d * lbb:(d + 1) * lbb].tobytes() == ua[s * lbb:(s + 1) * lbb].tobytes()
        for d in set(range(14)) - set(dst_ids):  # other blocks untouched
            assert ub[d * lbb:(d + 1) * lbb].tobytes() == u0[d * lbb:(d + 1) * lbb].tobytes()
    # B now holds the prefix in its own tier: a local hit, nothing loaded remotely again.
    assert b.store.lookup([b.key(h) for h in hashes]) == 5
    assert b.lookup(hashes) == 5 and b.get(hashes, [4, 5, 6, 7, 8]) == 5
    assert b.stats()["remote_loads"] == 1
    # The layer-wise path: blocks a peer holds fetched into host memory, byte-exact (every layer
    # of the block in layer order).
    third = [bytes([60 + i]) * 32 for i in range(2)]
    assert a.put(third, [6, 8]) == 2
    a.publisher.sync(10)
    assert b.lookup(third) == 2
    outs = [bytearray(g.block_bytes) for _ in third]
    assert b.get_host(third, outs) == 2
    for o, sid in zip(outs, [6, 8]):
        assert bytes(o) == b"".join(t.view(np.uint8).reshape(-1)[sid * lbb:(sid + 1) * lbb].tobytes() for t in ta)
    assert b.stats()["remote_blocks"] == 7 and b.stats()["remote_loads"] == 2
    # Stored in B's own tier too (the host path is how a model with KV cache groups loads).
    assert b.store.lookup([b.key(h) for h in third]) == 2
    # A peer failing mid-fetch (a fetch writes each block before it checks it) never touches the
    # blocks read from the local tier: B holds 2 of a 4-block chain, A all 4.
    fourth = [bytes([80 + i]) * 32 for i in range(4)]
    assert a.put(fourth, [1, 2, 4, 6]) == 4 and b.put(fourth[:2], [0, 3]) == 2
    a.publisher.sync(10)
    assert b.lookup(fourth) == 4
    def failing_fetch(addr, namespace, keys, outs, timeout=0, remote=None):
        for o in outs:
            np.frombuffer(o, np.uint8)[:] = 0xEE
        raise errors.ChecksumError(11, "injected: the first block arrived corrupt")

    with monkeypatch.context() as m:
        m.setattr(cluster, "fetch", failing_fetch)
        outs = [bytearray(g.block_bytes) for _ in fourth]
        assert b.get_host(fourth, outs) == 2
    for o, bid in zip(outs[:2], [0, 3]):
        assert bytes(o) == b"".join(t.view(np.uint8).reshape(-1)[bid * lbb:(bid + 1) * lbb].tobytes() for t in tb)
    # A peer gone between the lookup and the load: a miss (0 blocks), the tensors untouched.
    other = [bytes([40 + i]) * 32 for i in range(3)]
    assert a.put(other, [1, 2, 4]) == 3
    a.publisher.sync(10)
    assert b.lookup(other) == 3
    snap = [t.copy() for t in tb]
    a.close()
    assert b.get(other, [0, 3, 11]) == 0
    assert [x.tobytes() for x in tb] == [y.tobytes() for y in snap]
    # Engine A's entries are gone: B's lookups of an unknown longer chain are misses, not errors.
    more = hashes + [b"\x09" * 32]
    assert b.lookup(more) == 5
    b.close()
    with pytest.raises(ConfigError):
        ConnectorConfig.parse("kv_both", {"cluster": "not a dict"})
    cfg = ConnectorConfig.parse("kv_both", {"cluster": {"endpoints": [etcd]}})
    from tpu_sync.vllm.cluster_tier import cluster_settings
    with pytest.raises(ConfigError):
        cluster_settings(cfg)


# The device path: a producer of one layout (TP=2, 16-token NHD blocks, one store per rank)
# serves a prompt; a consumer of another (TP=1, 32-token HND blocks) loads the present prefix
# into its device buffers, resharded. No etcd: the addresses are given directly.
LMODEL = tpu_sync.model("toy", num_layers=2, num_kv_heads=2, head_dim=8)
A_LAYOUT = tpu_sync.layout(LMODEL, tp=2, block_size=16, order="nhd", num_blocks=6)
B_LAYOUT = tpu_sync.layout(LMODEL, tp=1, block_size=32, order="hnd", num_blocks=4)
A_IDS = [4, 1, 5, 0]  # 64 tokens: 4 blocks of 16 per rank
B_IDS = [3, 1]  # 2 blocks of 32
A_BLOCK = 16 * 1 * 8 * 2  # tokens x heads per rank x head_dim x bf16, one plane


def _a_ns(rank):
    return f"py-load toy bf16 tp=2 block=16 nhd rank={rank}"


def test_load_into_device_blocks_of_another_layout(data):
    client = tpu_sync.Client(cpu_devices=1)
    try:
        tokens = list(range(100, 164))
        a_bufs = {r: [client.buffer_from_host(data(2 * 6 * A_BLOCK, 10 * r + l), shape=[2, 6, 16, 1, 8],
                                              dtype="bf16") for l in range(2)] for r in range(2)}
        stores, servers, sources = [], [], []
        for r in range(2):
            s = tpu_sync.Store(namespace=_a_ns(r), block_bytes=2 * 2 * A_BLOCK, capacity_bytes=16 * 4 * A_BLOCK,
                               lock_memory=False, populate=False)
            host = [b.read() for b in a_bufs[r]]
            # A stored block: every layer, K then V, the block's bytes (tpu_sync::store::DeviceBlock).
            blocks = [b"".join(host[l][(p * 6 + i) * A_BLOCK:(p * 6 + i + 1) * A_BLOCK]
                               for l in range(2) for p in range(2)) for i in A_IDS]
            keys = s.chain_keys(tokens, 16)
            assert s.put(keys, blocks).complete
            srv = cluster.RemoteServer(s, "127.0.0.1:0")
            stores.append(s)
            servers.append(srv)
            sources.append({"addr": srv.addr, "namespace": _a_ns(r), "keys": keys})
        dst = [client.buffer_from_host(data(2 * 4 * 32 * 2 * 8 * 2, 90 + l), shape=[2, 4, 2, 32, 8], dtype="bf16")
               for l in range(2)]
        init = [b.read() for b in dst]
        src_p = tpu_sync.placement(A_LAYOUT, [A_IDS, A_IDS])
        dst_p = tpu_sync.placement(B_LAYOUT, [B_IDS])
        # Expected: the plan from A's device buffers to B's applied on the host, the rest unchanged.
        src_host = {r: [b.read() for b in a_bufs[r]] for r in range(2)}
        want = [bytearray(b) for b in init]
        with tpu_sync.Plan(src_p, dst_p, 64) as plan:
            for sp in plan.spans():
                for i in range(sp.count):
                    a, b = sp.src_offset + i * sp.src_stride, sp.dst_offset + i * sp.dst_stride
                    want[sp.dst_buffer][b:b + sp.len] = src_host[sp.src_rank][sp.src_buffer][a:a + sp.len]
        st = cluster.load(A_LAYOUT, sources, dst_p, 64, {0: dst}, timeout=5)
        assert st["tokens"] == 64 and st["dst_blocks"] == 2
        assert st["device_bytes"] == 64 * 2 * 2 * 2 * 8 * 2
        assert [b.read() for b in dst] == [bytes(w) for w in want]

        # A block evicted at the producer: the prefix every rank holds is one 32-token block.
        assert stores[1].remove(sources[1]["keys"][2:3]) == 2
        dst2 = [client.buffer_from_host(bytes(b), shape=[2, 4, 2, 32, 8], dtype="bf16") for b in init]
        st = cluster.load(A_LAYOUT, sources, dst_p, 64, {0: dst2}, timeout=5)
        assert st["tokens"] == 32
        got = [b.read() for b in dst2]
        assert got != init and got != [bytes(w) for w in want]

        # A dead producer: a clean error, the destination untouched.
        servers[0].close()
        dst3 = [client.buffer_from_host(bytes(b), shape=[2, 4, 2, 32, 8], dtype="bf16") for b in init]
        with pytest.raises((errors.PeerClosedError, errors.TimeoutError)):
            cluster.load(A_LAYOUT, sources, dst_p, 64, {0: dst3}, timeout=2)
        assert [b.read() for b in dst3] == init
        with pytest.raises(errors.InvalidArgumentError):
            cluster.load(A_LAYOUT, sources[:1], dst_p, 64, {0: dst3})
        for s in servers[1:]:
            s.close()
        for s in stores:
            s.close()
    finally:
        client.close()
