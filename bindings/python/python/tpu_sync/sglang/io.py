"""HiCache I/O backend: SGLang's device KV pool (L1) <-> host KV pool (L2) through tpu_sync's
device layer.

Selected by one setting, the environment variable ``TPU_SYNC_HICACHE_IO=1`` of the SGLang
process; the ``tpu_sync`` plugin (``sglang.srt.plugins`` entry point, :func:`tpu_sync.sglang.register`)
then installs hooks through SGLang's hook registry (no SGLang file is edited):

* ``HostKVCache.backup_from_device_all_layer_physical`` (write-back/write-through: device ->
  host, every layer): one batch of asynchronous, paced PJRT raw copies (:func:`tpu_sync.d2h`) of
  the pages' rows of every layer, completed before it returns;
* ``HostKVCache.load_to_device_per_layer_physical`` (host -> device, called by SGLang once per
  layer while the forward pass waits on per-layer events): at the first layer of a load, one
  :func:`tpu_sync.h2d` batch *per layer* is submitted at once (the process-wide pacer issues them
  in order); each per-layer call then waits for its own layer only, so SGLang marks layer ``i``
  done while the later layers are still being copied, as its own kernels do on a stream;
* ``HiCacheController.move_indices``: the indices stay CPU tensors (the copies are described by
  byte offsets computed on the host), for every layout.

Device pool tensors are reached through zero-copy PJRT views (:mod:`tpu_sync.sglang._views`);
host pool tensors are host memory addressed by pointer. Every host layout of the MHA and MLA host
pools is handled (``layer_first``, ``page_first``, ``page_first_direct``, ``page_head``; MLA:
``layer_first``, ``page_first``, ``page_first_direct``); other pools (and the NPU-only
``page_first_kv_split``) keep SGLang's own path. A copy is a run of token rows that is contiguous
on both sides: whole pages for ``page_first_direct``, one token x layer row for ``page_first``,
one head row for ``page_head``.

Counters (:data:`COUNTERS`, and the stats file of :mod:`tpu_sync.sglang.stats` with the
library's pacing counters) show what went through.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

from . import stats
from ._views import flat_bytes, view_of

log = logging.getLogger("tpu_sync.sglang")

#: Environment variable that selects this I/O backend.
ENV = "TPU_SYNC_HICACHE_IO"

#: Calls, pages, layers, copy ops and bytes moved by this process.
COUNTERS: Dict[str, int] = dict(backup_calls=0, backup_tokens=0, backup_bytes=0, load_calls=0, load_layers=0,
                                load_tokens=0, load_bytes=0, copy_ops=0, fallbacks=0)
_lock = threading.Lock()


def enabled() -> bool:
    """Whether ``TPU_SYNC_HICACHE_IO`` selects this backend (``1``/``true``/``yes``)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _count(**kw: int) -> None:
    with _lock:
        for k, v in kw.items():
            COUNTERS[k] += int(v)
    stats.publish("io", lambda: dict(COUNTERS))


# ---- geometry --------------------------------------------------------------------------------


class _Geometry:
    """Byte offsets of token rows in one host pool and its device buffers.

    A *unit* is the smallest piece contiguous on both sides: one token's row of all heads
    (``H * D`` elements) except for ``page_head``, where heads of a token are ``page_size *
    layers`` rows apart on the host, so a unit is one head's row (``D`` elements).
    """

    def __init__(self, pool: Any) -> None:
        import torch

        self.pool = pool
        self.layout = pool.layout
        self.page_size = int(pool.page_size)
        self.mla = hasattr(pool, "device_kv_buffers") and not hasattr(pool, "device_k_buffers")
        if self.mla:
            planes = [list(pool.device_kv_buffers)]
            self.heads, self.dim = 1, int(pool.kv_cache_dim)
        else:
            planes = [list(pool.device_k_buffers), list(pool.device_v_buffers)]
            self.heads, self.dim = int(pool.head_num), int(pool.head_dim)
            if int(getattr(pool, "v_head_dim", self.dim)) != self.dim:
                raise ValueError("tpu_sync I/O backend: K and V head sizes differ")
        self.layers = int(pool.layer_num) if not self.mla else len(planes[0])
        self.elem = int(pool.dtype.itemsize)
        self.head_bytes = self.dim * self.elem
        self.row_bytes = self.heads * self.head_bytes
        for plane in planes:
            for t in plane:
                if not t.is_contiguous() or t.dim() < 2:
                    raise ValueError("tpu_sync I/O backend: device KV buffers must be contiguous token rows")
                if int(t.stride(0)) * int(t.element_size()) != self.row_bytes:
                    raise ValueError("tpu_sync I/O backend: device rows are padded")
        self.device_views = [[view_of(t) for t in plane] for plane in planes]
        self.host = flat_bytes(pool.kv_buffer)
        kv = pool.kv_buffer
        self.size = int(pool.size)
        self.page_num = int(getattr(pool, "page_num", self.size // self.page_size))
        self.unit_is_head = self.layout == "page_head"
        self.unit_bytes = self.head_bytes if self.unit_is_head else self.row_bytes
        self.plane_bytes = int(kv[0].numel()) * self.elem if not self.mla else int(kv.numel()) * self.elem
        del torch

    def host_offsets(self, plane: int, layer: int, tokens: Any) -> Any:
        """Host byte offsets of every unit of ``tokens`` (int64 tensor, shape ``[n]`` or
        ``[n, heads]`` for ``page_head``) of one layer and plane."""
        import torch

        t = tokens.long()
        L, P, R = self.layers, self.page_size, self.row_bytes
        base = plane * self.plane_bytes
        if self.layout == "layer_first":
            return base + (layer * self.size + t) * R
        if self.layout == "page_first":
            return base + (t * L + layer) * R
        if self.layout == "page_first_direct":
            return base + (((t // P) * L + layer) * P + t % P) * R
        if self.layout == "page_head":
            h = torch.arange(self.heads, dtype=torch.long)
            page, slot = (t // P)[:, None], (t % P)[:, None]
            return base + (((page * self.heads + h[None, :]) * P + slot) * L + layer) * self.head_bytes
        raise ValueError(f"tpu_sync I/O backend: layout {self.layout} not handled")

    def device_offsets(self, tokens: Any) -> Any:
        import torch

        t = tokens.long()
        if self.unit_is_head:
            h = torch.arange(self.heads, dtype=torch.long)
            return t[:, None] * self.row_bytes + h[None, :] * self.head_bytes
        return t * self.row_bytes

    def runs(self, plane: int, layer: int, host_tokens: Any, device_tokens: Any) -> List[Tuple[int, int, int]]:
        """``(device offset, host offset, bytes)`` of the copies of one layer and plane: units
        merged into runs that are contiguous on both sides."""
        import torch

        ho = self.host_offsets(plane, layer, host_tokens).reshape(-1)
        do = self.device_offsets(device_tokens).reshape(-1)
        if ho.numel() == 0:
            return []
        u = self.unit_bytes
        brk = torch.ones(ho.numel(), dtype=torch.bool)
        if ho.numel() > 1:
            brk[1:] = (ho[1:] - ho[:-1] != u) | (do[1:] - do[:-1] != u)
        starts = torch.nonzero(brk).reshape(-1)
        ends = torch.cat([starts[1:], torch.tensor([ho.numel()])])
        return [(int(d), int(h), int(n) * u) for d, h, n in
                zip(do[starts].tolist(), ho[starts].tolist(), (ends - starts).tolist())]

    def copies(self, layer: int, host_tokens: Any, device_tokens: Any) -> List[Tuple[Any, int, Any, int]]:
        """tpu_sync copy specs ``(device view, offset, host slice, bytes)`` of one layer (every
        plane)."""
        out = []
        for plane, views in enumerate(self.device_views):
            for d, h, n in self.runs(plane, layer, host_tokens, device_tokens):
                out.append((views[layer], d, self.host[h:h + n], n))
        return out


_geometries: Dict[int, _Geometry] = {}


def _geometry(pool: Any) -> Optional[_Geometry]:
    g = _geometries.get(id(pool))
    if g is not None and g.pool is pool:
        return g
    if not supports(pool):
        return None
    g = _Geometry(pool)
    _geometries[id(pool)] = g
    return g


def supports(pool: Any) -> bool:
    """Whether this backend moves the pages of ``pool`` (an MHA or MLA host pool with one
    contiguous ``kv_buffer`` in a layout above, on a device pool of packed token rows)."""
    if getattr(pool, "layout", None) not in ("layer_first", "page_first", "page_first_direct", "page_head"):
        return False
    kv = getattr(pool, "kv_buffer", None)
    if kv is None or not kv.is_contiguous():
        return False
    if hasattr(pool, "device_k_buffers") and hasattr(pool, "device_v_buffers"):
        return len(pool.device_k_buffers) > 0
    if hasattr(pool, "device_kv_buffers") and getattr(pool, "layout", None) != "page_head":
        return len(getattr(pool, "device_kv_buffers", ())) > 0
    return False


def _cpu(t: Any) -> Any:
    return t.cpu() if t.device.type != "cpu" else t


# ---- the two transfers -----------------------------------------------------------------------


def backup_all_layers(pool: Any, host_indices: Any, device_indices: Any) -> None:
    """Device -> host of every layer of the given token slots (one paced batch, waited for).

    Raises:
        tpu_sync errors from the copies; ValueError for a pool this backend does not handle.
    """
    import tpu_sync

    g = _geometry(pool)
    if g is None:
        raise ValueError(f"tpu_sync I/O backend cannot move pages of {type(pool).__name__} ({pool.layout})")
    hi, di = _cpu(host_indices), _cpu(device_indices)
    specs = []
    for layer in range(g.layers):
        specs.extend(g.copies(layer, hi, di))
    if not specs:
        return
    st = tpu_sync.d2h(specs).wait()
    _count(backup_calls=1, backup_tokens=int(hi.numel()), backup_bytes=st["bytes"], copy_ops=len(specs))


class _PendingLoad:
    """The per-layer copies of one load (host -> device) in flight."""

    def __init__(self, key: Tuple[int, int, int], copies: List[Any], tokens: int) -> None:
        self.key = key
        self.copies = copies
        self.tokens = tokens
        self.done = [False] * len(copies)


_pending: Dict[int, _PendingLoad] = {}


def load_layer(pool: Any, host_indices: Any, device_indices: Any, layer_id: int) -> None:
    """Host -> device of one layer of the given token slots, returning once that layer has
    landed. The first layer of a load submits every layer's batch at once; later layers of the
    same load only wait for theirs.

    Raises:
        tpu_sync errors from the copies (the load's other layers are cancelled).
    """
    import tpu_sync

    g = _geometry(pool)
    if g is None:
        raise ValueError(f"tpu_sync I/O backend cannot move pages of {type(pool).__name__} ({pool.layout})")
    if not 0 <= layer_id < g.layers:
        return
    key = (id(host_indices), id(device_indices), int(host_indices.numel()))
    p = _pending.get(id(pool))
    if p is None or p.key != key or (layer_id == 0 and any(p.done)):
        if p is not None:
            for c in p.copies:
                if c is not None and not c.done:
                    c.wait()
        hi, di = _cpu(host_indices), _cpu(device_indices)
        copies: List[Any] = []
        ops = 0
        for layer in range(g.layers):
            specs = g.copies(layer, hi, di)
            ops += len(specs)
            copies.append(tpu_sync.h2d(specs) if specs else None)
        p = _PendingLoad(key, copies, int(hi.numel()))
        _pending[id(pool)] = p
        _count(load_calls=1, load_tokens=p.tokens, copy_ops=ops)
    c = p.copies[layer_id]
    try:
        if c is not None and not p.done[layer_id]:
            st = c.wait()
            _count(load_layers=1, load_bytes=st["bytes"])
        p.done[layer_id] = True
    except Exception:
        for other in p.copies:
            if other is not None and not other.done:
                other.cancel()
        _pending.pop(id(pool), None)
        raise
    if all(p.done):
        _pending.pop(id(pool), None)


# ---- hooks ----------------------------------------------------------------------------------


def _backup_hook(original, self, device_pool, host_indices, device_indices, io_backend):
    if supports(self):
        return backup_all_layers(self, host_indices, device_indices)
    _count(fallbacks=1)
    return original(self, device_pool, host_indices, device_indices, io_backend)


def _load_hook(original, self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
               is_draft: bool = False):
    if supports(self) and not is_draft:
        return load_layer(self, host_indices, device_indices, layer_id)
    _count(fallbacks=1)
    return original(self, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft)


def _move_indices_hook(original, self, host_indices, device_indices):
    if supports(getattr(self, "mem_pool_host", None)):
        return _cpu(host_indices), _cpu(device_indices)
    return original(self, host_indices, device_indices)


def install_hooks() -> bool:
    """Registers the hooks with SGLang's ``HookRegistry`` (applied by SGLang's ``load_plugins``
    in every process) when :func:`enabled`; returns whether it did."""
    if not enabled():
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    base = "sglang.srt.mem_cache.pool_host.base.HostKVCache"
    HookRegistry.register(f"{base}.backup_from_device_all_layer_physical", _backup_hook, HookType.AROUND)
    HookRegistry.register(f"{base}.load_to_device_per_layer_physical", _load_hook, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.cache_controller.HiCacheController.move_indices",
                          _move_indices_hook, HookType.AROUND)
    log.info("tpu_sync.sglang: HiCache I/O goes through tpu_sync (%s=1)", ENV)
    return True


__all__ = ["COUNTERS", "ENV", "backup_all_layers", "enabled", "install_hooks", "load_layer", "supports"]
