"""What the connector's worker moves KV with: a host tier (offload) and a P/D transport.

The defaults are tpu_sync's own: :class:`StoreTier` (a :class:`tpu_sync.Store`, the host KV tier)
and :class:`EndpointTransport` (a :class:`tpu_sync.Endpoint`, the network data plane), both
reading and writing vLLM's KV tensors in place through zero-copy PJRT views
(:meth:`tpu_sync.Client.view`). ``kv_connector_extra_config`` may name another factory
(``"host_tier": "module:callable"``, ``"pd_transport": "module:callable"``), called as
``factory(config, geometry, caches)`` and returning an object with the same methods (a P/D
transport's ``reject`` and the ``wait_for_registration`` argument of its ``pull`` are optional).

All methods are called from the worker's model-runner thread.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .compat import KvGeometry
from .config import ConnectorConfig


@dataclass
class KvCaches:
    """The KV tensors one vLLM worker registered, in layer order.

    Attributes:
        names: layer names, in model layer order.
        tensors: per-layer tensors ``[num_blocks, ...]`` (:meth:`KvGeometry.layer_shape` per block:
            vLLM CPU's LBHNC or a TPU backend's ragged paged attention v3 cache).
        num_blocks: blocks per layer tensor.
        layer_block_bytes: bytes of one block of one layer (the tensor's block stride; for strided
            views of a block-major bundle, the block's own size: its mirrors are contiguous).
        tp_rank: this worker's tensor-parallel rank.
        views: per-layer zero-copy tpu_sync buffers over ``tensors`` (filled by the default
            backends; None until then).
    """

    names: List[str]
    tensors: List[Any]
    num_blocks: int
    layer_block_bytes: int
    tp_rank: int
    views: Optional[List[Any]] = None
    #: the KV cache group of every layer (all 0 for a uniform model)
    layer_group: Optional[List[int]] = None
    #: a JAX runner's caches (tpu-inference, :class:`tpu_sync.jax_kv.JaxKv`): every TP rank in this
    #: process; ``views`` then lists every rank's layers, rank-major (one tier entry holds them all)
    jax: Any = None
    #: what stages blocks through the framework's own copies, where tpu_sync cannot address the
    #: caches (``framework-copy``): the :class:`tpu_sync.jax_kv.JaxKv` of a JAX runner, or the
    #: :class:`tpu_sync.torch_kv.TorchKv` of accelerator tensors; ``views`` are then its host
    #: mirrors, and the worker calls its ``stage``/``drop``/``commit``/``before_write``/
    #: ``after_write`` around every transfer. None: the views are the caches themselves.
    copier: Any = None
    #: the shape tpu_sync views each layer's tensor in (same bytes), where it differs from the
    #: tensor's own (:meth:`KvGeometry.view_shape`: the SEQ_ALONG_LANE cache as LBHNC regions)
    view_shape: Optional[Tuple[int, ...]] = None
    #: bytes of one block of each layer where the layers differ (vLLM-TorchTPU's sparse MLA
    #: caches: :meth:`KvGeometry.layer_bytes`); None: every layer :attr:`layer_block_bytes`
    layer_bytes: Optional[List[int]] = None

    def view_bytes(self, views: Sequence[Any]) -> List[int]:
        """Bytes of one block of each of ``views`` (:attr:`views`, or a replica's from
        :meth:`replica_of`), in order."""
        if self.layer_bytes is None:
            return [self.layer_block_bytes] * len(views)
        if len(views) != len(self.layer_bytes):
            raise ValueError(f"{len(views)} views for {len(self.layer_bytes)} layers of their own block sizes")
        return list(self.layer_bytes)

    def refresh(self) -> None:
        """A JAX runner's caches: reads the runner's current arrays again (a forward may have
        moved them) and sets ``views`` to every rank's layer buffers, rank-major."""
        if self.jax is not None:
            kv = self.jax.rank_views()
            self.views = [v for r in sorted(kv) for v in kv[r]]

    def kv(self, dp_rank: Optional[int] = None) -> Dict[int, List[Any]]:
        """The buffers a :class:`tpu_sync.Endpoint` moves: ``{TP rank: [view per layer]}`` for
        every rank this worker holds (one for vLLM's per-rank workers, all for a JAX runner);
        ``dp_rank``: only that data-parallel replica's ranks (``dp_rank * tp + t``), as a
        placement of that replica needs."""
        if self.jax is not None:
            if dp_rank is not None and self.jax.dp > 1:
                return self.jax.replica_views(int(dp_rank))
            return self.jax.rank_views()
        assert self.views is not None
        return {self.tp_rank: self.views}

    @property
    def entry_ranks(self) -> int:
        """TP ranks in one host-tier entry (all of a JAX runner's, one DP replica's with DP;
        else 1)."""
        if self.jax is None:
            return 1
        return len(self.jax.ranks) // max(1, int(self.jax.dp))

    def pieces(self, block_id: int) -> List[Tuple[Any, int, int]]:
        """``(view, byte offset, length)`` of block ``block_id`` in every layer, in layer order:
        one host-tier entry is their concatenation. A JAX runner with DP replicas: global
        ``block_id`` (replica ``block_id // per-replica blocks``), its replica's TP ranks only
        (an entry saved from one replica loads into any other)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range 0..{self.num_blocks}")
        views, offset = self.replica_of([block_id])
        return [(v, (block_id - offset) * n, n) for v, n in zip(views, self.view_bytes(views))]

    def replica_of(self, block_ids: Sequence[int]) -> Tuple[List[Any], int]:
        """``(views, first block)`` of the DP replica holding global blocks ``block_ids`` (a
        JAX runner with DP replicas: replica ``block_id // per-replica blocks``, the views of
        its TP ranks only, rank-major, and the global id of its block 0); ``(views, 0)``
        otherwise. vLLM's null block (id 0) names no replica and is left out of the choice.

        Raises:
            ValueError: ids of several replicas (a request's blocks are in one)."""
        from .compat import NULL_BLOCK_ID

        assert self.views is not None
        if self.jax is None or self.jax.dp <= 1:
            return self.views, 0
        nb = int(self.jax.num_blocks)
        reps = {int(b) // nb for b in block_ids if int(b) != NULL_BLOCK_ID}
        if len(reps) > 1:
            raise ValueError(f"block ids {list(block_ids)} lie in DP replicas {sorted(reps)}: one position's blocks "
                             "are in one replica")
        d = reps.pop() if reps else 0
        per = len(self.names)
        ranks = sorted(self.jax.ranks)  # views are rank-major in this order (refresh)
        views = [v for i, r in enumerate(ranks) if r // self.jax.tp == d for v in self.views[i * per:(i + 1) * per]]
        return views, d * nb

    def view_groups(self, views: Optional[Sequence[Any]] = None) -> List[int]:
        """The KV cache group of each of :attr:`views` (or of ``views``, a replica's from
        :meth:`replica_of`; a JAX runner's are every rank's layers, rank-major: view ``i`` is
        layer ``i % layers``)."""
        views = self.views if views is None else views
        assert views is not None
        if not self.layer_group:
            return [0] * len(views)
        n = len(self.layer_group)
        return [self.layer_group[i % n] for i in range(len(views))]

    def group_pieces(self, group_ids: Sequence[int]) -> List[Tuple[Any, int, int]]:
        """``(view, byte offset, length)`` in every layer, in layer order, of one block position
        of a model with KV cache groups: layer ``l``'s piece is block ``group_ids[group of l]``
        (one tier entry is their concatenation). With DP replicas (a JAX runner) the ids are
        global, of one replica, and the pieces that replica's ranks'.

        Raises:
            ValueError: a group count other than the layers' groups, ids of several DP
            replicas; IndexError: an id out of range."""
        for b in group_ids:
            if not 0 <= int(b) < self.num_blocks:
                raise IndexError(f"block id {b} out of range 0..{self.num_blocks}")
        views, offset = self.replica_of(group_ids)
        groups = self.view_groups(views)
        if len(group_ids) != max(groups) + 1:
            raise ValueError(f"{len(group_ids)} block ids for {max(groups) + 1} KV cache groups")
        return [(v, (int(group_ids[g]) - offset) * n, n) for v, g, n in zip(views, groups, self.view_bytes(views))]


def load_factory(spec: str) -> Callable[..., Any]:
    """Imports ``"module:callable"``.

    Raises:
        ValueError: malformed spec or missing attribute; ImportError from the import.
    """
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"factory must be 'module:callable', got {spec!r}")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec!r} is not callable")
    return obj


def _client(caches: KvCaches) -> Any:
    """One tpu_sync PJRT client per worker, with views of the KV tensors (zero-copy)."""
    import tpu_sync

    client = getattr(caches, "_client", None)
    if client is None:
        client = tpu_sync.Client()
        caches._client = client  # type: ignore[attr-defined]
        caches.views = [client.view(t, shape=caches.view_shape) for t in caches.tensors]
    return client


class StoreTier:
    """The host KV tier backed by :class:`tpu_sync.Store`: one entry per vLLM block holding that
    block of every layer (``geometry.block_bytes``), keyed by vLLM's block hash inside the
    geometry's namespace."""

    def __init__(self, cfg: ConnectorConfig, geometry: KvGeometry, caches: KvCaches) -> None:
        import tpu_sync

        self._caches = caches
        client = _client(caches)
        ns = geometry.namespace(cfg.namespace)
        if caches.jax is not None:
            # One entry holds every TP rank's bytes of the block (another format than a rank's).
            ns += f"/ranks{caches.entry_ranks}"
        elif caches.tp_rank:
            ns += f"/rank{caches.tp_rank}"
        shm = cfg.shm_name
        if shm and caches.tp_rank:
            shm = f"{shm}-rank{caches.tp_rank}"
        kw: Dict[str, Any] = dict(
            namespace=ns,
            block_bytes=geometry.block_bytes * caches.entry_ranks,
            capacity_bytes=cfg.host_capacity_bytes,
            shm_name=shm,
            verify_checksums=cfg.verify_checksums,
            client=client,
        )
        if cfg.disk_dir:
            kw["disk_dir"] = cfg.disk_dir
            kw["disk_capacity_bytes"] = cfg.disk_capacity_bytes
        # KV events from TP rank 0 only: every rank stores the same blocks (vLLM reports the
        # events its workers have in common).
        self._events = bool(cfg.kv_events) and not caches.tp_rank
        if self._events:
            kw["kv_events"] = dict(dict(block_size=geometry.block_size), **cfg.kv_events)
        self.store = tpu_sync.Store(**kw)

    def key(self, block_hash: bytes) -> bytes:
        """The store key of a vLLM block hash."""
        return self.store.engine_key(block_hash)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks of the chain present in the tier."""
        return int(self.store.lookup([self.key(h) for h in hashes]))

    def pin(self, hashes: Sequence[bytes]) -> Any:
        """A lease keeping the chain's leading present blocks from eviction (``close()`` ends it)."""
        return self.store.pin([self.key(h) for h in hashes])

    def put(self, hashes: Sequence[bytes], block_ids: Sequence[int], parent: Optional[bytes] = None) -> int:
        """Stores blocks ``block_ids`` of the KV tensors under ``hashes`` (``parent``: the hash of
        the block before ``hashes[0]``, None at the start of a chain); returns how many are in the
        tier afterwards (stored now or already present)."""
        return self._put(self.store.put_from_device, hashes, [self._caches.pieces(b) for b in block_ids], parent)

    def _put(self, put: Callable[..., Any], hashes: Sequence[bytes], blocks: Sequence[Any],
             parent: Optional[bytes]) -> int:
        """Stores ``blocks`` under ``hashes`` with the store's ``put`` (from device pieces or
        host bytes), described for KV events first; returns how many are in the tier after."""
        keys = [self.key(h) for h in hashes]
        if self._events and keys:
            # The events carry vLLM's block hashes, not the store's keys.
            self.store.describe_blocks(keys, hashes)
        r = put(keys, list(blocks), parent=None if parent is None else self.key(parent))
        return int(r.stored) + int(r.present)

    def put_host(self, hashes: Sequence[bytes], blocks: Sequence[Any], parent: Optional[bytes] = None) -> int:
        """Stores entries already in host memory (``blocks[i]``: ``geometry.block_bytes`` bytes,
        every layer of block ``i`` in layer order, as :meth:`get_host` gives them) under
        ``hashes`` (``parent``: the hash before ``hashes[0]``); returns how many are in the tier
        afterwards."""
        return self._put(self.store.put, hashes, blocks, parent)

    def put_groups(self, hashes: Sequence[bytes], group_ids: Sequence[Sequence[int]],
                   parent: Optional[bytes] = None) -> int:
        """A model with KV cache groups: stores block positions ``i`` under ``hashes[i]``, each
        entry the block ``group_ids[g][i]`` of every layer of every group ``g`` (in layer
        order, ``geometry.block_bytes``); returns how many are in the tier afterwards.

        Raises:
            ValueError: ``group_ids`` lists that disagree with the layers' groups or with
            ``hashes``, or vLLM's null block among them (a group that no longer holds a block)."""
        from .compat import NULL_BLOCK_ID

        if any(len(g) != len(hashes) for g in group_ids):
            raise ValueError(f"block ids per group {[len(g) for g in group_ids]} for {len(hashes)} hashes")
        per = [[int(g[i]) for g in group_ids] for i in range(len(hashes))]
        if any(b == NULL_BLOCK_ID for ids in per for b in ids):
            raise ValueError("a KV cache group holds vLLM's null block at a block to save")
        return self._put(self.store.put_from_device, hashes, [self._caches.group_pieces(ids) for ids in per], parent)

    def get_groups(self, hashes: Sequence[bytes], group_ids: Sequence[Sequence[int]]) -> int:
        """A model with KV cache groups: loads the chain's leading present entries (checksums
        verified) and writes each layer's part into block ``group_ids[group][i]`` of its
        layer, skipping vLLM's null block (the blocks before a sliding window, which the
        request does not hold); returns the number of leading entries delivered.

        Raises:
            ValueError: ``group_ids`` lists that disagree with the layers' groups or with
            ``hashes``; ``tpu_sync.errors.ChecksumError`` on corrupt data."""
        import numpy as np

        from tpu_sync import device

        from .compat import NULL_BLOCK_ID

        caches = self._caches
        for g in group_ids:
            for b in g:
                if not 0 <= int(b) < caches.num_blocks:
                    raise IndexError(f"block id {b} out of range 0..{caches.num_blocks}")
        # With DP replicas (a JAX runner): the request's replica (its global ids are in one).
        views, offset = caches.replica_of([b for g in group_ids for b in g])
        groups = caches.view_groups(views)
        if len(group_ids) != max(groups) + 1 or any(len(g) != len(hashes) for g in group_ids):
            raise ValueError(f"block ids per group {[len(g) for g in group_ids]} for {max(groups) + 1} groups "
                             f"and {len(hashes)} hashes")
        sizes = caches.view_bytes(views)
        starts = [sum(sizes[:layer]) for layer in range(len(sizes))]
        buf = np.empty((len(hashes), sum(sizes)), dtype=np.uint8)
        # Through get_host: a tier that also fetches from elsewhere (the cluster tier) does so here.
        n = int(self.get_host(hashes, [buf[i] for i in range(len(hashes))]))
        copies = []
        for i in range(n):
            for layer, (view, g) in enumerate(zip(views, groups)):
                b = int(group_ids[g][i])
                if b == NULL_BLOCK_ID:
                    continue
                if not 0 <= b < caches.num_blocks:
                    raise IndexError(f"block id {b} out of range 0..{caches.num_blocks}")
                lbb = sizes[layer]
                copies.append((view, (b - offset) * lbb, buf[i, starts[layer]:starts[layer] + lbb]))
        if copies:
            device.h2d(copies).wait()
        return n

    def get_host(self, hashes: Sequence[bytes], outs: Sequence[Any]) -> int:
        """Copies the chain's leading present blocks into host arrays (``outs[i]``:
        ``geometry.block_bytes`` writable bytes, every layer of block ``i`` in layer order), checking
        their checksums; returns the number delivered. For layer-wise loads
        (:class:`tpu_sync.vllm.worker.WorkerSide`), which then write the layers one by one."""
        return int(self.store.get([self.key(h) for h in hashes], outs).delivered)

    def get(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Loads the chain into blocks ``block_ids`` of the KV tensors; returns the number of
        leading blocks delivered. Raises ``tpu_sync.errors.ChecksumError`` on corrupt data."""
        r = self.store.get_to_device([self.key(h) for h in hashes], [self._caches.pieces(b) for b in block_ids])
        return int(r.delivered)

    def stats(self) -> Dict[str, Any]:
        """The store's counters."""
        return dict(self.store.stats())

    def close(self) -> None:
        """Closes the store (a shm segment stays for the next engine)."""
        self.store.close()


class EndpointTransport:
    """P/D over :class:`tpu_sync.Endpoint`: the producer registers a finished request's blocks
    (the endpoint stages them and serves them to pullers until released or the lease expires);
    the consumer pulls them into its own blocks, resharding when TP differs."""

    def __init__(self, cfg: ConnectorConfig, geometry: KvGeometry, caches: KvCaches) -> None:
        import tpu_sync

        self._caches = caches
        self._rank = caches.tp_rank
        client = _client(caches)
        kw: Dict[str, Any] = dict(listen=cfg.listen, transport=cfg.transport, timeout=cfg.pull_timeout_s,
                                  client=client, lease_s=cfg.lease_s, staging_budget_bytes=cfg.staging_budget_bytes,
                                  staging_wait=cfg.staging_wait_s,
                                  heartbeat_timeout=cfg.heartbeat_timeout_s,
                                  heartbeat_interval=min(1.0, cfg.heartbeat_timeout_s / 5),
                                  # Expected releases count consumer ranks: a consumer with one
                                  # endpoint per TP rank (vLLM-TorchTPU) and one with a single
                                  # endpoint for all (a JAX runner) release a request alike.
                                  count_releases_by_rank=True)
        if cfg.tls:
            kw["tls"] = cfg.tls
        if cfg.psk:
            kw["psk"] = cfg.psk
        self.endpoint = tpu_sync.Endpoint(**kw)
        host, _, port = str(self.endpoint.address).rpartition(":")
        self.address = f"{cfg.advertise_host or host}:{port}"

    def register(self, xfer_id: int, placement: Dict[str, Any], num_tokens: int, lease_s: float,
                 pullers: int = 1) -> None:
        """Producer: stages (D2H) this worker's ranks' blocks of ``placement`` and serves them as request
        ``xfer_id`` until ``pullers`` consumers released them or the endpoint's lease (``lease_s``
        of the config) passes without a live consumer. vLLM may reuse the blocks once this
        returns."""
        self.endpoint.register(xfer_id, placement, num_tokens, self._caches.kv(placement.get("dp_rank")),
                               expected_releases=pullers)

    def register_layers(self, xfer_id: int, placement: Dict[str, Any], num_tokens: int, lease_s: float,
                        pullers: int = 1) -> None:
        """Layer-wise producer: registers request ``xfer_id`` before its layers are computed
        (nothing staged yet); :meth:`publish_layers` stages each layer once the model wrote it.
        vLLM must keep the blocks until every layer is published."""
        self.endpoint.register_layers(xfer_id, placement, num_tokens, self._caches.kv(placement.get("dp_rank")),
                                      layers_ready=0, expected_releases=pullers)

    def publish_layers(self, xfer_id: int, layers: int) -> int:
        """Layer-wise producer: stages (D2H) and publishes layers ``..layers`` of ``xfer_id``;
        returns the layers published."""
        return self.endpoint.publish_layers(xfer_id, layers)

    def withdraw(self, xfer_id: int) -> None:
        """Producer: ends a registration (its pullers fail)."""
        self.endpoint.unregister(xfer_id)

    def active(self, xfer_id: int) -> bool:
        """Producer: whether ``xfer_id`` is registered here and being served."""
        return self.endpoint.registration_state(xfer_id) == "active"

    def refuse(self, xfer_id: int, reason: str) -> None:
        """Producer: this worker will not serve ``xfer_id`` (its registration failed or was
        given up): a registration of it ends, and its consumers' pulls fail at once with
        ``reason`` instead of waiting out their pull timeout (:meth:`tpu_sync.Endpoint.refuse`)."""
        self.endpoint.refuse(xfer_id, reason)

    def pull(self, xfer_id: int, peers: Dict[int, str], src: Dict[str, Any], dst: Dict[str, Any],
             num_tokens: int, wait_for_registration: Optional[float] = None, layerwise: bool = False,
             kv: Optional[Dict[int, List[Any]]] = None) -> Any:
        """Consumer: starts pulling request ``xfer_id`` into this worker's ranks' blocks of ``dst``;
        returns a handle with ``done``, ``error``, ``cancel()`` (and, with ``layerwise``, each
        layer written as it arrives: ``wait_layers(n, timeout)``). A producer that has not
        registered the request yet is waited for up to ``wait_for_registration`` seconds.

        ``kv``: the destination buffers (:meth:`buffers`), resolved earlier on the model's
        thread; None resolves them now, which only the model's thread may do (a JAX runner's
        arrays are replaced by every forward: read from another thread mid-forward, one of them
        may already be donated and deleted)."""
        return self.endpoint.pull(xfer_id, peers, src, dst, num_tokens,
                                  self._caches.kv(dst.get("dp_rank")) if kv is None else kv,
                                  wait_for_registration=wait_for_registration, layerwise=layerwise)

    def buffers(self, dp_rank: Optional[int] = None) -> Dict[int, List[Any]]:
        """The buffers a pull writes, ``{TP rank: [buffer per layer]}`` (:meth:`KvCaches.kv`;
        ``dp_rank``: that data-parallel replica's).
        Model's thread only; the result may be used from any thread (a zero-copy view stays
        over the same memory when a forward donates the caches in place, and a pull checks the
        caches did not move, ``after_write``)."""
        return self._caches.kv(dp_rank)

    def describe(self, xfer_id: int, address: str) -> Tuple[Dict[str, Any], int]:
        """Consumer: the placement and token count the producer at ``address`` registered request
        ``xfer_id`` with (a both-at-once request, whose producer blocks the consumer cannot know
        in advance). Blocks for the network round trip. Raises ``UnknownRequestError`` while the
        producer has not registered it."""
        return self.endpoint.describe(xfer_id, address)

    def reject(self, xfer_id: int, peers: Dict[int, str], reason: str) -> None:
        """Consumer: tells the producers this rank will not pull request ``xfer_id`` (refused or
        aborted): they free its staged KV at once. Blocks for the network round trip."""
        self.endpoint.reject(xfer_id, peers, reason)

    def close(self) -> None:
        """Stops serving."""
        self.endpoint.close(drain=False)


def make_host_tier(cfg: ConnectorConfig, geometry: KvGeometry, caches: KvCaches) -> Any:
    """The configured host tier (default :class:`StoreTier`; with ``cluster`` settings
    :class:`tpu_sync.vllm.cluster_tier.ClusterTier`)."""
    if not cfg.host_tier and cfg.extra.get("cluster"):
        from .cluster_tier import ClusterTier

        return ClusterTier(cfg, geometry, caches)
    factory = load_factory(cfg.host_tier) if cfg.host_tier else StoreTier
    return factory(cfg, geometry, caches)


def make_pd_transport(cfg: ConnectorConfig, geometry: KvGeometry, caches: KvCaches) -> Any:
    """The configured P/D transport (default :class:`EndpointTransport`)."""
    factory = load_factory(cfg.pd_transport) if cfg.pd_transport else EndpointTransport
    return factory(cfg, geometry, caches)
