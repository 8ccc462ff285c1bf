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


def test_grouped_vllm_layouts_plan_each_groups_held_blocks():
    """A hybrid model's KV cache groups (a sliding window of 48 tokens on layer 0, full attention
    on layer 1, as the connector reads vLLM's KVCacheConfig): each group's held blocks from
    vLLM's per-group block ids (the null block, id 0, before the window), planned by the native
    library as whole LBHNC blocks per group; bad group counts and shapes are refused."""
    import tpu_sync
    from tpu_sync.vllm.compat import KvGeometry, placement, pullers_of_rank

    groups = ({"kind": "attention", "layers": [0], "sliding_window": 48},
              {"kind": "attention", "layers": [1], "sliding_window": None})
    g = KvGeometry("m", 2, 2, 2, 32, "f32", 32, 1, "vllm-cpu/vec/float32", groups=groups)
    assert g.num_groups == 2 and g.group_of_layer() == [0, 1]
    # 100 tokens: the window [53, 100) lies in blocks 1..3; full attention holds blocks 0..3.
    held = g.group_held_ids(([0, 12, 13, 14], [9, 4, 7, 3]), 100)
    assert held == [[12, 13, 14], [9, 4, 7, 3]]
    src = placement(g.tpu_sync_layout(16), held)
    dst = placement(g.tpu_sync_layout(16), [[1, 2, 5], [6, 8, 10, 11]])
    with tpu_sync.Plan(src, dst, 100) as plan:
        assert plan.total_bytes == (3 + 4) * g.layer_block_bytes
        moved = {}
        for s in plan.spans():
            moved[s.dst_buffer] = moved.get(s.dst_buffer, 0) + s.len * s.count
        assert moved == {0: 3 * g.layer_block_bytes, 1: 4 * g.layer_block_bytes}
    assert [pullers_of_rank(src, 0, 100, tp) for tp in (1, 2)] == [1, 2]
    with pytest.raises(ValueError, match="2 KV cache groups"):
        g.group_held_ids(([9, 4, 7, 3],), 100)
    with pytest.raises(ValueError, match="null block"):
        g.group_held_ids(([0, 0, 13, 14], [9, 4, 7, 3]), 100)
    with pytest.raises(ValueError, match="has 3 blocks"):
        g.group_held_ids(([0, 12, 13, 14], [9, 4, 7]), 100)
    with pytest.raises(ValueError, match="one list per KV cache group"):
        placement(g.tpu_sync_layout(16), [12, 13, 14])
    # A held list of the wrong length for its window is refused by the native library.
    with pytest.raises(tpu_sync.errors.TpuSyncError):
        tpu_sync.Plan(placement(g.tpu_sync_layout(16), [[11, 12, 13, 14], [9, 4, 7, 3]]), dst, 100)
    # The uniform form is unchanged: no groups, the same namespace as before groups existed.
    u = KvGeometry("m", 2, 2, 2, 32, "f32", 32, 1, "vllm-cpu/vec/float32")
    assert u.namespace() == "vllm/m/vllm-cpu/vec/float32/bs32/L2/H2/D32/tp1"
    assert g.namespace() == u.namespace() + "/groups=sw48:0;full:1"
