"""tpu_sync.vllm without vLLM and torch installed (this suite's virtualenv has neither): the
package, its config and compatibility helpers import, and the vllm.general_plugins entry point
is a harmless no-op. The connector itself is tested with a real engine in tests/vllm/."""

import subprocess
import sys
import textwrap

import pytest


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


def test_imports_without_vllm_or_torch():
    r = run("""
        import sys, importlib.util
        assert importlib.util.find_spec("vllm") is None and importlib.util.find_spec("torch") is None
        import tpu_sync.vllm as v
        from tpu_sync.vllm import compat, config
        assert "vllm" not in sys.modules and "torch" not in sys.modules
        assert v.register() is None          # no vLLM: nothing to register, no error
        c = config.ConnectorConfig.parse("kv_both", {"shm_name": "s"})
        assert c.offload and not c.pd
        g = compat.KvGeometry("m", 2, 2, 2, 32, "f32", 32, 1, "vllm-cpu/vec/float32")
        assert g.block_bytes == 2 * 2 * 32 * 64 * 4
        assert g.tpu_sync_layout(8)["spec"]["order"] == "lbhnc"
        try:
            v.TpuSyncConnector
        except ImportError as e:
            assert "vllm" in str(e)
        else:
            raise AssertionError("TpuSyncConnector needs vLLM")
        print("ok")
    """)
    if "find_spec" in r.stderr and "AssertionError" in r.stderr:
        pytest.skip("vLLM or torch is installed in this environment")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_tpu_sync_plan_accepts_vllm_layouts():
    """The LBHNC layout the connector sends is planned by the native library: whole blocks when
    TP matches, and refused when block formats differ."""
    import tpu_sync
    from tpu_sync.errors import MismatchError
    from tpu_sync.vllm.compat import KvGeometry, placement

    g = KvGeometry("m", 2, 2, 2, 32, "f32", 32, 1, "vllm-cpu/vec/float32")
    src = placement(g.tpu_sync_layout(16), [3, 9, 4])
    dst = placement(g.tpu_sync_layout(16), [0, 1, 2])
    plan = tpu_sync.Plan(src, dst, 70)
    assert plan.total_bytes == 3 * g.block_bytes
    assert all(s.len % g.layer_block_bytes == 0 for s in plan.spans())
    other = KvGeometry("m", 2, 2, 2, 32, "f32", 32, 1, "vllm-cpu/amx/bfloat16")
    with pytest.raises(MismatchError):
        tpu_sync.Plan(src, placement(other.tpu_sync_layout(16), [0, 1, 2]), 70)
