"""tpu_sync.sglang without SGLang and torch installed (this suite's virtualenv has neither): the
package and its SGLang-free modules import, and the sglang.srt.plugins entry point is a harmless
no-op. The backends themselves are tested against real SGLang in tests/sglang/."""

import subprocess
import sys
import textwrap


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


def test_imports_without_sglang_or_torch():
    r = run("""
        import sys, importlib.util, os
        assert importlib.util.find_spec("sglang") is None and importlib.util.find_spec("torch") is None
        import tpu_sync.sglang as s
        from tpu_sync.sglang import pages, stats
        assert s.register() is None          # no SGLang: nothing to install, no error
        assert "sglang" not in sys.modules and "torch" not in sys.modules
        assert not stats.enabled() and stats.collect("/nonexistent", "io") == []
        try:
            s.TpuSyncStorage
        except ImportError:
            pass                              # needs SGLang
        else:
            raise AssertionError("TpuSyncStorage imported without SGLang")
    """)
    assert r.returncode == 0, r.stderr


def test_entry_point_is_declared():
    r = run("""
        from importlib.metadata import entry_points
        eps = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}
        assert eps.get("tpu_sync") == "tpu_sync.sglang:register", eps
    """)
    assert r.returncode == 0, r.stderr
