"""A CPU test stand-in for SGLang's ``sgl_kernel`` package (tests only; never used in production).

Why: the ``sglang-kernel`` wheel on PyPI is CUDA-only (``import sgl_kernel`` fails without
``libcuda.so.1``) and has none of the CPU ops that SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``)
imports at module level. ``scripts/install-sglang.sh`` leaves the real package out of the venv and
puts this folder on ``sys.path`` instead.

What it provides:

* ``assign_req_to_token_pool_cpu`` and ``copy_all_layer_kv_cache_cpu``, the two CPU ops SGLang's
  memory code imports by name on the CPU path, written in torch (same arguments as the real ops
  of ``sgl_kernel/csrc/cpu``);
* every other attribute, and every ``sgl_kernel.<submodule>``, resolves to a stub that raises
  ``NotImplementedError`` naming itself when called, so that imports succeed and a real need shows
  up as a clear error (and is counted in :data:`CALLED`);
* ``sgl_kernel.scalar_type`` is absent (``ImportError``): SGLang then uses its own mock scalar
  types (``sglang.srt.layers.quantization.utils.get_scalar_types``), which is all an
  unquantized model needs.

``torch.ops.sgl_kernel.convert_weight_packed`` is never defined, so SGLang's
``cpu_has_amx_support()`` is False and layers take their plain torch paths.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Dict

__version__ = "0.0.0+tpu-sync-cpu-test-shim"

#: Calls of stubs and CPU ops, by qualified name.
CALLED: Dict[str, int] = {}

#: Submodules that must raise ImportError so that SGLang takes its fallback.
_ABSENT = {"sgl_kernel.scalar_type"}


def _count(name: str) -> None:
    CALLED[name] = CALLED.get(name, 0) + 1


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = out_cache_loc[...]``,
    the locations of request ``i`` taken in order from ``out_cache_loc``."""
    _count("assign_req_to_token_pool_cpu")
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        req_to_token[row, s:e] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Moves rows inside each KV buffer: buffer ``i`` starts at address ``data_ptrs[i]`` and its
    rows are ``strides[i]`` bytes apart; row ``src_loc[j]`` is copied onto row ``tgt_loc[j]``."""
    import ctypes

    _count("copy_all_layer_kv_cache_cpu")
    pairs = [(int(s), int(t)) for s, t in zip(src_loc.tolist(), tgt_loc.tolist()) if s != t]
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for s, t in pairs:
            ctypes.memmove(int(base) + t * int(stride), int(base) + s * int(stride), int(stride))


def _stub(qualname: str):
    def stub(*args, **kwargs):
        _count(qualname)
        raise NotImplementedError(f"{qualname} is not available in the tpu-sync CPU test shim of sgl_kernel")

    stub.__name__ = qualname.rsplit(".", 1)[-1]
    stub.__qualname__ = qualname
    return stub


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _stub(f"sgl_kernel.{name}")


class _StubModule(types.ModuleType):
    """A ``sgl_kernel.<submodule>`` whose every attribute is a stub."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{self.__name__}.{name}")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("sgl_kernel."):
            return None
        if fullname in _ABSENT:
            raise ImportError(f"{fullname} is not part of the tpu-sync CPU test shim")
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
