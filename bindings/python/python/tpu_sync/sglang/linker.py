"""``TpuSyncLinker``: SGLang's unified-cache external linker on tpu_sync's host tier.

Loaded by SGLang's linker factory without any SGLang patch::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "TpuSyncLinker",
        "linker_module_path": "tpu_sync.sglang.linker",
        "linker_extra_config": {"shm_name": "sglang-linker", "host_capacity_bytes": 8589934592}}'

SGLang builds it per scheduler (TP rank) as ``TpuSyncLinker(server_args, params,
components=..., extra_config=..., forward_stream=...)``
(``sglang/srt/mem_cache/unified_cache/linker_factory.py``) and drives it from its
``UnifiedCacheLinkerWrapper``: ``lookup`` when a request's prefix is matched, ``load`` when the
hit is admitted, ``start_layer_wise_loading`` before the batch's forward (which waits on
``layer_done_counter`` layer by layer), ``finish_layer_wise_loading`` after it, ``offload`` for
every page chain the radix tree writes through, ``num_completed_offloads`` /
``pop_completed_offload`` once per scheduler step, ``cancel_queued_load``, ``reset``, ``close``.
There is no host KV pool in between (SGLang's linker path excludes HiCache): pages move between
SGLang's *device* KV pool and one :class:`tpu_sync.Store` per rank.

* **Entries.** One tier entry is one SGLang page of every layer, plane-major: ``K`` of layers
  ``0..L-1`` then ``V`` of layers ``0..L-1`` (MLA: the latent plane), each ``page_size`` token
  rows (:mod:`tpu_sync.sglang._devpool`). Keys are SGLang's page hashes
  (``get_storage_hash_str``, a SHA-256 chain, so a key names its whole prefix) through
  :meth:`tpu_sync.Store.engine_key`.
* **Offload** (device -> tier): an offload thread stores each chain straight from the device
  buffers with :meth:`tpu_sync.Store.put_from_device` (zero-copy PJRT views, D2H into the tier's
  slots); the result is reported in order through ``num_completed_offloads`` /
  ``pop_completed_offload``.
* **Lookup** reads the hit pages, verified against their checksums, into a host staging
  buffer, and reports only the verified leading run. A page that fails its checksum is
  therefore a miss from there on (the store drops it and its chain), so SGLang recomputes it.
  This read comes before SGLang commits to the hit, because SGLang aborts a request whose
  admitted load fails. Staging is bounded (``staging_bytes``); a hit beyond the budget is cut
  (the rest is recomputed), and the oldest unadmitted staging is dropped first.
* **Layer-wise load** (tier -> device): ``start_layer_wise_loading`` submits one batch of
  asynchronous, paced H2D copies per layer (:func:`tpu_sync.h2d`, into zero-copy views of the
  device buffers) for every queued request, and a load thread completes
  ``layer_done_counter`` layer by layer as each batch lands, so the forward pass computes layer
  ``i`` while later layers are still being copied. A failed copy fails its layer and the rest
  of the batch: ``finish_layer_wise_loading`` returns False and SGLang aborts those requests.
* **Namespaces** (:func:`namespace_of`): model, pool kind (MHA/MLA), dtype, page size and
  entry bytes, layers, heads, PP rank, and TP rank and size for MHA (MLA KV is replicated over
  TP, so MLA ranks share a namespace).

Extra config keys (``linker_extra_config``): ``host_capacity_bytes`` (default 1 GiB),
``shm_name`` (keep the tier in ``/dev/shm/<shm_name>-tp<rank>``, MLA ``<shm_name>``, for a
warm restart), ``shm_dir``, ``disk_dir`` + ``disk_capacity_bytes``, ``verify_checksums``
(default true), ``namespace`` (extra text in the namespace), ``staging_bytes`` (default
256 MiB). An unknown key is an error.

Only full-attention models (``ComponentType.FULL``) are handled: SWA and Mamba pools need the
library's KV cache groups, and are refused at construction with a clear error.

Thread-safety: SGLang calls the linker from its scheduler thread; the load and offload threads
are internal. Every method may run while they work.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from . import stats
from ._devpool import DevicePool, pages_of_slots

log = logging.getLogger("tpu_sync.sglang")

#: Default DRAM bytes of each rank's tier.
DEFAULT_HOST_CAPACITY = 1 << 30
#: Default bytes of host staging for verified hits awaiting their load.
DEFAULT_STAGING = 256 << 20

_KEYS = {
    "host_capacity_bytes": (int, float),
    "shm_name": str,
    "shm_dir": str,
    "disk_dir": str,
    "disk_capacity_bytes": (int, float),
    "verify_checksums": bool,
    "namespace": str,
    "staging_bytes": (int, float),
}


class LinkerConfigError(ValueError):
    """An invalid ``linker_extra_config`` for :class:`TpuSyncLinker`."""


def parse_extra_config(extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Checks the linker's extra config and fills defaults.

    Raises:
        LinkerConfigError: an unknown key, a value of the wrong type, sizes <= 0, a disk tier
            without its capacity.
    """
    out: Dict[str, Any] = dict(host_capacity_bytes=DEFAULT_HOST_CAPACITY, shm_name=None, shm_dir=None, disk_dir=None,
                               disk_capacity_bytes=None, verify_checksums=True, namespace="",
                               staging_bytes=DEFAULT_STAGING)
    for k, v in dict(extra or {}).items():
        if k not in _KEYS:
            raise LinkerConfigError(f"unknown linker_extra_config key {k!r} for TpuSyncLinker "
                                    f"(known: {', '.join(sorted(_KEYS))})")
        want = _KEYS[k]
        if (want is bool) != isinstance(v, bool) or not isinstance(v, want):
            raise LinkerConfigError(f"linker_extra_config[{k!r}] has the wrong type: {v!r}")
        out[k] = v
    for k in ("host_capacity_bytes", "staging_bytes"):
        out[k] = int(out[k])
        if out[k] <= 0:
            raise LinkerConfigError(f"{k} must be > 0")
    if (out["disk_dir"] is None) != (out["disk_capacity_bytes"] is None):
        raise LinkerConfigError("disk_dir and disk_capacity_bytes go together")
    if out["disk_capacity_bytes"] is not None:
        out["disk_capacity_bytes"] = int(out["disk_capacity_bytes"])
    return out


def namespace_of(model: str, dev: DevicePool, *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                 extra: str = "") -> str:
    """The key namespace of one rank's linker tier: entries of two ranks or models whose
    namespaces differ never share keys. MLA leaves TP out (its KV is replicated over TP)."""
    parts = [
        "sglang-linker",
        str(model or "model"),
        "mla" if dev.mla else "mha",
        dev.layout_dtype,
        f"page{dev.page_size}",
        f"L{dev.layers}",
        f"H{dev.heads}xD{dev.head_dim}",
        f"bytes{dev.planes * dev.layers * dev.page_bytes}",
        f"pp{pp_rank}of{pp_size}",
        "tp=shared(mla)" if dev.mla else f"tp{tp_rank}of{tp_size}",
    ]
    if extra:
        parts.append(extra)
    return "/".join(parts)


class _Staged:
    """Verified pages of one request read from the tier, waiting for their load."""

    def __init__(self, hashes: List[str], buf: Any) -> None:
        self.hashes = hashes
        self.buf = buf  # torch uint8 [pages, entry_bytes]

    @property
    def nbytes(self) -> int:
        return int(self.buf.numel())


class TpuSyncLinker(UnifiedCacheLinker):
    """SGLang unified-cache linker over :class:`tpu_sync.Store` (see the module docs).

    Args:
        server_args: SGLang's server args (unused beyond the model path).
        params: SGLang's ``CacheInitParams`` (the device KV pool, page size, ranks, groups).
        components: the radix tree's components; only ``{ComponentType.FULL}`` is handled.
        extra_config: ``linker_extra_config`` (see :func:`parse_extra_config`).
        forward_stream: the forward pass's stream (None on CPU); offloads wait for it.

    Raises:
        LinkerConfigError, UnsupportedPoolError (a pool of another kind), ValueError (hybrid
        components); tpu_sync errors from opening the tier.
    """

    def __init__(self, server_args: Any, params: Any, *, components: Any, extra_config: Optional[Dict[str, Any]] = None,
                 forward_stream: Any = None) -> None:
        import torch
        import tpu_sync
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        names = sorted(getattr(c, "name", str(c)) for c in components)
        if set(components) != {ComponentType.FULL}:
            raise ValueError(f"TpuSyncLinker handles full-attention KV only; the tree has components {names} "
                             "(SWA and Mamba pools need KV cache groups)")
        self.options = parse_extra_config(extra_config)
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.dev = DevicePool(kvcache)
        if self.dev.page_size != self.page_size:
            raise ValueError(f"TpuSyncLinker: pool page size {self.dev.page_size} != tree page size {self.page_size}")
        self.pools = {PoolName.KV: kvcache}
        self.num_layers = self.dev.layers
        self.entry_bytes = self.dev.planes * self.dev.layers * self.dev.page_bytes

        tp_rank, tp_size = 0, int(getattr(server_args, "tp_size", 1) or 1)
        group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
        if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            tp_rank = torch.distributed.get_rank(group=group)
            tp_size = torch.distributed.get_world_size(group=group)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        pp_rank, pp_size = int(getattr(params, "pp_rank", 0)), int(getattr(params, "pp_size", 1))
        self.namespace = namespace_of(str(getattr(server_args, "model_path", "") or "model"), self.dev, tp_rank=tp_rank, tp_size=tp_size,
                                      pp_rank=pp_rank, pp_size=pp_size, extra=self.options["namespace"])
        opt = self.options
        kw: Dict[str, Any] = dict(namespace=self.namespace, block_bytes=self.entry_bytes,
                                  capacity_bytes=opt["host_capacity_bytes"], verify_checksums=opt["verify_checksums"])
        suffix = ("" if self.dev.mla else f"-tp{tp_rank}") + (f"-pp{pp_rank}" if pp_size > 1 else "")
        if opt["shm_name"]:
            kw["shm_name"] = opt["shm_name"] + suffix
            if opt["shm_dir"]:
                kw["shm_dir"] = opt["shm_dir"]
        if opt["disk_dir"]:
            d = os.path.join(opt["disk_dir"], (suffix.lstrip("-") or "shared"))
            os.makedirs(d, exist_ok=True)
            kw["disk_dir"], kw["disk_capacity_bytes"] = d, opt["disk_capacity_bytes"]
        self.store = tpu_sync.Store(**kw)
        info = self.store.info() or {}
        self.attach = str(info.get("attach"))
        log.info("tpu_sync.sglang linker: tier %s (attach=%s, restored=%s, %d B entries)", self.namespace,
                 info.get("attach"), info.get("restored_dram_blocks"), self.entry_bytes)
        self._k = [self.dev.raw_view(0, l) for l in range(self.num_layers)]
        self._v = [self.dev.raw_view(1, l) for l in range(self.num_layers)] if self.dev.planes == 2 else []

        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        self._lock = threading.Lock()
        self._staged: "OrderedDict[str, _Staged]" = OrderedDict()
        self._staged_bytes = 0
        self._pending: Dict[str, Tuple[List[int], _Staged]] = {}
        self._inflight: Dict[int, List[str]] = {}
        self._load_q: "queue.Queue[Optional[Tuple[int, List[Any]]]]" = queue.Queue()
        self._offload_q: "queue.Queue[Optional[Tuple[List[Tuple[List[str], List[int]]], List[Any]]]]" = queue.Queue()
        self._offload_results: "queue.Queue[bool]" = queue.Queue()
        #: cumulative counters (pages unless named otherwise), also published as ``linker-<pid>.json``.
        self.counters: Dict[str, int] = dict(lookups=0, lookup_pages=0, hit_pages=0, corrupt=0, cut_by_staging=0,
                                             loads=0, load_pages=0, load_layers=0, load_bytes=0, load_failures=0,
                                             copy_ops=0, offloads=0, offload_pages=0, offload_stored=0,
                                             offload_failures=0, cancelled=0)
        self._closed = False
        self._load_thread = threading.Thread(target=self._load_loop, daemon=True, name=f"tpu-sync-linker-load-tp{tp_rank}")
        self._offload_thread = threading.Thread(target=self._offload_loop, daemon=True,
                                                name=f"tpu-sync-linker-offload-tp{tp_rank}")
        self._load_thread.start()
        self._offload_thread.start()
        self._publish()

    # ---- helpers -------------------------------------------------------------------------------

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counters[k] += int(v)
        self._publish()

    def _publish(self) -> None:
        stats.publish("linker", self.snapshot)

    def snapshot(self) -> Dict[str, Any]:
        """:attr:`counters`, the tier's :meth:`tpu_sync.Store.stats`, its namespace and the
        staging in use."""
        with self._lock:
            out: Dict[str, Any] = dict(self.counters, staged_bytes=self._staged_bytes, attach=self.attach)
        try:
            out["tier"] = dict(self.store.stats(), namespace=self.namespace)
        except Exception:  # closed
            pass
        return out

    def _pieces(self, page: int) -> List[Tuple[Any, int, int]]:
        """Device pieces of one page's tier entry, in entry order."""
        off, n = self.dev.page_offset(page), self.dev.page_bytes
        return [(v, off, n) for v in self._k] + [(v, off, n) for v in self._v]

    @staticmethod
    def _kv(transfers: Sequence[PoolTransfer]) -> Optional[PoolTransfer]:
        for t in transfers:
            if t.name == PoolName.KV:
                return t
        return None

    def _drop_staged(self, rid: str) -> None:
        with self._lock:
            s = self._staged.pop(rid, None)
            if s is not None:
                self._staged_bytes -= s.nbytes

    def _make_room(self, nbytes: int, keep: str) -> int:
        """Frees unadmitted staging (oldest first) until ``nbytes`` fit; returns the bytes free."""
        with self._lock:
            budget = self.options["staging_bytes"]
            pending = {rid for rid, _ in self._pending.items()} | {r for rids in self._inflight.values() for r in rids}
            for rid in list(self._staged):
                if budget - self._staged_bytes >= nbytes:
                    break
                if rid == keep or rid in pending:
                    continue
                s = self._staged.pop(rid)
                self._staged_bytes -= s.nbytes
            return budget - self._staged_bytes

    def _read(self, hashes: List[str], rid: str) -> Optional[_Staged]:
        """Verified read of the leading present pages of ``hashes`` into new staging (None when
        none is present or none fits)."""
        import torch
        from tpu_sync import errors

        keys = [self.store.engine_key(h) for h in hashes]
        n = int(self.store.lookup(keys)) if keys else 0
        if n == 0:
            return None
        free = self._make_room(n * self.entry_bytes, rid)
        fit = max(0, free // self.entry_bytes)
        if fit < n:
            self._count(cut_by_staging=n - fit)
            n = fit
        if n == 0:
            return None
        buf = torch.empty((n, self.entry_bytes), dtype=torch.uint8)
        try:
            got = int(self.store.get(keys[:n], [buf[i] for i in range(n)]).delivered)
        except errors.ChecksumError as e:
            # The corrupt page and its chain are dropped by the store; what precedes it is good.
            log.warning("tpu_sync.sglang linker: a page failed its checksum (recomputed): %s", e)
            self._count(corrupt=1)
            n = int(self.store.lookup(keys[:n]))
            got = int(self.store.get(keys[:n], [buf[i] for i in range(n)]).delivered) if n else 0
        if got == 0:
            return None
        return _Staged(list(hashes[:got]), buf[:got])

    # ---- UnifiedCacheLinker ---------------------------------------------------------------------

    def lookup(self, rid: str, transfers: List[PoolTransfer]) -> List[int]:
        """Every restorable prefix length in pages (``1..n``: a plain KV chain is restorable at
        every page boundary), where ``n`` pages were read from the tier and verified (see the
        module docs)."""
        kv = self._kv(transfers)
        hashes = list(kv.keys or []) if kv is not None else []
        self._count(lookups=1, lookup_pages=len(hashes))
        if not hashes:
            return []
        with self._lock:
            s = self._staged.get(rid)
            if s is not None:
                if rid in self._pending or hashes[: len(s.hashes)] == s.hashes:
                    self._staged.move_to_end(rid)
                    # What is staged stays valid; a longer chain may have been stored meanwhile,
                    # but the staged prefix is what this request can restore without a new read.
                    n = len(s.hashes)
                    self.counters["hit_pages"] += n
                    return list(range(1, n + 1))
        self._drop_staged(rid)
        try:
            s = self._read(hashes, rid)
        except Exception as e:  # a tier error is a miss, never a failed request
            log.error("tpu_sync.sglang linker: lookup failed (a miss): %s", e)
            return []
        if s is None:
            return []
        with self._lock:
            self._staged[rid] = s
            self._staged_bytes += s.nbytes
            self.counters["hit_pages"] += len(s.hashes)
        self._publish()
        return list(range(1, len(s.hashes) + 1))

    def load(self, rid: str, transfers: List[PoolTransfer]) -> bool:
        """Queues the request's hit for the next :meth:`start_layer_wise_loading`: its pages
        (``keys`` and the token slots ``device_indices`` SGLang allocated for them) from the
        staging of its lookup, or from a new verified read when the lookup's staging is gone.
        False (SGLang recomputes the tail) when the pages are no longer all in the tier."""
        kv = self._kv(transfers)
        if kv is None or not kv.keys:
            return False
        hashes = list(kv.keys)
        pages = pages_of_slots(kv.device_indices, self.page_size)
        if len(pages) != len(hashes):
            raise ValueError(f"tpu_sync linker: {len(hashes)} keys but {len(pages)} device pages")
        with self._lock:
            if rid in self._pending:
                raise RuntimeError(f"tpu_sync linker: a load for rid={rid} is already queued")
            s = self._staged.get(rid)
        if s is None or s.hashes[: len(hashes)] != hashes:
            self._drop_staged(rid)
            s = self._read(hashes, rid)
            if s is None or len(s.hashes) < len(hashes):
                return False
            with self._lock:
                self._staged[rid] = s
                self._staged_bytes += s.nbytes
        with self._lock:
            self._pending[rid] = (pages, s)
        return True

    def start_layer_wise_loading(self) -> int:
        """Submits every queued load (one H2D batch per layer) and returns the counter index the
        forward pass waits on (-1 when nothing is queued)."""
        import tpu_sync

        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return -1
        index = self.layer_done_counter.update_producer()
        with self._lock:
            self._inflight[index] = list(pending)
        copies: List[Any] = []
        ops = 0
        try:
            per_layer: List[List[Any]] = [[] for _ in range(self.num_layers)]
            pb = self.dev.page_bytes
            for pages, s in pending.values():
                for i, page in enumerate(pages):
                    off = self.dev.page_offset(page)
                    row = s.buf[i]
                    for layer in range(self.num_layers):
                        per_layer[layer].append((self._k[layer], off, row[layer * pb:(layer + 1) * pb], pb))
                        if self._v:
                            at = (self.num_layers + layer) * pb
                            per_layer[layer].append((self._v[layer], off, row[at:at + pb], pb))
            for specs in per_layer:
                ops += len(specs)
                copies.append(tpu_sync.h2d(specs) if specs else None)
        except BaseException as e:
            for c in copies:
                if c is not None:
                    c.cancel()
            self.layer_done_counter.fail(index, e)
            log.error("tpu_sync.sglang linker: submitting the load failed: %s", e)
            return index
        self._count(loads=len(pending), load_pages=sum(len(p) for p, _ in pending.values()), copy_ops=ops)
        self._load_q.put((index, copies))
        return index

    def _load_loop(self) -> None:
        while True:
            task = self._load_q.get()
            try:
                if task is None:
                    return
                index, copies = task
                for layer, c in enumerate(copies):
                    try:
                        if c is not None:
                            st = c.wait()
                            self._count(load_layers=1, load_bytes=st["bytes"])
                        self.layer_done_counter.complete(index, layer)
                    except BaseException as e:
                        log.error("tpu_sync.sglang linker: layer %d of load batch %d failed: %s", layer, index, e)
                        for other in copies[layer + 1:]:
                            if other is not None:
                                other.cancel()
                        for other in copies[layer + 1:]:
                            if other is not None and not other.done:
                                try:
                                    other.wait()
                                except BaseException:
                                    pass
                        self._count(load_failures=1)
                        self.layer_done_counter.fail(index, e)
                        break
            finally:
                self._load_q.task_done()

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """Waits until the batch ``counter_index`` stops writing device memory; True when every
        layer landed. Its staging is released either way."""
        landed = self.layer_done_counter.finish(counter_index)
        with self._lock:
            rids = self._inflight.pop(counter_index, [])
        for rid in rids:
            self._drop_staged(rid)
        self._publish()
        return landed

    def cancel_queued_load(self, rid: str) -> bool:
        """Drops a load that has not started (and its staging); False when none is queued."""
        with self._lock:
            hit = self._pending.pop(rid, None)
        if hit is None:
            return False
        self._drop_staged(rid)
        self._count(cancelled=1)
        return True

    def offload(self, transfers: List[PoolTransfer], session_id: Optional[str] = None) -> bool:
        """Queues the KV chain of ``transfers`` (page hashes ``keys``, token slots
        ``device_indices``) for the tier; the result comes through
        :meth:`pop_completed_offload`."""
        kv = self._kv(transfers)
        if kv is None or not kv.keys or kv.device_indices is None:
            return False
        pages = pages_of_slots(kv.device_indices, self.page_size)
        if len(pages) != len(kv.keys):
            raise ValueError(f"tpu_sync linker: {len(kv.keys)} keys but {len(pages)} device pages to offload")
        events: List[Any] = []
        try:
            import torch

            if kv.device_indices.device.type != "cpu" or self.forward_stream is not None:
                events = self.record_offload_ready()
            del torch
        except Exception as e:  # no device events on this platform: the scheduler's stream is the only writer
            log.debug("tpu_sync.sglang linker: no offload events: %s", e)
        self._offload_q.put(([(list(kv.keys), pages)], events))
        return True

    def _offload_loop(self) -> None:
        while True:
            task = self._offload_q.get()
            try:
                if task is None:
                    return
                chains, events = task
                for ev in events:
                    ev.synchronize()
                ok = True
                for hashes, pages in chains:
                    keys = [self.store.engine_key(h) for h in hashes]
                    r = self.store.put_from_device(keys, [self._pieces(p) for p in pages])
                    self._count(offloads=1, offload_pages=len(keys), offload_stored=r.stored)
                    ok = ok and r.complete
                self._offload_results.put(ok)
            except BaseException as e:
                log.error("tpu_sync.sglang linker: offload failed: %s", e)
                self._count(offload_failures=1)
                self._offload_results.put(False)
            finally:
                self._offload_q.task_done()

    def num_completed_offloads(self) -> int:
        """Completed offloads not yet popped."""
        return self._offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        """The oldest completed offload's result: True when its whole chain is in the tier."""
        return self._offload_results.get_nowait()

    def reset(self) -> None:
        """Waits for the load and offload threads to go idle, then drops queued loads, staging,
        unconsumed offload results and the layer counter's state."""
        with self._lock:
            self._pending.clear()
        self._load_q.join()
        self._offload_q.join()
        while True:
            try:
                self._offload_results.get_nowait()
            except queue.Empty:
                break
        with self._lock:
            self._staged.clear()
            self._staged_bytes = 0
            self._inflight.clear()
        self.layer_done_counter.reset()

    def close(self) -> None:
        """:meth:`reset`, stops the threads and closes the tier (a named segment stays for the
        next engine). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.reset()
        self._load_q.put(None)
        self._offload_q.put(None)
        self._load_thread.join()
        self._offload_thread.join()
        self._publish()
        log.info("tpu_sync.sglang linker: %s", self.counters)
        self.store.close()


__all__ = ["DEFAULT_HOST_CAPACITY", "DEFAULT_STAGING", "LinkerConfigError", "TpuSyncLinker", "namespace_of",
           "parse_extra_config"]
