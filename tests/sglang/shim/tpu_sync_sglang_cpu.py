"""Start-up patches that let SGLang 0.5.23's HiCache run on a CPU-only machine (tests only).

Imported by every interpreter of the test venv (``scripts/install-sglang.sh`` writes a ``.pth``
file naming this folder and this module), so SGLang's spawned scheduler processes get them too.
Importing it costs nothing: it installs an import hook and patches three SGLang modules right
after they are first imported. ``TPU_SYNC_SGLANG_CPU_PATCH=0`` turns it off.

1. ``sglang.srt.mem_cache.pool_host.base``: HiCache keeps ``HICACHE_HOST_MEMORY_RESERVE_BYTES``
   (10 GiB) of host RAM free and refuses host pools otherwise; on a shared 24 GiB test machine
   that leaves nothing. ``TPU_SYNC_SGLANG_HOST_RESERVE_BYTES`` replaces the number when set.
2. Same module: host pools are allocated with ``pin_memory=True``, which raises "Found no NVIDIA
   driver" without CUDA; ``HostKVCache.__init__`` gets ``pin_memory=False`` when
   ``torch.cuda.is_available()`` is False.
3. ``sglang.srt.mem_cache.pool_host.mha`` / ``.mla`` import their ``direct`` I/O-backend copy
   functions only on CUDA/HIP/XPU, so SGLang's own ``direct`` backend raises ``NameError`` on CPU.
   Plain-torch versions of the three functions it calls are put in those modules (only where the
   name is missing). They are the reference the tpu_sync I/O backend is compared against.

:data:`CALLS` counts calls of the injected functions (per process).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Dict

CALLS: Dict[str, int] = {}

_BASE = "sglang.srt.mem_cache.pool_host.base"
_POOLS = ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla")


def _count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Token rows ``src_indices`` of every ``src_layers[i]`` onto rows ``dst_indices`` of
    ``dst_layers[i]`` (tensors indexed by token on dim 0)."""
    _count("transfer_kv_direct")
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device).long()] = src[src_indices.to(src.device).long()].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """Host ``page_first_direct`` buffers ``[page, layer, slot, ...]`` (one per K/V) -> layer
    ``layer_id`` of the device buffers ``[token, ...]``."""
    _count("transfer_kv_per_layer_direct_pf_lf")
    s = src_indices.long()
    page, slot = s // page_size, s % page_size
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_indices.to(dst.device).long()] = src[page, layer_id, slot].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Device per-layer buffers (every layer of the first host buffer, then of the next) -> host
    ``page_first_direct`` buffers ``[page, layer, slot, ...]``."""
    _count("transfer_kv_all_layer_direct_lf_pf")
    d = dst_indices.long()
    page, slot = d // page_size, d % page_size
    layers = len(src_ptrs) // len(dst_ptrs)
    rows = src_indices.long()
    for c, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[c * layers + layer]
            dst[page, layer, slot] = src[rows.to(src.device)].to(dst.device)


_DIRECT = {f.__name__: f for f in (transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf,
                                   transfer_kv_all_layer_direct_lf_pf)}


def _patch_base(module) -> None:
    reserve = os.environ.get("TPU_SYNC_SGLANG_HOST_RESERVE_BYTES")
    if reserve is not None:
        module.HICACHE_HOST_MEMORY_RESERVE_BYTES = int(reserve)
    import torch

    if torch.cuda.is_available():
        return
    original = module.HostKVCache.__init__

    def __init__(self, *args, **kwargs):
        if kwargs.get("pin_memory"):
            _count("HostKVCache.pin_memory")
        kwargs["pin_memory"] = False
        return original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    module.HostKVCache.__init__ = __init__


def _patch_pool(module) -> None:
    for name, fn in _DIRECT.items():
        module.__dict__.setdefault(name, fn)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after the target module's code executed."""

    _targets = {_BASE: _patch_base, **{p: _patch_pool for p in _POOLS}}

    def find_spec(self, fullname, path=None, target=None):
        patch = self._targets.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module, _run=run, _patch=patch):
            _run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TPU_SYNC_SGLANG_CPU_PATCH", "1") != "0" and not any(
        isinstance(f, _AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport())
