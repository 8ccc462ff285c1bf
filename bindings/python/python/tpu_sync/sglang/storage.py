"""``TpuSyncStorage``: SGLang's HiCache storage backend (L3) on tpu_sync's host tier.

Loaded by SGLang's factory without any SGLang patch::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tpu_sync",
        "module_path": "tpu_sync.sglang.storage", "class_name": "TpuSyncStorage",
        "interface_v1": 1, "shm_name": "sglang-kv", "host_capacity_bytes": 8589934592}'

SGLang constructs it as ``TpuSyncStorage(storage_config, kwargs)``
(``StorageBackendFactory._create_dynamic_backend``) and hands the host KV pool over later through
:meth:`register_mem_pool_host` (hybrid models: more pools through
:meth:`register_mem_host_pool_v2`, then :meth:`on_host_pools_registered`). Each pool gets one
:class:`tpu_sync.Store` (pinned DRAM, optionally a ``/dev/shm`` segment that a restarted engine
re-attaches, optionally a disk tier), whose entries are one SGLang page in its flat page format
(:mod:`tpu_sync.sglang.pages`) keyed by SGLang's page hash (``get_storage_hash_str``: a chain of
SHA-256 hex strings, so a key names its whole prefix) through :meth:`tpu_sync.Store.engine_key`.
Every entry carries a checksum; a page whose bytes changed in the tier fails it on read and is
reported as a miss, so SGLang recomputes it (and the corrupt entry is dropped).

Extra config keys (``hicache_storage_backend_extra_config``; SGLang's own keys
``prefetch_threshold``, ``prefetch_timeout_*``, ``hicache_storage_pass_prefix_keys`` and
``tp_lcm_size`` are removed by SGLang before the backend sees them):

``backend_name``, ``module_path``, ``class_name``, ``interface_v1``
    SGLang's (``interface_v1: 1`` selects the zero-copy :meth:`batch_get_v1` /
    :meth:`batch_set_v1`, which copy between the host pool and the tier without staging).
``host_capacity_bytes`` (int, default 1 GiB)
    DRAM bytes of each pool's tier.
``shm_name`` (str)
    Keep each pool's tier in ``/dev/shm/<shm_name>-<pool>[-tp<rank>]`` (warm restart); one
    process at a time may use a segment.
``shm_dir`` (str)
    Directory of the segments (default ``/dev/shm``).
``disk_dir`` (str), ``disk_capacity_bytes`` (int)
    Spill DRAM victims to files under ``<disk_dir>/<pool>[-tp<rank>]``.
``verify_checksums`` (bool, default true)
    Check every page read from the tier.
``namespace`` (str)
    Extra text mixed into every pool's key namespace.
``cluster`` (dict)
    Share the KV pool's tier with other instances (the settings of the vLLM connector's
    ``cluster``, :class:`tpu_sync.cluster.Member`: ``endpoints``, ``advertise``, ``listen``,
    ``host_id``, ``prefix``, ``lease_ttl``, ``user``, ``password``, ``tls_*``,
    ``fetch_timeout``). The tier is served to other instances (:class:`tpu_sync.cluster.RemoteServer`)
    and its pages published into the cluster prefix directory on etcd; ``exists`` /
    ``batch_exists`` also count the pages a peer of the same namespace (model, layout, ranks)
    holds beyond the local ones, and a read of such pages first fetches them from that peer's
    remote tier into the local tier (length and xxh3-64 checked on arrival, checksummed again on
    read), so they are hits from then on. A dead or stalled peer, a stale directory entry or
    etcd being down is a miss (each fetch bounded by ``fetch_timeout``), never an error.
    Extra pools of hybrid models stay local.

Namespacing (:func:`namespace_of`): model, pool, layout, dtype, page size and page bytes, PP rank
and size, attention CP and DCP ranks; TP rank and size for MHA pools. MLA KV is replicated over
TP ranks (``storage_config.is_mla_model``), so MLA pools leave TP out: all ranks share one
namespace and one segment name, and pages written by one rank are hits for another that opens the
tier after it. A segment has one user at a time: while one rank holds it, the other live ranks
of the same engine get an anonymous tier of the same namespace (sharing between live ranks needs
a shared tier, e.g. a remote instance).

Thread-safety: SGLang calls a backend from its prefetch and backup threads at once; every method
here may run concurrently (the Store is thread-safe; the bookkeeping takes a lock).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from . import pages, stats
from ._views import view_of

log = logging.getLogger("tpu_sync.sglang")

#: Default DRAM bytes of each pool's tier.
DEFAULT_HOST_CAPACITY = 1 << 30

_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}
_KEYS = {
    "host_capacity_bytes": (int, float),
    "shm_name": str,
    "shm_dir": str,
    "disk_dir": str,
    "disk_capacity_bytes": (int, float),
    "verify_checksums": bool,
    "namespace": str,
    "cluster": dict,
}
#: How many exists answers are remembered for the "get never longer than exists" rule.
_EXISTS_MEMO = 4096


class ConfigError(ValueError):
    """An invalid ``hicache_storage_backend_extra_config`` for :class:`TpuSyncStorage`."""


def parse_extra_config(extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Checks the backend's keys of the extra config and fills defaults.

    Raises:
        ConfigError: an unknown key (a typo must not fall back to a default silently), a value
            of the wrong type, or sizes <= 0.
    """
    extra = dict(extra or {})
    out: Dict[str, Any] = dict(host_capacity_bytes=DEFAULT_HOST_CAPACITY, shm_name=None, shm_dir=None,
                               disk_dir=None, disk_capacity_bytes=None, verify_checksums=True, namespace="",
                               cluster={})
    for k, v in extra.items():
        if k in _SGLANG_KEYS:
            continue
        if k not in _KEYS:
            raise ConfigError(f"unknown hicache_storage_backend_extra_config key {k!r} for TpuSyncStorage "
                              f"(known: {', '.join(sorted(_KEYS))})")
        want = _KEYS[k]
        if (want is bool) != isinstance(v, bool) or not isinstance(v, want):
            raise ConfigError(f"hicache_storage_backend_extra_config[{k!r}] has the wrong type: {v!r}")
        out[k] = v
    out["host_capacity_bytes"] = int(out["host_capacity_bytes"])
    if out["host_capacity_bytes"] <= 0:
        raise ConfigError("host_capacity_bytes must be > 0")
    if (out["disk_dir"] is None) != (out["disk_capacity_bytes"] is None):
        raise ConfigError("disk_dir and disk_capacity_bytes go together")
    if out["disk_capacity_bytes"] is not None:
        out["disk_capacity_bytes"] = int(out["disk_capacity_bytes"])
    if out["cluster"]:
        from tpu_sync import cluster, errors

        try:
            out["cluster"] = cluster.settings(out["cluster"], "hicache_storage_backend_extra_config['cluster']")
        except errors.InvalidArgumentError as e:
            raise ConfigError(str(e)) from None
    return out


def _pool_name(name: Any) -> str:
    return str(getattr(name, "value", name))


def namespace_of(cfg: HiCacheStorageConfig, pool: Any, pool_name: str, extra: str = "") -> str:
    """The key namespace of one host pool's tier: pages of two pools whose namespaces differ
    never share keys. Includes the model, pool, layout, dtype, page size and bytes, PP, CP and
    DCP ranks, and TP rank and size unless the pool is MLA KV (replicated over TP).
    A Mamba pool is TP-sharded even in an MLA model, so it always carries TP."""
    mla_shared = bool(cfg.is_mla_model) and pool_name != PoolName.MAMBA.value
    parts = [
        "sglang",
        str(cfg.model_name or "model"),
        pool_name,
        str(getattr(pool, "layout", "?")),
        str(getattr(pool, "dtype", "?")).replace("torch.", ""),
        f"page{getattr(pool, 'page_size', '?')}",
        f"bytes{pages.page_bytes(pool)}",
        f"pp{cfg.pp_rank}of{cfg.pp_size}",
        f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}",
        f"dcp{cfg.dcp_rank}of{cfg.dcp_size}",
        "tp=shared(mla)" if mla_shared else f"tp{cfg.tp_rank}of{cfg.tp_size}",
    ]
    if extra:
        parts.append(extra)
    return "/".join(parts)


class _PoolTier:
    """One registered host pool and its Store."""

    def __init__(self, name: str, pool: Any, store: Any, namespace: str, zero_copy: bool) -> None:
        self.name = name
        self.pool = pool
        self.store = store
        self.namespace = namespace
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self.page_bytes = pages.page_bytes(pool)
        self.zero_copy = zero_copy
        self._views = [view_of(b) for b in pages.base_tensors(pool)] if zero_copy else []
        #: the tier's cluster membership (KV pool with ``cluster`` settings), else None
        self.member: Any = None
        #: peers that the last exists calls found, by the chain's first key (bounded)
        self.peers: "OrderedDict[bytes, List[Dict[str, Any]]]" = OrderedDict()

    def close(self) -> None:
        if self.member is not None:
            self.member.close()
            self.member = None
        self.store.close()

    def keys(self, hashes: Sequence[str]) -> List[bytes]:
        return [self.store.engine_key(h) for h in hashes]

    def pieces(self, index: int) -> List[Tuple[Any, int, int]]:
        return [(self._views[b], off, n) for b, off, n in pages.page_pieces(self.pool, index)]


class TpuSyncStorage(HiCacheStorage):
    """SGLang HiCache storage backend over :class:`tpu_sync.Store` (see the module docs).

    Args:
        storage_config: SGLang's :class:`HiCacheStorageConfig` (ranks, model, extra config).
        kwargs: the factory's keyword dict (``{}`` from SGLang's cache controller); accepted and
            unused.

    Raises:
        ConfigError: invalid extra config.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[Dict[str, Any]] = None) -> None:
        self.storage_config = storage_config
        self.options = parse_extra_config(storage_config.extra_config)
        self._tiers: Dict[str, _PoolTier] = {}
        self._lock = threading.Lock()
        self._exists_memo: "OrderedDict[str, Tuple[int, int]]" = OrderedDict()
        self._metrics_prefetch: List[int] = []
        self._metrics_backup: List[int] = []
        #: cumulative counters (pages), also written to the stats file (:mod:`tpu_sync.sglang.stats`).
        self.counters: Dict[str, int] = dict(exists_calls=0, exists_hits=0, get_pages=0, get_hits=0, set_pages=0,
                                             set_stored=0, corrupt=0, errors=0, exists_remote=0,
                                             remote_fetches=0, remote_pages=0, remote_errors=0)

    # ---- registration ------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the KV host pool (SGLang calls it right after construction) and opens its
        tier."""
        super().register_mem_pool_host(mem_pool_host)
        self._open(PoolName.KV.value, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Registers one pool of a hybrid model (``"kv"``, ``"mamba"``, ``"swa"``,
        ``"indexer"``, ...) and opens its tier (the KV pool's is opened once)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        with self._lock:
            known = name in self._tiers and self._tiers[name].pool is host_pool
        if not known:
            self._open(name, host_pool)

    def on_host_pools_registered(self) -> None:
        """All pools of this attach are registered: logs the tiers."""
        for t in self._tiers.values():
            log.info("tpu_sync.sglang: pool %s -> tier %s (%d B pages, zero-copy=%s)", t.name, t.namespace,
                     t.page_bytes, t.zero_copy)

    def _open(self, name: str, pool: Any) -> _PoolTier:
        import tpu_sync

        cfg, opt = self.storage_config, self.options
        ns = namespace_of(cfg, pool, name, opt["namespace"])
        mla_shared = bool(cfg.is_mla_model) and name != PoolName.MAMBA.value
        suffix = f"-{name}" + ("" if mla_shared else f"-tp{cfg.tp_rank}")
        if cfg.pp_size > 1:
            suffix += f"-pp{cfg.pp_rank}"
        named = True
        kw: Dict[str, Any] = dict(namespace=ns, block_bytes=pages.page_bytes(pool),
                                  capacity_bytes=opt["host_capacity_bytes"], verify_checksums=opt["verify_checksums"])
        if opt["shm_name"] and named:
            kw["shm_name"] = opt["shm_name"] + suffix
            if opt["shm_dir"]:
                kw["shm_dir"] = opt["shm_dir"]
        if opt["disk_dir"] and named:
            d = os.path.join(opt["disk_dir"], suffix.lstrip("-"))
            os.makedirs(d, exist_ok=True)
            kw["disk_dir"] = d
            kw["disk_capacity_bytes"] = opt["disk_capacity_bytes"]
        try:
            store = tpu_sync.Store(**kw)
        except tpu_sync.errors.IOError as e:
            if not mla_shared or "shm_name" not in kw:
                raise
            # Another TP rank of this MLA engine holds the shared segment: this rank gets an
            # anonymous tier of the same namespace (a local segment has one user at a time).
            log.warning("tpu_sync.sglang: shared MLA segment %s is in use (%s); rank %d uses an anonymous tier",
                        kw["shm_name"], e, cfg.tp_rank)
            kw.pop("shm_name")
            kw.pop("shm_dir", None)
            kw.pop("disk_dir", None)
            kw.pop("disk_capacity_bytes", None)
            store = tpu_sync.Store(**kw)
        tier = _PoolTier(name, pool, store, ns, zero_copy=pages.has_page_buffer(pool))
        if opt["cluster"] and name == PoolName.KV.value:
            import json

            from tpu_sync import cluster

            try:
                tier.member = cluster.Member(store, opt["cluster"], rank=cfg.tp_rank,
                                             meta=json.dumps(dict(engine="sglang", pool=name, namespace=ns)))
            except Exception:
                store.close()
                raise
            log.info("tpu_sync.sglang: pool %s served on %s as %s, published to %s", name, tier.member.advertise,
                     tier.member.host_id, tier.member.endpoints)
        with self._lock:
            old = self._tiers.pop(name, None)
            self._tiers[name] = tier
        if old is not None:
            old.close()
        info = store.info() or {}
        log.info("tpu_sync.sglang: tier for pool %s: %s (attach=%s, restored=%s)", name, ns, info.get("attach"),
                 info.get("restored_dram_blocks"))
        return tier

    def _tier(self, name: str = PoolName.KV.value) -> _PoolTier:
        t = self._tiers.get(_pool_name(name))
        if t is None:
            raise RuntimeError(f"tpu_sync.sglang: no host pool {name!r} registered")
        return t

    @property
    def namespaces(self) -> Dict[str, str]:
        """Key namespace of each registered pool's tier."""
        return {n: t.namespace for n, t in self._tiers.items()}

    def store_of(self, pool_name: str = "kv") -> Any:
        """The :class:`tpu_sync.Store` of a registered pool (for tools and tests)."""
        return self._tier(pool_name).store

    # ---- helpers -----------------------------------------------------------------------

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counters[k] = self.counters.get(k, 0) + int(v)
        stats.publish("storage", self.counters_with_tiers)

    def counters_with_tiers(self) -> Dict[str, Any]:
        """:attr:`counters` plus each tier's Store counters (``tiers``)."""
        out: Dict[str, Any] = dict(self.counters)
        out["tiers"] = {}
        for n, t in list(self._tiers.items()):
            try:
                out["tiers"][n] = dict(t.store.stats(), namespace=t.namespace)
            except Exception:  # a closed store
                pass
        return out

    def _get(self, tier: _PoolTier, hashes: Sequence[str], dsts: Sequence[Any], zero_copy_indices=None) -> int:
        """Leading pages delivered (0 on any error; a checksum failure is a miss)."""
        from tpu_sync import errors

        if not hashes:
            return 0
        keys = tier.keys(hashes)
        if tier.member is not None:
            self._fetch_from_peers(tier, keys)
        try:
            if zero_copy_indices is not None:
                r = tier.store.get_to_device(keys, [tier.pieces(i) for i in zero_copy_indices])
            else:
                r = tier.store.get(keys, dsts)
            return int(r.delivered)
        except errors.ChecksumError as e:
            log.warning("tpu_sync.sglang: %s page failed its checksum (recomputed): %s", tier.name, e)
            self._count(corrupt=1)
            # The corrupt page and its chain below it are dropped by the store; what precedes
            # it is still good.
            n = tier.store.lookup(keys)
            if n:
                try:
                    if zero_copy_indices is not None:
                        r = tier.store.get_to_device(keys[:n], [tier.pieces(i) for i in zero_copy_indices[:n]])
                    else:
                        r = tier.store.get(keys[:n], list(dsts)[:n])
                    return int(r.delivered)
                except Exception:
                    return 0
            return 0
        except Exception as e:
            log.warning("tpu_sync.sglang: reading %d %s pages failed: %s", len(keys), tier.name, e)
            self._count(errors=1)
            return 0

    # ---- cluster -----------------------------------------------------------------------

    def _remote_exists(self, tier: _PoolTier, keys: List[bytes], local: int) -> int:
        """Leading pages of ``keys`` held locally or, when more, by a peer (remembered for the
        read that follows); ``local`` on any directory error."""
        try:
            peers = tier.member.peers(tier.namespace, keys, more_than=local)
        except Exception as e:  # etcd down: a local-only answer
            log.warning("tpu_sync.sglang: cluster lookup failed: %s", e)
            self._count(remote_errors=1)
            return local
        if not peers:
            return local
        with self._lock:
            prev = tier.peers.get(keys[0])
            if prev is None or int(prev[0]["blocks"]) <= int(peers[0]["blocks"]):
                tier.peers[keys[0]] = peers  # the longest answer for a chain start is kept
            tier.peers.move_to_end(keys[0])
            while len(tier.peers) > _EXISTS_MEMO:
                tier.peers.popitem(last=False)
        self._count(exists_remote=int(peers[0]["blocks"]) - local)
        return int(peers[0]["blocks"])

    def _fetch_from_peers(self, tier: _PoolTier, keys: List[bytes]) -> int:
        """Before a read: fetches the pages of ``keys`` beyond the local prefix from the peer
        the exists call found (or the directory names now) into the local tier. Returns the
        pages fetched; a failing peer is a miss (logged, counted)."""
        from tpu_sync import cluster

        local = int(tier.store.lookup(keys))
        if local >= len(keys):
            return 0
        with self._lock:
            peers = tier.peers.pop(keys[0], None)
        if peers is None or int(peers[0]["blocks"]) < len(keys):
            try:
                peers = tier.member.peers(tier.namespace, keys, more_than=local)
            except Exception as e:
                log.warning("tpu_sync.sglang: cluster lookup failed: %s", e)
                self._count(remote_errors=1)
                return 0
        for p in peers:
            want = keys[local:min(len(keys), int(p["blocks"]))]
            if not want:
                continue
            outs = [bytearray(tier.page_bytes) for _ in want]
            try:
                n = cluster.fetch(p["addr"], tier.namespace, want, outs, timeout=tier.member.timeout,
                                  remote=tier.member.remote)
            except Exception as e:  # a dead, stalled or stale peer is a miss
                log.warning("tpu_sync.sglang: fetching %d pages from %s (%s) failed: %s", len(want), p["id"],
                            p["addr"], e)
                self._count(remote_errors=1)
                continue
            if not n:
                continue
            try:
                r = tier.store.put(want[:n], outs[:n], parent=keys[local - 1] if local else None)
            except Exception as e:
                log.warning("tpu_sync.sglang: storing %d fetched pages failed: %s", n, e)
                self._count(remote_errors=1)
                return 0
            self._count(remote_fetches=1, remote_pages=int(r.stored))
            return n
        return 0

    def _put(self, tier: _PoolTier, hashes: Sequence[str], srcs: Sequence[Any], zero_copy_indices=None,
             parent: Optional[str] = None) -> int:
        """Leading pages now in the tier (stored or already present)."""
        if not hashes:
            return 0
        keys = tier.keys(hashes)
        pk = tier.store.engine_key(parent) if parent else None
        try:
            if zero_copy_indices is not None:
                r = tier.store.put_from_device(keys, [tier.pieces(i) for i in zero_copy_indices], parent=pk)
            else:
                r = tier.store.put(keys, list(srcs), parent=pk)
        except Exception as e:
            log.warning("tpu_sync.sglang: writing %d %s pages failed: %s", len(keys), tier.name, e)
            self._count(errors=1)
            return 0
        n = len(keys) if r.full_at is None else int(r.full_at)
        if r.not_ready:
            n = 0
        self._count(set_pages=len(keys), set_stored=int(r.stored))
        return n

    @staticmethod
    def _parent(extra_info: Optional[HiCacheStorageExtraInfo]) -> Optional[str]:
        pk = extra_info.prefix_keys if extra_info is not None else None
        return pk[-1] if pk else None

    def _page_indices(self, tier: _PoolTier, keys: Sequence[str], host_indices: Any) -> List[int]:
        n = len(keys)
        ps = tier.page_size
        if host_indices is None or int(host_indices.numel()) < n * ps:
            raise ValueError(f"{n} pages need {n * ps} host indices, got "
                             f"{0 if host_indices is None else int(host_indices.numel())}")
        idx = host_indices.tolist()
        return [int(idx[i * ps]) for i in range(n)]

    # ---- generic (copying) path --------------------------------------------------------

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        """One page into ``target_location`` (a flat page tensor); returns it, or None on a
        miss."""
        r = self.batch_get([key], [target_location])
        return r[0] if r else None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Any]:
        """Pages into the flat page tensors ``target_locations`` (SGLang's dummy pages); the
        leading delivered ones are returned, None from the first miss on."""
        tier = self._tier()
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(targets)} target locations")
        n = self._get(tier, keys, targets)
        self._count(get_pages=len(keys), get_hits=n)
        self._note_prefetch(n)
        return [t if i < n else None for i, t in enumerate(targets)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Stores one flat page."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Stores flat pages (``values``: SGLang's ``get_data_page`` tensors); True when all
        are in the tier afterwards."""
        tier = self._tier()
        vals = [v.contiguous() for v in (values or [])]
        if len(vals) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(vals)} values")
        n = self._put(tier, keys, vals)
        self._note_backup(n)
        return n == len(keys)

    def exists(self, key: str) -> bool:
        """Whether the page is in the KV tier."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Number of leading pages of the chain in the KV tier."""
        tier = self._tier()
        k = tier.keys(keys) if keys else []
        n = int(tier.store.lookup(k)) if k else 0
        if tier.member is not None and n < len(k):
            n = self._remote_exists(tier, k, n)
        self._count(exists_calls=1, exists_hits=n)
        return n

    # ---- zero-copy path (interface_v1) -------------------------------------------------

    def batch_get_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Reads pages straight into the host pool: page ``i`` to the slots starting at
        ``host_indices[i * page_size]``. True for the leading pages delivered."""
        tier = self._tier()
        idx = self._page_indices(tier, keys, host_indices)
        if tier.zero_copy:
            n = self._get(tier, keys, (), zero_copy_indices=idx)
        else:
            n = self._get_copy(tier, keys, idx)
        self._count(get_pages=len(keys), get_hits=n)
        self._note_prefetch(n)
        return [i < n for i in range(len(keys))]

    def batch_set_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Writes pages straight from the host pool (page ``i`` from ``host_indices[i *
        page_size]``). True for the leading pages now in the tier."""
        tier = self._tier()
        idx = self._page_indices(tier, keys, host_indices)
        parent = self._parent(extra_info)
        if tier.zero_copy:
            n = self._put(tier, keys, (), zero_copy_indices=idx, parent=parent)
        else:
            n = self._put(tier, keys, [tier.pool.get_data_page(i, flat=True).contiguous() for i in idx], parent=parent)
        self._note_backup(n)
        return [i < n for i in range(len(keys))]

    def _get_copy(self, tier: _PoolTier, keys: Sequence[str], idx: Sequence[int]) -> int:
        dsts = [tier.pool.get_dummy_flat_data_page() for _ in keys]
        n = self._get(tier, keys, dsts)
        for i in range(n):
            tier.pool.set_from_flat_data_page(idx[i], dsts[i])
        return n

    # ---- pool-aware path (hybrid models) -----------------------------------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """Longest usable prefix of ``keys`` (one shared key chain over all pools).

        The KV pool gives the longest leading run present (``kv``); each extra pool in
        ``pool_transfers`` must then hold, under the same keys, every page of the prefix
        (``PoolHitPolicy.ALL_PAGES``) or its last ``len(transfer.keys)`` pages
        (``TRAILING_PAGES``). A prefix length is restorable only when every pool allows it; the
        answer is the longest such length (the shortest-common-prefix rule), with each pool's
        own boundary in ``extra_pool_hit_pages`` and every restorable length in
        ``restorable_prefix_pages``. A later :meth:`batch_get_v2` never delivers more.

        Raises:
            ValueError: ``PoolHitPolicy.BLOCK_GROUPS`` (not supported, as in SGLang's file
            backend) or an unregistered pool.
        """
        kv = self._tier()
        kv_pages = int(kv.store.lookup(kv.keys(keys))) if keys else 0
        hit: Dict[str, int] = {PoolName.KV.value: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            name = _pool_name(t.name)
            tier = self._tier(name)
            present = self._present(tier, keys[:kv_pages])
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = next((i for i in range(kv_pages) if not present[i]), kv_pages)
                allowed = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(t.keys) if t.keys else 1)
                allowed = {p for p in range(1, kv_pages + 1)
                           if all(present[i] for i in range(max(0, p - trailing), p))}
                boundary = max(allowed, default=0)
            else:
                raise ValueError(f"tpu_sync.sglang: unsupported pool hit policy {t.hit_policy}")
            if boundary:
                hit[name] = boundary
            restorable = [p for p in restorable if p in allowed]
        final = restorable[-1] if restorable else 0
        self._remember(keys, final)
        self._count(exists_calls=1, exists_hits=final)
        return PoolTransferResult(final, hit, restorable)

    def _present(self, tier: _PoolTier, keys: Sequence[str]) -> List[bool]:
        """Per key, whether ``tier`` holds it (each looked up on its own: a pool's pages need
        not form a leading run, e.g. trailing Mamba states)."""
        out = []
        for k in tier.keys(keys):
            out.append(tier.store.lookup([k]) == 1)
        return out

    def _remember(self, keys: Sequence[str], final: int) -> None:
        with self._lock:
            for pos, k in enumerate(keys):
                self._exists_memo[k] = (pos, final)
                self._exists_memo.move_to_end(k)
            while len(self._exists_memo) > _EXISTS_MEMO:
                self._exists_memo.popitem(last=False)

    def _allowed(self, key: str) -> bool:
        """False when the last exists call that saw ``key`` reported a prefix ending before it."""
        with self._lock:
            m = self._exists_memo.get(key)
        return m is None or m[0] < m[1]

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        """Reads each transfer's pages into its pool (page ``i`` of a transfer to
        ``transfer.host_indices[i * page_size]``).

        Results are consistent across pools: a page past the prefix that the last exists
        reported is never delivered; an ``ALL_PAGES`` pool that delivers fewer pages (a page
        evicted since the exists, or corrupt) cuts every ``ALL_PAGES`` pool of the call to the
        shortest delivered run, and a ``TRAILING_PAGES`` pool is all or nothing (a partial
        trailing window is not a state)."""
        delivered: Dict[str, int] = {}
        lengths: Dict[str, int] = {}
        for t in transfers:
            name = _pool_name(t.name)
            keys = list(t.keys or [])
            lengths[name] = len(keys)
            allowed = 0
            while allowed < len(keys) and self._allowed(keys[allowed]):
                allowed += 1
            tier = self._tier(name)
            try:
                idx = self._page_indices(tier, keys, t.host_indices)
            except ValueError as e:
                log.error("tpu_sync.sglang: batch_get_v2 %s: %s", name, e)
                delivered[name] = 0
                continue
            keys, idx = keys[:allowed], idx[:allowed]
            if tier.zero_copy:
                n = self._get(tier, keys, (), zero_copy_indices=idx)
            else:
                n = self._get_copy(tier, keys, idx)
            delivered[name] = n
        policies = {_pool_name(t.name): t.hit_policy for t in transfers}
        full = [n for name, n in delivered.items() if policies[name] != PoolHitPolicy.TRAILING_PAGES]
        cut = min(full) if full else None
        # A trailing window belongs to the full prefix: it is unusable once any pool of the
        # call came back short.
        whole = all(delivered[n] == lengths[n] for n in delivered if policies[n] != PoolHitPolicy.TRAILING_PAGES)
        out: Dict[str, List[bool]] = {}
        for name, n in delivered.items():
            total = lengths[name]
            if policies[name] == PoolHitPolicy.TRAILING_PAGES:
                ok = total > 0 and n == total and whole
                out[name] = [ok] * total
            else:
                m = n if cut is None else min(n, cut)
                out[name] = [i < m for i in range(total)]
            self._count(get_pages=total, get_hits=sum(out[name]))
        return out

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        """Writes each transfer's pages from its pool under its keys; per pool, True for the
        leading pages now in the tier."""
        out: Dict[str, List[bool]] = {}
        parent = self._parent(extra_info)
        for t in transfers:
            name = _pool_name(t.name)
            keys = list(t.keys or [])
            tier = self._tier(name)
            try:
                idx = self._page_indices(tier, keys, t.host_indices)
            except ValueError as e:
                log.error("tpu_sync.sglang: batch_set_v2 %s: %s", name, e)
                out[name] = [False] * len(keys)
                continue
            if tier.zero_copy:
                n = self._put(tier, keys, (), zero_copy_indices=idx, parent=parent)
            else:
                n = self._put(tier, keys, [tier.pool.get_data_page(i, flat=True).contiguous() for i in idx],
                              parent=parent)
            out[name] = [i < n for i in range(len(keys))]
        return out

    # ---- misc --------------------------------------------------------------------------

    def _note_prefetch(self, n: int) -> None:
        with self._lock:
            self._metrics_prefetch.append(int(n))

    def _note_backup(self, n: int) -> None:
        with self._lock:
            self._metrics_backup.append(int(n))

    def get_stats(self):
        """SGLang's ``StorageMetrics`` (pages prefetched and backed up per call since the last
        call)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            m = StorageMetrics(prefetch_pgs=self._metrics_prefetch, backup_pgs=self._metrics_backup)
            self._metrics_prefetch, self._metrics_backup = [], []
        return m

    def clear(self) -> None:
        """Removes every page not pinned from every tier."""
        for t in list(self._tiers.values()):
            t.store.clear()

    def close(self) -> None:
        """Closes the tiers (named segments stay for the next engine)."""
        with self._lock:
            tiers, self._tiers = list(self._tiers.values()), {}
        for t in tiers:
            try:
                t.close()
            except Exception as e:
                log.debug("tpu_sync.sglang: closing a tier failed: %s", e)


__all__ = ["ConfigError", "DEFAULT_HOST_CAPACITY", "TpuSyncStorage", "namespace_of", "parse_extra_config"]
