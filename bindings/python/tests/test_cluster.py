"""The cluster prefix directory (a real etcd, started here on a free loopback port) and the remote
tier through the Python API: publish, lookup, fetch byte-exact, stale entries are misses, a closed
server is a clean error. Skipped when no etcd binary is installed (scripts/install-etcd.sh)."""

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

import tpu_sync
from tpu_sync import cluster, errors

BLOCK = 8192
NS = "py-cluster bf16 tp=1 block=16"


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd():
    exe = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if exe is None:
        pytest.skip("no etcd binary (scripts/install-etcd.sh)")
    d = tempfile.mkdtemp(prefix="tsync-py-etcd-")
    cp, pp = _port(), _port()
    curl, purl = f"http://127.0.0.1:{cp}", f"http://127.0.0.1:{pp}"
    log = open(os.path.join(d, "etcd.log"), "w")
    p = subprocess.Popen([exe, "--name", "t", "--data-dir", os.path.join(d, "data"),
                          "--listen-client-urls", curl, "--advertise-client-urls", curl,
                          "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
                          "--initial-cluster", f"t={purl}", "--logger", "zap", "--log-level", "warn"],
                         stdout=log, stderr=log)
    try:
        t0 = time.time()
        while True:
            try:
                if b'"true"' in urllib.request.urlopen(curl + "/health", timeout=1).read():
                    break
            except OSError:
                pass
            assert time.time() - t0 < 30, "etcd did not start"
            time.sleep(0.05)
        yield curl
    finally:
        p.kill()
        p.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


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


def test_connector_cluster_tier_loads_a_peer_prefix(etcd, data):
    """The vLLM connector's host tier with ``cluster`` settings, without vLLM: engine A stores a
    prompt's blocks from its KV tensors; engine B (other block ids) finds them through the
    directory, fetches them into its tier and loads them into its own KV tensors byte-exact."""
    np = pytest.importorskip("numpy")
    from tpu_sync.vllm.backends import KvCaches, make_host_tier
    from tpu_sync.vllm.cluster_tier import ClusterTier
    from tpu_sync.vllm.compat import KvGeometry
    from tpu_sync.vllm.config import ConfigError, ConnectorConfig

    g = KvGeometry(model="tiny", num_layers=2, num_kv_heads=2, heads_per_rank=2, head_dim=16, dtype="f32",
                   block_size=16, tp=1, block_format="test/f32")
    nblocks = 12

    def engine(port_tag):
        tensors = [tpu_sync.aligned_array((nblocks, 2, 16, 32), "float32") for _ in range(g.num_layers)]
        caches = KvCaches(names=[f"l{i}" for i in range(g.num_layers)], tensors=tensors, num_blocks=nblocks,
                          layer_block_bytes=g.layer_block_bytes, tp_rank=0)
        cfg = ConnectorConfig.parse("kv_both", {"host_capacity_bytes": 64 * g.block_bytes, "cluster": {
            "endpoints": [etcd], "advertise": "127.0.0.1:0", "host_id": port_tag, "lease_ttl": 2}})
        return make_host_tier(cfg, g, caches), tensors

    a, ta = engine("engine-a")
    b, tb = engine("engine-b")
    assert isinstance(a, ClusterTier) and isinstance(b, ClusterTier)
    hashes = [bytes([i]) * 32 for i in range(1, 6)]
    src_ids, dst_ids = [3, 7, 0, 11, 5], [9, 1, 4, 10, 2]
    for li, t in enumerate(ta):
        t.view(np.uint8).reshape(-1)[:] = np.frombuffer(data(t.nbytes, 7 + li), np.uint8)
    assert a.put(hashes, src_ids) == 5
    a.publisher.sync(10)
    assert b.lookup(hashes) == 5, "fetched from engine A into B's tier"
    assert b.stats()["remote_blocks"] == 5
    assert b.get(hashes, dst_ids) == 5
    lbb = g.layer_block_bytes
    for t_a, t_b in zip(ta, tb):
        ua, ub = t_a.view(np.uint8).reshape(-1), t_b.view(np.uint8).reshape(-1)
        for s, d in zip(src_ids, dst_ids):
            assert ub[d * lbb:(d + 1) * lbb].tobytes() == ua[s * lbb:(s + 1) * lbb].tobytes()
    # A second lookup is a local hit: nothing fetched again.
    assert b.lookup(hashes) == 5 and b.stats()["remote_blocks"] == 5
    # Engine A goes away: B's lookups of an unknown longer chain are misses, not errors.
    a.close()
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
