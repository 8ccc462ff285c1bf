"""The connector's host tier shared across instances (``kv_both`` with ``cluster`` settings).

With ``kv_connector_extra_config = {"cluster": {...}}`` the worker's host tier is a
:class:`ClusterTier`: the ordinary :class:`~tpu_sync.vllm.backends.StoreTier`, whose blocks are
also published into the cluster prefix directory (etcd) and served to other instances
(:class:`tpu_sync.cluster.RemoteServer`), and whose lookups, when the local tier holds less of a
prompt than another instance, fetch the missing blocks from that instance into the local tier
first, so the engine then loads them exactly as a local hit. Settings (``cluster`` dict):

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

A failing directory or peer is a miss (logged), never an engine error; fetched blocks are checked
(length and xxh3-64) before they are stored.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Sequence

from .backends import KvCaches, StoreTier
from .compat import KvGeometry
from .config import ConfigError, ConnectorConfig

log = logging.getLogger("tpu_sync.vllm")

_KEYS = {"endpoints", "advertise", "listen", "host_id", "prefix", "lease_ttl", "user", "password",
         "tls_ca_file", "tls_cert_file", "tls_key_file", "tls_domain", "fetch_timeout"}


def cluster_settings(cfg: ConnectorConfig) -> Dict[str, Any]:
    """The validated ``cluster`` dict of the extra config (empty when absent).

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
    """A :class:`StoreTier` published into the cluster directory and filled from peers on lookup
    (see the module docs)."""

    def __init__(self, cfg: ConnectorConfig, geometry: KvGeometry, caches: KvCaches) -> None:
        from .. import cluster

        super().__init__(cfg, geometry, caches)
        c = cluster_settings(cfg)
        self._ns = self.store.info()["namespace"]
        self._block_bytes = geometry.block_bytes
        self._timeout = float(c.get("fetch_timeout", 5.0))
        advertise = str(c["advertise"])
        listen = str(c.get("listen") or f"0.0.0.0:{advertise.rpartition(':')[2]}")
        host_id = str(c.get("host_id") or f"{advertise.replace(':', '_')}-r{caches.tp_rank}")
        opts = {k: c[k] for k in ("prefix", "lease_ttl", "user", "password", "tls_ca_file", "tls_cert_file",
                                  "tls_key_file", "tls_domain") if k in c}
        self.directory = cluster.Directory(list(c["endpoints"]), **opts)
        self.server = cluster.RemoteServer(self.store, listen)
        if advertise.endswith(":0"):
            advertise = f"{advertise.rpartition(':')[0]}:{self.server.addr.rpartition(':')[2]}"
        self.advertise = advertise
        self.publisher = self.directory.publish(self.store, host_id=host_id, addr=advertise)
        self.host_id = host_id
        self.remote_blocks = 0
        log.info("tpu_sync: cluster tier %s serving on %s, published to %s", host_id, advertise, c["endpoints"])

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks present locally, after fetching what a peer holds beyond them."""
        keys = [self.key(h) for h in hashes]
        local = int(self.store.lookup(keys))
        if local >= len(keys):
            return local
        try:
            cands = [c for c in self.directory.lookup(self._ns, keys) if c["id"] != self.host_id]
        except Exception as e:  # etcd down: a local-only lookup
            log.warning("tpu_sync: cluster lookup failed: %s", e)
            return local
        for cand in cands:
            if cand["blocks"] <= local:
                break
            want = keys[: len(keys)]
            outs = [bytearray(self._block_bytes) for _ in want]
            try:
                from .. import cluster

                n = cluster.fetch(cand["addr"], self._ns, want, outs, timeout=self._timeout)
            except Exception as e:  # a dead or stale peer is a miss
                log.warning("tpu_sync: fetch from %s (%s) failed: %s", cand["id"], cand["addr"], e)
                continue
            if n <= local:
                continue
            r = self.store.put(want[:n], outs[:n])
            self.remote_blocks += int(r.stored)
            return int(self.store.lookup(keys))
        return local

    def stats(self) -> Dict[str, Any]:
        """The store's counters, plus ``remote_blocks`` (blocks fetched from peers) and the
        publisher's counters under ``publisher``."""
        s = dict(super().stats())
        s["remote_blocks"] = self.remote_blocks
        try:
            s["publisher"] = self.publisher.stats()
        except Exception:  # closed
            pass
        return s

    def close(self) -> None:
        """Stops publishing (the entries go at once) and serving, then closes the store."""
        for h in (self.publisher, self.server, self.directory):
            try:
                h.close()
            except Exception as e:  # never fail a shutdown
                log.warning("tpu_sync: closing the cluster tier: %s", e)
        super().close()
