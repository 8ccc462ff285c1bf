"""The host KV tier through the Python API: round trips from host and device memory, keys,
leases, checksums, a warm restart in a second process, segments. Real XLA CPU plugin."""

import gc
import mmap
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

import tpu_sync
from tpu_sync import errors

BLOCK = 4096


def small_store(**kw):
    args = dict(namespace="py-test bf16 tp=1 block=16", block_bytes=BLOCK, capacity_bytes=16 * BLOCK,
                lock_memory=False, populate=False)
    args.update(kw)
    return tpu_sync.Store(**args)


def test_host_round_trip(data):
    with small_store() as s:
        assert s.state == "ready"
        tokens = list(range(1000, 1000 + 8 * 16 + 5))
        keys = s.chain_keys(tokens, 16)
        assert len(keys) == 8 and all(isinstance(k, bytes) and len(k) == 16 for k in keys)
        assert len(set(keys)) == 8
        # Keys chain: the tail computed on its parent equals the chain's tail.
        assert s.chain_keys(tokens[48:128], 16, parent=keys[2]) == keys[3:]
        blocks = [data(BLOCK - i, 40 + i) for i in range(8)]
        r = s.put(keys[:5], blocks[:5])
        assert (r.stored, r.present, r.full_at, r.not_ready, r.bytes) == (5, 0, None, False, sum(map(len, blocks[:5])))
        assert r.complete
        assert s.put(keys[5:], blocks[5:], parent=keys[4]).stored == 3
        assert s.put(keys[:2], blocks[:2]).present == 2
        assert s.lookup(keys) == 8
        outs = [bytearray(len(b)) for b in blocks]
        g = s.get(keys, outs)
        assert (g.delivered, g.from_dram, g.from_disk, g.stop) == (8, 8, 0, None)
        assert [bytes(o) for o in outs] == blocks
        # A gap: the prefix is delivered, and the result says why it stopped.
        other = s.engine_key(b"not stored")
        g = s.get([keys[0], keys[1], other], outs[:3])
        assert g.delivered == 2 and g.stop == "missing"
        assert s.lookup([keys[0], other, keys[2]]) == 1
        # Leases pin the present prefix; clear leaves it (and its prefixes) alone.
        with s.pin([keys[0], keys[1], other]) as lease:
            assert lease.count == 2 and lease.keys == keys[:2]
            assert s.clear() == 6
            assert s.lookup(keys) == 2
        assert s.remove(keys[:1]) == 2
        assert s.lookup(keys) == 0
        st = s.stats()
        assert st["put_blocks"] == 8 and st["get_dram"] == 10 and st["dram_blocks"] == 0
        info = s.info()
        assert info["attach"] == "anonymous" and info["block_bytes"] == BLOCK


def test_numpy_and_torch_blocks(data):
    np = pytest.importorskip("numpy")
    with small_store() as s:
        keys = s.chain_keys(list(range(32)), 16)
        a = np.frombuffer(data(BLOCK, 50), np.uint8).view(np.float32).reshape(32, 32)
        b = np.frombuffer(data(BLOCK, 51), np.uint8).view(np.float32).reshape(32, 32)
        assert s.put(keys, [a, b]).stored == 2
        out = [np.zeros_like(a), np.zeros_like(b)]
        assert s.get(keys, out).delivered == 2
        assert out[0].tobytes() == a.tobytes() and out[1].tobytes() == b.tobytes()
        with pytest.raises(errors.InvalidArgumentError):
            s.get(keys, [np.zeros(10, np.uint8), out[1]])  # wrong length
        torch = pytest.importorskip("torch")
        t = torch.randn(16, 64, dtype=torch.bfloat16)
        k = s.engine_key(123456789)
        assert s.put([k], [t]).stored == 1
        back = torch.empty_like(t)
        assert s.get([k], [back]).delivered == 1 and torch.equal(back.view(torch.int16), t.view(torch.int16))


def test_engine_keys():
    with small_store() as s, small_store(namespace="another model") as o:
        assert s.engine_key(b"abc") == s.engine_key("abc")
        assert s.engine_key(42) == s.engine_key("42")
        assert s.engine_key(b"abc") != s.engine_key(b"abd")
        assert s.engine_key(b"abc") != o.engine_key(b"abc")
        assert s.chain_keys([1, 2, 3], 16) == []
        with pytest.raises(errors.InvalidArgumentError):
            s.chain_keys([1, 2, 3], 0)
        with pytest.raises(errors.InvalidArgumentError):
            s.chain_keys([-1] * 16, 16)
        with pytest.raises(errors.InvalidArgumentError):
            s.lookup([b"short"])


def test_device_round_trip(data):
    c = tpu_sync.Client(cpu_devices=1)
    kv = data(2 * 8 * 1024, 60)  # one layer, [K|V] x 8 blocks x 1 KiB
    src = c.buffer_from_host(kv, shape=(2, 8, 1024))
    dst = c.buffer_from_host(bytes(len(kv)), shape=(2, 8, 1024))
    with small_store(client=c) as s:
        keys = s.chain_keys(list(range(48)), 16)
        plane = 8 * 1024
        pieces = lambda buf, blocks: [[(buf, p * plane + b * 1024, 1024) for p in (0, 1)] for b in blocks]
        assert s.put_from_device(keys, pieces(src, [1, 4, 6])).stored == 3
        g = s.get_to_device(keys, pieces(dst, [7, 0, 3]))
        assert g.delivered == 3
        got = dst.read()
        for b_src, b_dst in zip([1, 4, 6], [7, 0, 3]):
            for p in (0, 1):
                assert got[p * plane + b_dst * 1024:][:1024] == kv[p * plane + b_src * 1024:][:1024]
        for b in (1, 2, 4, 5, 6):
            assert got[b * 1024:(b + 1) * 1024] == bytes(1024)
        with pytest.raises(errors.InvalidArgumentError):
            s.put_from_device([s.engine_key(b"x")], [[(src, 2 * plane - 10, 20)]])  # past the end
        host = [bytearray(2048) for _ in keys]
        assert s.get(keys, host).delivered == 3
        assert bytes(host[0][:1024]) == kv[1024:2048]
    src.close()
    dst.close()
    c.close()


def test_bad_configuration_is_typed():
    with pytest.raises(errors.InvalidArgumentError):
        small_store(block_bytes=0)
    with pytest.raises(errors.InvalidArgumentError):
        small_store(shm_name="../escape")
    with pytest.raises(errors.InvalidArgumentError):
        small_store(disk_dir="/tmp")  # without a capacity
    with pytest.raises(TypeError):
        tpu_sync.Store("positional", 1, 2)  # keyword-only


def test_a_capacity_the_machine_cannot_hold_is_refused_before_allocating():
    # 1 PiB: an error naming the capacity, not an abort on a failed allocation.
    with pytest.raises((errors.HostMemoryError, errors.StagingExhaustedError)) as e:
        small_store(block_bytes=1 << 20, capacity_bytes=1 << 50)
    assert "capacity" in str(e.value) or "staging" in str(e.value), e.value
    # Past a budget raised out of the way, the machine's memory refuses it.
    with pytest.raises(errors.HostMemoryError, match="host tier's capacity"):
        small_store(block_bytes=1 << 20, capacity_bytes=1 << 50, staging_budget_bytes=1 << 60)
    # The same process still creates a store that fits.
    with small_store() as s:
        assert s.stats()["free_slots"] == 16


@pytest.fixture
def shm_dir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


def test_checksum_failure_raises(shm_dir, data):
    name = "py-" + uuid.uuid4().hex[:8]
    with small_store(shm_name=name, shm_dir=shm_dir) as s:
        keys = s.chain_keys(list(range(64)), 16)
        blocks = [data(BLOCK, 70 + i) for i in range(4)]
        s.put(keys, blocks)
        path = [g["path"] for g in tpu_sync.list_segments(shm_dir) if g["name"] == name][0]
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            at = m.find(blocks[2])
            assert at > 0
            m[at + 100] ^= 0xFF  # corrupt block 2 behind the store's back
        outs = [bytearray(BLOCK) for _ in keys]
        with pytest.raises(errors.ChecksumError) as e:
            s.get(keys, outs)
        assert e.value.status == 11
        # The corrupt block and its chain below it are gone; the prefix still serves.
        assert s.lookup(keys) == 2
        assert s.stats()["corrupt_blocks"] >= 1
    tpu_sync.remove_segment(name, dir=shm_dir)


def test_warm_restart_in_another_process(shm_dir, data):
    name = "py-" + uuid.uuid4().hex[:8]
    blocks = [data(BLOCK, 80 + i) for i in range(6)]
    writer = textwrap.dedent(f"""
        import os, sys, tpu_sync
        s = tpu_sync.Store(namespace="warm", block_bytes={BLOCK}, capacity_bytes={16 * BLOCK},
                           shm_name="{name}", shm_dir="{shm_dir}", lock_memory=False)
        keys = s.chain_keys(list(range(96)), 16)
        blocks = [bytes.fromhex(h) for h in sys.stdin.read().split()]
        assert s.put(keys, blocks).stored == 6
        sys.stdout.write(" ".join(k.hex() for k in keys))
        sys.stdout.flush()
        os._exit(0)  # no clean shutdown
    """)
    out = subprocess.run([sys.executable, "-c", writer], input=" ".join(b.hex() for b in blocks),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    keys = [bytes.fromhex(h) for h in out.stdout.split()]
    segs = [g for g in tpu_sync.list_segments(shm_dir) if g["name"] == name]
    assert len(segs) == 1 and segs[0]["committed_blocks"] == 6 and not segs[0]["in_use"]
    with tpu_sync.Store(namespace="warm", block_bytes=BLOCK, capacity_bytes=16 * BLOCK, shm_name=name,
                        shm_dir=shm_dir, lock_memory=False) as s:
        assert s.info()["attach"] == "attached" and s.info()["restored_dram_blocks"] == 6
        assert s.chain_keys(list(range(96)), 16) == keys
        assert s.lookup(keys) == 6
        outs = [bytearray(BLOCK) for _ in keys]
        assert s.get(keys, outs).delivered == 6
        assert [bytes(o) for o in outs] == blocks
        with pytest.raises(errors.IOError):
            tpu_sync.remove_segment(name, dir=shm_dir)  # in use
    tpu_sync.remove_segment(name, dir=shm_dir)
    assert not [g for g in tpu_sync.list_segments(shm_dir) if g["name"] == name]
    with pytest.raises(errors.IOError):
        tpu_sync.remove_segment(name, dir=shm_dir)


def test_background_preparation(shm_dir):
    s = small_store(background=True)
    s.wait_ready(30)
    assert s.state == "ready"
    s.close()
    with pytest.raises(errors.InvalidHandleError):
        s.lookup([])


def test_disk_tier_flush(tmp_path, data):
    with small_store(disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=64 * (BLOCK + 8192)) as s:
        keys = s.chain_keys(list(range(32)), 16)
        blocks = [data(BLOCK, 90), data(BLOCK, 91)]
        s.put(keys, blocks)
        assert s.flush_to_disk() == 2
        assert s.stats()["disk_blocks"] == 2
    with small_store() as s:
        with pytest.raises(errors.InvalidArgumentError):
            s.flush_to_disk()


def test_no_handle_leak_over_10000_lease_cycles(data):
    with small_store() as s:
        keys = s.chain_keys(list(range(64)), 16)
        s.put(keys, [data(BLOCK, 95 + i) for i in range(4)])
        gc.collect()  # handles of earlier tests' objects awaiting the cycle collector
        before = tpu_sync.live_handles()
        for _ in range(10_000):
            lease = s.pin(keys)
            lease.close()
        assert tpu_sync.live_handles() == before
        assert s.clear() == 4  # nothing left pinned
    for _ in range(200):
        small_store().close()
    assert tpu_sync.live_handles() == before - 1


def test_store_operations_after_close_raise():
    s = small_store()
    s.close()
    for op in (lambda: s.lookup([]), lambda: s.stats(), lambda: s.chain_keys([1] * 16, 16)):
        with pytest.raises(errors.InvalidHandleError):
            op()
    assert os.path.exists("/dev/shm")  # the default segment directory the CLI also uses
