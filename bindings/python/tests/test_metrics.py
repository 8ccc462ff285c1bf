"""Prometheus metrics through the library's HTTP endpoint, parsed with prometheus_client's text
parser: every device-copy, pacing and host-tier metric moves by exactly what the action did (a
put, a hit, a miss, a get, an eviction, a spill, a checksum failure, a restart); the endpoint
started from the environment serves on port + rank. Real XLA CPU plugin. Metrics are
process-wide, so each check compares two scrapes around its action."""

import mmap
import os
import subprocess
import sys
import textwrap
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tpu_sync

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "cluster_util"))
import ports  # noqa: E402

BLOCK = 4096


def parse(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def addr():
    return tpu_sync.serve_metrics("127.0.0.1:0")


def scrape(addr):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(r.read().decode())


def v(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before, after, name, **labels):
    return v(after, name, **labels) - v(before, name, **labels)


def store(**kw):
    args = dict(namespace="metrics-test", block_bytes=BLOCK, capacity_bytes=16 * BLOCK, lock_memory=False,
                populate=False)
    args.update(kw)
    return tpu_sync.Store(**args)


def test_endpoint_and_text_agree(addr):
    m = scrape(addr)
    t = parse(tpu_sync.metrics())
    for name in ("tpu_sync_store_put_blocks_total", "tpu_sync_device_copy_bytes_total"):
        assert any(k[0] == name for k in m) and any(k[0] == name for k in t)
    with urllib.request.urlopen(f"http://{addr}/", timeout=10) as r:
        assert b"/metrics" in r.read()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{addr}/nope", timeout=10)
    assert e.value.code == 404
    # A second serve finds the first one.
    assert tpu_sync.serve_metrics("127.0.0.1:0") == addr
    with pytest.raises(tpu_sync.errors.InvalidArgumentError):
        tpu_sync.serve_metrics("not an address")


def test_put_hit_miss_get_and_occupancy(addr, data):
    b0 = scrape(addr)
    with store() as s:
        keys = s.chain_keys(list(range(6 * 16)), 16)
        blocks = [data(BLOCK, 10 + i) for i in range(4)]
        assert s.put(keys[:4], blocks).stored == 4
        assert s.put(keys[:4], blocks).present == 4
        assert s.lookup(keys) == 4
        outs = [bytearray(BLOCK) for _ in range(4)]
        assert s.get(keys[:4], outs).delivered == 4
        assert [bytes(o) for o in outs] == blocks
        b1 = scrape(addr)
        assert delta(b0, b1, "tpu_sync_store_put_blocks_total", result="stored") == 4
        assert delta(b0, b1, "tpu_sync_store_put_blocks_total", result="present") == 4
        assert delta(b0, b1, "tpu_sync_store_put_blocks_total", result="full") == 0
        assert delta(b0, b1, "tpu_sync_store_bytes_total", op="put") == 4 * BLOCK
        assert delta(b0, b1, "tpu_sync_store_lookup_blocks_total", tier="dram", result="hit") == 4
        assert delta(b0, b1, "tpu_sync_store_lookup_blocks_total", tier="dram", result="miss") == 2
        # No disk tier: nothing is looked for on disk.
        assert delta(b0, b1, "tpu_sync_store_lookup_blocks_total", tier="disk", result="miss") == 0
        assert delta(b0, b1, "tpu_sync_store_get_blocks_total", tier="dram") == 4
        assert delta(b0, b1, "tpu_sync_store_bytes_total", op="get") == 4 * BLOCK
        assert delta(b0, b1, "tpu_sync_store_blocks", tier="dram") == 4
        assert delta(b0, b1, "tpu_sync_store_capacity_blocks", tier="dram") == 16
        assert delta(b0, b1, "tpu_sync_store_attach_total", outcome="anonymous") == 1
        with s.pin(keys[:3]):
            assert delta(b0, scrape(addr), "tpu_sync_store_leased_blocks") == 3
        assert delta(b0, scrape(addr), "tpu_sync_store_leased_blocks") == 0
    # Closed: its gauges are gone.
    assert delta(b0, scrape(addr), "tpu_sync_store_blocks", tier="dram") == 0


def test_eviction_and_spill(addr, data, tmp_path):
    b0 = scrape(addr)
    with store() as s:
        a = s.chain_keys(list(range(16 * 16)), 16)
        b = s.chain_keys(list(range(10**6, 10**6 + 4 * 16)), 16)
        assert s.put(a, [data(BLOCK, 100 + i) for i in range(16)]).stored == 16
        assert s.put(b, [data(BLOCK, 200 + i) for i in range(4)]).stored == 4
        b1 = scrape(addr)
        assert delta(b0, b1, "tpu_sync_store_evictions_total") == 4
        assert delta(b0, b1, "tpu_sync_store_disk_spills_total", result="ok") == 0
        assert delta(b0, b1, "tpu_sync_store_blocks", tier="dram") == 16
    with store(disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=64 * (BLOCK + 8192)) as s:
        chain = s.chain_keys(list(range(20 * 16)), 16)
        blocks = [data(BLOCK, 300 + i) for i in range(20)]
        assert s.put(chain, blocks).stored == 20
        b2 = scrape(addr)
        assert delta(b1, b2, "tpu_sync_store_disk_spills_total", result="ok") == 4
        assert delta(b1, b2, "tpu_sync_store_evictions_total") == 4
        # Gauges: against the scrape before either store was open.
        assert delta(b0, b2, "tpu_sync_store_blocks", tier="disk") == 4
        assert delta(b0, b2, "tpu_sync_store_blocks", tier="dram") == 16
        assert delta(b0, b2, "tpu_sync_store_capacity_blocks", tier="disk") == s.info()["disk"]["capacity_blocks"]
        assert s.lookup(chain) == 20
        b3 = scrape(addr)
        assert delta(b2, b3, "tpu_sync_store_lookup_blocks_total", tier="dram", result="hit") == 16
        assert delta(b2, b3, "tpu_sync_store_lookup_blocks_total", tier="dram", result="miss") == 4
        assert delta(b2, b3, "tpu_sync_store_lookup_blocks_total", tier="disk", result="hit") == 4
        assert delta(b2, b3, "tpu_sync_store_lookup_blocks_total", tier="disk", result="miss") == 0
        outs = [bytearray(BLOCK) for _ in chain]
        assert s.get(chain, outs).delivered == 20
        assert [bytes(o) for o in outs] == blocks
        b4 = scrape(addr)
        assert delta(b3, b4, "tpu_sync_store_get_blocks_total", tier="disk") == 4
        assert delta(b3, b4, "tpu_sync_store_get_blocks_total", tier="dram") == 16


def test_checksum_failure_and_restart(addr, data, tmp_path):
    shm_dir = str(tmp_path)
    name = "metrics-" + uuid.uuid4().hex[:8]
    b0 = scrape(addr)
    blocks = [data(BLOCK, 400 + i) for i in range(4)]
    with store(shm_name=name, shm_dir=shm_dir) as s:
        keys = s.chain_keys(list(range(64)), 16)
        s.put(keys, blocks)
    b1 = scrape(addr)
    assert delta(b0, b1, "tpu_sync_store_attach_total", outcome="created") == 1
    with store(shm_name=name, shm_dir=shm_dir) as s:
        b2 = scrape(addr)
        assert delta(b1, b2, "tpu_sync_store_attach_total", outcome="attached") == 1
        assert delta(b1, b2, "tpu_sync_store_restored_blocks_total", tier="dram") == 4
        path = [g["path"] for g in tpu_sync.list_segments(shm_dir) if g["name"] == name][0]
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            at = m.find(blocks[1])
            assert at > 0
            m[at + 7] ^= 0xFF
        with pytest.raises(tpu_sync.errors.ChecksumError):
            s.get(keys, [bytearray(BLOCK) for _ in keys])
        b3 = scrape(addr)
        assert delta(b2, b3, "tpu_sync_checksum_failures_total", source="store") == 1
        # The corrupt block was dropped: one fewer resident.
        assert delta(b2, b3, "tpu_sync_store_blocks", tier="dram") <= -1
    tpu_sync.remove_segment(name, dir=shm_dir)


def test_device_copies_and_pacing(addr, data):
    c = tpu_sync.Client(cpu_devices=1)
    kv = data(2 * 8 * 1024, 60)
    src = c.buffer_from_host(kv, shape=(2, 8, 1024))
    dst = c.buffer_from_host(bytes(len(kv)), shape=(2, 8, 1024))
    b0 = scrape(addr)
    with store(client=c, block_bytes=2048) as s:
        keys = s.chain_keys(list(range(48)), 16)
        plane = 8 * 1024
        pieces = lambda buf, blocks: [[(buf, p * plane + b * 1024, 1024) for p in (0, 1)] for b in blocks]
        assert s.put_from_device(keys, pieces(src, [1, 4, 6])).stored == 3
        assert s.get_to_device(keys, pieces(dst, [7, 0, 3])).delivered == 3
    got = dst.read()
    assert got[7 * 1024:8 * 1024] == kv[1024:2048]
    b1 = scrape(addr)
    assert delta(b0, b1, "tpu_sync_device_copy_bytes_total", direction="d2h") == 3 * 2048
    assert delta(b0, b1, "tpu_sync_device_copy_bytes_total", direction="h2d") == 3 * 2048
    assert delta(b0, b1, "tpu_sync_device_copy_seconds_count", direction="d2h") == 1
    assert delta(b0, b1, "tpu_sync_device_copy_seconds_count", direction="h2d") == 1
    assert delta(b0, b1, "tpu_sync_device_copy_seconds_sum", direction="d2h") > 0
    assert delta(b0, b1, "tpu_sync_device_copy_failures_total", direction="d2h") == 0
    assert v(b1, "tpu_sync_dma_inflight_bytes") == 0
    assert v(b1, "tpu_sync_dma_inflight_limit_bytes") == tpu_sync.pacing()["max_inflight_bytes"]
    assert v(b1, "tpu_sync_dma_inflight_peak_bytes") >= 1024
    src.close()
    dst.close()
    c.close()


def test_switch_off_stops_recording(addr, data):
    b0 = scrape(addr)
    tpu_sync.set_metrics_enabled(False)
    try:
        with store() as s:
            s.put(s.chain_keys(list(range(16)), 16), [data(BLOCK, 1)])
    finally:
        tpu_sync.set_metrics_enabled(True)
    assert delta(b0, scrape(addr), "tpu_sync_store_put_blocks_total", result="stored") == 0


def test_environment_starts_endpoint_on_port_plus_rank(data):
    # The child binds the port itself: a reserved one (tests/cluster_util/ports.py), held until
    # the test ends, not a released ephemeral one another socket may take first.
    held = ports.reserve()
    port = held.port
    child = textwrap.dedent(f"""
        import sys, tpu_sync
        s = tpu_sync.Store(namespace="env", block_bytes={BLOCK}, capacity_bytes={16 * BLOCK}, lock_memory=False)
        s.put(s.chain_keys(list(range(32)), 16), [b"\\x01" * {BLOCK}, b"\\x02" * {BLOCK}])
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    env = dict(os.environ, TPU_SYNC_METRICS_ADDR=f"127.0.0.1:{port - 1}", TPU_SYNC_METRICS_RANK="1")
    p = subprocess.Popen([sys.executable, "-c", child], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        m = scrape(f"127.0.0.1:{port}")
        assert v(m, "tpu_sync_store_put_blocks_total", result="stored") == 2
        assert v(m, "tpu_sync_store_blocks", tier="dram") == 2
    finally:
        p.stdin.close()
        p.wait(timeout=60)
        held.release()
