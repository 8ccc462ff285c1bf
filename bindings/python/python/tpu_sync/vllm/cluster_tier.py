"""The connector's host tier shared across instances (``kv_both`` with ``cluster`` settings).

With ``kv_connector_extra_config = {"cluster": {...}}`` the worker's host tier is a
:class:`ClusterTier`: the ordinary :class:`~tpu_sync.vllm.backends.StoreTier`, whose blocks are
also published into the cluster prefix directory (etcd) and served to other instances
(:class:`tpu_sync.cluster.RemoteServer`), and whose lookups, when the local tier holds less of a
prompt than another instance, answer with what that instance holds; the load then goes straight
into the engine's device blocks (:func:`tpu_sync.cluster.load`: every rank of the peer's replica
fetched, checksummed, resharded to this layout as a P/D pull is, written H2D in place) and the
loaded blocks are stored in the local tier as well. Each directory record carries the store's
description (``tpu_sync::cluster::StoreSource`` JSON: layout, rank, namespace). Peers are found
in this instance's namespaces (same model, block format, block size and TP); layer-wise loads
(``layerwise``) fetch a peer's blocks into host memory instead (same layout only). Settings (``cluster`` dict):

``endpoints`` (list of str, required)
    etcd client URLs.
``advertise`` (str, required)
    ``host:port`` other instances fetch this instance's blocks from; the server listens on
    ``listen`` (default ``0.0.0.0:<port of advertise>``).
``host_id`` (str)
    this instance's id in the directory (default: derived from ``advertise`` and the TP rank).
``prefix``, ``lease_ttl`` (seconds), ``user``, ``password``, ``tls_ca_file``, ``tls_cert_file``,
``tls_key_file``, ``tls_domain``, ``fetch_timeout`` (seconds, default 5)
    as :class:`tpu_sync.cluster.Directory`.

A failing directory or peer is a miss (logged), never an engine error (a peer that evicted
blocks since the lookup delivers a shorter prefix: vLLM recomputes the rest); fetched blocks are
checked (length and xxh3-64) before any byte reaches the device.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Dict, List, Sequence, Tuple

from . import compat
from ..cluster import SETTINGS as _KEYS  # the same names as every engine's cluster settings
from .backends import KvCaches, StoreTier
from .compat import KvGeometry
from .config import ConfigError, ConnectorConfig

log = logging.getLogger("tpu_sync.vllm")


def cluster_settings(cfg: ConnectorConfig) -> Dict[str, Any]:
    """The validated ``cluster`` dict of the extra config (empty when absent); the same settings
    as :func:`tpu_sync.cluster.settings`.

    Raises: ConfigError for unknown keys or missing ``endpoints``/``advertise``."""
    c = cfg.extra.get("cluster") or {}
    if not isinstance(c, dict):
        raise ConfigError("kv_connector_extra_config['cluster'] must be a dict")
    unknown = set(c) - _KEYS
    if unknown:
        raise ConfigError(f"unknown cluster settings {sorted(unknown)}; known: {sorted(_KEYS)}")
    if c and (not c.get("endpoints") or not c.get("advertise")):
        raise ConfigError("cluster settings need 'endpoints' and 'advertise'")
    return c


class ClusterTier(StoreTier):
    """A :class:`StoreTier` published into the cluster directory, whose loads of what a peer
    holds go straight into the KV blocks (see the module docs). Called from the worker's
    model-runner thread only."""

    def __init__(self, cfg: ConnectorConfig, geometry: KvGeometry, caches: KvCaches) -> None:
        from .. import cluster

        super().__init__(cfg, geometry, caches)
        c = cluster_settings(cfg)
        self._ns = self.store.info()["namespace"]
        self._block_bytes = geometry.block_bytes
        self._geometry = geometry
        self._rank = caches.tp_rank
        self._base_ns = geometry.namespace(cfg.namespace)
        self._layout_meta = geometry.tpu_sync_layout(caches.num_blocks)
        self._key_stores: Dict[str, Any] = {}
        self._cands: Dict[Tuple[bytes, int], List[Dict[str, Any]]] = {}
        # The directory record describes the store (tpu_sync::cluster::StoreSource): a peer of
        # another layout plans its load from it.
        meta = json.dumps(dict(layout=self._layout_meta, rank=caches.tp_rank, namespace=self._ns))
        self.member = cluster.Member(self.store, c, rank=caches.tp_rank, meta=meta)
        self._timeout = self.member.timeout
        self.directory, self.server, self.publisher = self.member.directory, self.member.server, self.member.publisher
        self.advertise, self.host_id = self.member.advertise, self.member.host_id
        #: blocks loaded (or fetched) from peers, and remote loads into device blocks
        self.remote_blocks = 0
        self.remote_loads = 0
        log.info("tpu_sync: cluster tier %s serving on %s, published to %s", self.host_id, self.advertise,
                 c["endpoints"])

    # ---- peers ------------------------------------------------------------------------------

    def _keys_in(self, namespace: str, hashes: Sequence[bytes]) -> List[bytes]:
        """Store keys of vLLM block hashes in another rank's namespace (a key-only store per
        namespace, one block of host memory each)."""
        if namespace == self._ns:
            return [self.key(h) for h in hashes]
        st = self._key_stores.get(namespace)
        if st is None:
            import tpu_sync

            st = tpu_sync.Store(namespace=namespace, block_bytes=self._block_bytes,
                                capacity_bytes=self._block_bytes, lock_memory=False, populate=False)
            self._key_stores[namespace] = st
        return [st.engine_key(h) for h in hashes]

    def _candidates(self, hashes: Sequence[bytes], local: int) -> List[Dict[str, Any]]:
        """Peers holding more of the chain than ``local`` blocks, longest first: ``[{"blocks",
        "src_layout", "sources"}]`` with one source per rank of the peer's replica (see
        :func:`tpu_sync.cluster.load`). Peers whose directory record is not a store description
        of this model, or whose other ranks are not found, are skipped."""
        keys = [self.key(h) for h in hashes]
        out: List[Dict[str, Any]] = []
        for cand in self.directory.lookup(self._ns, keys):
            if cand["id"] == self.host_id or cand["blocks"] <= local:
                continue
            try:
                meta = json.loads(cand.get("meta") or "")
                layout = meta["layout"]
                tp = int(layout["spec"]["tp"])
            except (ValueError, KeyError, TypeError):
                continue
            if self._geometry.groups and not same_layout(layout, self._layout_meta):
                # KV cache groups load through host memory (get_groups, get_host), which does
                # not reshard: only a peer of this layout can serve them.
                continue
            n = int(cand["blocks"])
            replica = _replica(cand["id"])
            sources: List[Dict[str, Any]] = []
            for r in range(tp):
                if r == self._rank:
                    sources.append(dict(addr=cand["addr"], namespace=self._ns, keys=keys))
                    continue
                ns = self._ns_of_rank(r)
                rkeys = self._keys_in(ns, hashes)
                peer = [c for c in self.directory.lookup(ns, rkeys) if _replica(c["id"]) == replica]
                if not peer:
                    break
                n = min(n, int(peer[0]["blocks"]))
                sources.append(dict(addr=peer[0]["addr"], namespace=ns, keys=rkeys))
            if len(sources) == tp and n > local:
                out.append(dict(blocks=n, src_layout=layout, sources=sources, id=cand["id"]))
        out.sort(key=lambda c: -c["blocks"])
        return out

    def _ns_of_rank(self, rank: int) -> str:
        return self._base_ns + (f"/rank{rank}" if rank else "")

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks present locally or, when more, at a peer (loaded from there by
        :meth:`get`)."""
        keys = [self.key(h) for h in hashes]
        local = int(self.store.lookup(keys))
        if local >= len(keys) or not keys:
            return local
        try:
            cands = self._candidates(hashes, local)
        except Exception as e:  # etcd down: a local-only lookup
            log.warning("tpu_sync: cluster lookup failed: %s", e)
            return local
        if not cands:
            return local
        self._remember(keys[0], len(keys), cands)
        return max(local, int(cands[0]["blocks"]))

    def _remember(self, first: bytes, n: int, cands: List[Dict[str, Any]]) -> None:
        self._cands[(first, n)] = cands
        while len(self._cands) > 1024:  # lookups never followed by a load
            self._cands.pop(next(iter(self._cands)))

    def _recall(self, hashes: Sequence[bytes], local: int) -> List[Dict[str, Any]]:
        """The candidates the lookup of this chain found (or a fresh lookup)."""
        first = self.key(hashes[0])
        for (k, n) in list(self._cands):
            if k == first and n >= len(hashes):
                return self._cands.pop((k, n))
        return self._candidates(hashes, local)

    def get(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Loads the chain into blocks ``block_ids``: from the local tier when it holds all of
        them, else the longest prefix a peer holds straight into the device blocks
        (:func:`tpu_sync.cluster.load`: fetched, checksummed, resharded to this layout when the
        peer's differs, written H2D in place), then stores those blocks in the local tier too.
        A failing peer falls back to the local prefix. Returns the leading blocks delivered."""
        from .. import cluster

        hashes, block_ids = list(hashes), [int(b) for b in block_ids]
        n = len(block_ids)
        keys = [self.key(h) for h in hashes[:n]]
        local = int(self.store.lookup(keys))
        if local >= n or not n:
            return super().get(hashes[:n], block_ids)
        try:
            cands = self._recall(hashes[:n], local)
        except Exception as e:
            log.warning("tpu_sync: cluster lookup failed: %s", e)
            cands = []
        bs = self._geometry.block_size
        dst = compat.placement(self._geometry.tpu_sync_layout(self._caches.num_blocks), block_ids)
        for cand in cands:
            m = min(n, int(cand["blocks"]))
            if m <= local:
                break
            sources = [dict(s, keys=s["keys"][:m]) for s in cand["sources"]]
            try:
                r = cluster.load(cand["src_layout"], sources, dict(dst, block_ids=[ids[:m] for ids in dst["block_ids"]]),
                                 m * bs, {self._rank: self._caches.views}, timeout=self._timeout,
                                 remote=self.member.remote)
            except Exception as e:  # a dead or stale peer is a miss
                log.warning("tpu_sync: remote load from %s failed: %s", cand["id"], e)
                continue
            got = int(r["tokens"]) // bs
            if got <= local:
                continue
            self.remote_blocks += got
            self.remote_loads += 1
            try:  # the prefix is now a local hit too (best effort)
                super().put(hashes[:got], block_ids[:got])
            except Exception as e:
                log.debug("tpu_sync: storing remotely loaded blocks failed: %s", e)
            return got
        return super().get(hashes[:local], block_ids[:local]) if local else 0

    def get_host(self, hashes: Sequence[bytes], outs: Sequence[Any]) -> int:
        """As :meth:`StoreTier.get_host`; blocks beyond the local prefix are fetched from a peer
        of this layout (:func:`tpu_sync.cluster.fetch`, checksummed) into ``outs`` and stored in
        the local tier too. Loads of a model with KV cache groups come this way
        (:meth:`StoreTier.get_groups`)."""
        from .. import cluster

        got = super().get_host(hashes, outs)
        if got >= len(outs):
            return got
        try:
            cands = self._recall(list(hashes)[: len(outs)], got)
        except Exception as e:
            log.warning("tpu_sync: cluster lookup failed: %s", e)
            return got
        for cand in cands:
            if not same_layout(cand["src_layout"], self._layout_meta):
                continue  # another layout: the host path does not reshard
            s = next(x for x in cand["sources"] if x["namespace"] == self._ns)  # this rank's blocks
            try:
                # Only the blocks past the local prefix: a fetch writes each block before it checks
                # it, so a failing peer must never touch the blocks already read.
                n = got + cluster.fetch(s["addr"], s["namespace"], s["keys"][got:len(outs)], list(outs[got:]),
                                        timeout=self._timeout, remote=self.member.remote)
            except Exception as e:
                log.warning("tpu_sync: fetch from %s failed: %s", cand["id"], e)
                continue
            if n > got:
                self.remote_blocks += n - got
                self.remote_loads += 1
                try:  # the fetched blocks are now a local hit too (best effort)
                    self.put_host(list(hashes)[got:n], list(outs[got:n]), parent=hashes[got - 1] if got else None)
                except Exception as e:
                    log.debug("tpu_sync: storing fetched blocks failed: %s", e)
                return n
        return got

    def stats(self) -> Dict[str, Any]:
        """The store's counters, plus ``remote_blocks`` (blocks fetched from peers) and the
        publisher's counters under ``publisher``."""
        s = dict(super().stats())
        s["remote_blocks"] = self.remote_blocks
        s["remote_loads"] = self.remote_loads
        try:
            s["publisher"] = self.publisher.stats()
        except Exception:  # closed
            pass
        return s

    def close(self) -> None:
        """Stops publishing (the entries go at once) and serving, then closes the store."""
        self.member.close()
        for h in self._key_stores.values():
            try:
                h.close()
            except Exception as e:  # never fail a shutdown
                log.warning("tpu_sync: closing the cluster tier: %s", e)
        super().close()


def same_layout(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Whether two stores' layouts (``ParallelLayout`` or grouped ``HybridLayout`` JSON) give
    their host-tier entries the same bytes: equal but for the block counts (each instance's
    own pool size), also per KV cache group."""
    def norm(x: Dict[str, Any]) -> Dict[str, Any]:
        x = dict(x, num_blocks=0)
        if isinstance(x.get("groups"), list):
            x["groups"] = [dict(g, num_blocks=0) if isinstance(g, dict) else g for g in x["groups"]]
        return x

    return norm(a) == norm(b)


def _replica(host_id: str) -> str:
    """The instance of a per-rank host id (``...-r<rank>`` derived ids; a given id is shared by
    all ranks)."""
    return re.sub(r"-r\d+$", "", host_id)
