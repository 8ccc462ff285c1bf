"""tpu_sync Python API against the real CPU PJRT plugin."""

import json
import sys
import time

import pytest

import tpu_sync
from tpu_sync import errors


def test_import_needs_no_torch():
    assert "torch" not in sys.modules or True  # torch may be installed; the package must not import it
    import importlib
    import subprocess

    code = "import sys, tpu_sync; assert 'torch' not in sys.modules and 'numpy' not in sys.modules; print(tpu_sync.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == tpu_sync.__version__
    assert importlib.import_module("tpu_sync").ABI_VERSION >= 1


def test_client_info_and_device_buffer_round_trip(data):
    with tpu_sync.Client(cpu_devices=2) as c:
        info = c.info
        assert info["platform"] == "cpu"
        assert c.device_count == 2
        assert {"device", "pinned_host", "unpinned_host"} <= set(info["devices"][0]["memory_kinds"])
        src = data(1 << 16, 3)
        with c.buffer_from_host(src, device=1) as b:
            assert b.size == len(src)
            assert b.read() == src
            patch = data(4000, 4)
            b.write(1000, patch)
            expect = src[:1000] + patch + src[5000:]
            assert b.read() == expect
            out = bytearray(16)
            b.read(5000, 16, out)
            assert bytes(out) == src[5000:5016]
            with pytest.raises(errors.InvalidArgumentError):
                b.read(len(src) - 8, 16)


def test_numpy_arrays_are_read_with_shape_and_dtype(data):
    np = pytest.importorskip("numpy")
    a = np.frombuffer(data(4 * 1024, 5), dtype=np.float32).reshape(32, 32).copy()
    with tpu_sync.Client(cpu_devices=1) as c, c.buffer_from_host(a) as b:
        assert b.size == a.nbytes
        back = np.zeros_like(a)
        b.read(out=back)
        assert np.array_equal(back.view(np.uint32), a.view(np.uint32))
        with pytest.raises(errors.InvalidArgumentError):
            c.buffer_from_host(a[:, ::2])  # not contiguous


def test_exceptions_carry_status_and_message():
    with pytest.raises(errors.PluginLoadError) as e:
        tpu_sync.Client(plugin="/nonexistent/plugin.so")
    assert e.value.status == 4
    assert "cannot load PJRT plugin" in e.value.message
    assert isinstance(e.value, OSError) and isinstance(e.value, tpu_sync.TpuSyncError)
    c = tpu_sync.Client(cpu_devices=1)
    c.close()
    with pytest.raises(errors.InvalidHandleError):
        c.device_count
    c.close()  # idempotent


def _placements(tokens=100):
    m = tpu_sync.model("t", num_layers=2, num_kv_heads=4, head_dim=8)
    src_l = tpu_sync.layout(m, tp=2, block_size=16, order="nhd", num_blocks=20)
    dst_l = tpu_sync.layout(m, tp=1, block_size=32, order="hnd", num_blocks=10)
    nsrc, ndst = -(-tokens // 16), -(-tokens // 32)
    src = tpu_sync.placement(src_l, [list(range(19, 19 - nsrc, -1)), list(range(nsrc))])
    dst = tpu_sync.placement(dst_l, [[9, 3, 5, 1][:ndst]])
    return src, dst


def test_plan_spans_cover_the_request():
    src, dst = _placements(100)
    with tpu_sync.Plan(src, dst, 100) as p:
        # 100 tokens x 2 layers x 2 planes x 4 heads x 8 dims x 2 bytes
        assert p.total_bytes == 100 * 2 * 2 * 4 * 8 * 2
        spans = p.spans()
        assert len(spans) == p.num_spans > 0
        assert sum(s.len * s.count for s in spans) == p.total_bytes
        assert {s.src_rank for s in spans} == {0, 1} and {s.dst_rank for s in spans} == {0}


def test_plan_errors_are_typed():
    src, dst = _placements(100)
    bad = json.loads(json.dumps(dst))
    bad["block_ids"][0][0] = 10
    with pytest.raises(errors.BlockRangeError):
        tpu_sync.Plan(src, bad, 100)
    other = json.loads(json.dumps(dst))
    other["layout"]["model"]["num_kv_heads"] = 8
    with pytest.raises(errors.MismatchError):
        tpu_sync.Plan(src, other, 100)
    broken = dict(dst, layout="nonsense")
    with pytest.raises(errors.InvalidArgumentError):
        tpu_sync.Plan(src, broken, 100)


def test_no_handle_leak_over_10000_cycles():
    src, dst = _placements(40)
    before = tpu_sync.live_handles()
    for _ in range(10_000):
        p = tpu_sync.Plan(src, dst, 40)
        p.close()
    c = tpu_sync.Client(cpu_devices=1)
    for _ in range(200):
        with c.buffer_from_host(b"0123456789abcdef"):
            pass
    c.close()
    assert tpu_sync.live_handles() == before


def test_panic_inside_becomes_an_exception():
    from tpu_sync._lib import check
    from tpu_sync._native import lib

    with pytest.raises(errors.InternalError) as e:
        check(lib.tpu_sync_debug_panic())
    assert "panic" in e.value.message


def test_every_native_status_has_a_typed_exception():
    from tpu_sync._native import ffi, lib

    for code, name in errors.STATUS_NAMES.items():
        assert ffi.string(lib.tpu_sync_status_name(code)).decode() == name
        if code == 0:
            continue
        e = errors.from_status(code, "m")
        assert type(e) is not errors.TpuSyncError, name  # a specific class per status
        assert e.status == code and e.message == "m" and name in str(e)
    # Nothing the library defines is missing from the table.
    for code in range(0, 128):
        n = ffi.string(lib.tpu_sync_status_name(code)).decode()
        assert (n == "TPU_SYNC_UNKNOWN_STATUS") == (code not in errors.STATUS_NAMES), code
    assert issubclass(errors.PendingError, TimeoutError) and issubclass(errors.TimeoutError, TimeoutError)
    assert issubclass(errors.InvalidArgumentError, ValueError) and issubclass(errors.PeerClosedError, ConnectionError)
    assert issubclass(errors.UnknownRequestError, KeyError) and issubclass(errors.HostMemoryError, MemoryError)


def test_no_handle_leak_over_10000_copy_and_view_cycles(data):
    np = pytest.importorskip("numpy")
    c = tpu_sync.Client(cpu_devices=1)
    b = c.buffer_from_host(data(4096, 9))
    host = bytearray(4096)
    before = tpu_sync.live_handles()
    for _ in range(10_000):
        cp = tpu_sync.d2h([(b, 0, host)])
        cp.wait(10)
        cp.close()
    assert bytes(host) == data(4096, 9)
    a = tpu_sync.aligned_array(4096, np.uint8)
    for _ in range(1000):
        v = c.view(a)
        v.close()
    assert v.wait_released(5)
    import tpu_sync.client as tc

    deadline = time.monotonic() + 10
    while tc._collect_released_views() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tpu_sync.live_handles() == before
    b.close()
    c.close()
