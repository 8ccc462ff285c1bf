"""``TpuSyncConnector``: vLLM's V1 KV connector interface (``KVConnectorBase_V1``, vLLM 0.32,
and vLLM 0.29's, which vLLM-TorchTPU 0.29 forks: :mod:`tpu_sync.vllm._api`) over tpu_sync. One instance per role and process: vLLM builds it with ``role=SCHEDULER`` in the
engine core and ``role=WORKER`` in each worker; the instance delegates to
:class:`~tpu_sync.vllm.scheduler.SchedulerSide` or :class:`~tpu_sync.vllm.worker.WorkerSide`.
See :mod:`tpu_sync.vllm` for how to enable it and :mod:`tpu_sync.vllm.config` for its settings.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from ._api import CacheHitSource, KVConnectorTransferResults

from .compat import kv_geometry
from .config import ConnectorConfig
from .metadata import TpuSyncMetadata

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("tpu_sync.vllm")

__all__ = ["TpuSyncConnector"]


class TpuSyncConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector for disaggregated prefill/decode and host-DRAM offload through tpu_sync.

    Args:
        vllm_config: the engine's configuration; ``kv_transfer_config.kv_role`` and
            ``kv_connector_extra_config`` select what the connector does.
        role: scheduler or worker.
        kv_cache_config: the engine's KV cache configuration (block count; its KV cache groups
            for a hybrid model: full attention and sliding window groups, each with its own
            block table, see :func:`tpu_sync.vllm.compat.kv_groups`).

    Raises:
        tpu_sync.vllm.config.ConfigError: bad settings; ValueError: a KV cache dtype or layout
        tpu_sync cannot move.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.parse(ktc.kv_role, ktc.kv_connector_extra_config)
        self.geometry = kv_geometry(vllm_config, kv_cache_config)
        if self.geometry.mla_parts and self.config.layerwise:
            from .config import ConfigError

            # The hooks name vLLM's layers; a sparse MLA layer is two cache layers and its
            # indexer one more (docs/tpu.md).
            raise ConfigError("layerwise is not supported yet for vLLM-TorchTPU's sparse MLA caches; leave it off")
        if self.geometry.mla_parts and self.config.extra.get("cluster"):
            from .config import ConfigError

            # A peer's blocks load through a uniform placement of one cache per layer, which
            # these caches are not. (Models with KV cache groups load a peer's entries of their
            # own layout through host memory: cluster_tier.ClusterTier.get_host.)
            what = "vLLM-TorchTPU's sparse MLA caches"
            raise ConfigError(f"the cluster tier is not supported yet for {what}; use the local host tier (offload) "
                              "and P/D")
        if self.geometry.has_state and self.config.layerwise:
            from .config import ConfigError

            # The layer-wise consumer loads block-aligned tokens short of the last one, but a
            # state slot holds the state after the producer's T - 1 tokens only (docs/vllm.md).
            raise ConfigError("layerwise is not supported for models with Mamba / linear-attention state "
                              "groups; leave it off")
        if self.geometry.has_state and self.config.offload:
            from .config import ConfigError

            # With mamba_cache_mode "none" vLLM keeps only a request's latest state: no state
            # exists at the block boundary a host-tier hit ends at (docs/vllm.md).
            raise ConfigError("offload is not supported for models with Mamba / linear-attention state groups "
                              "(vLLM's mamba_cache_mode 'none' keeps no state at block boundaries); use P/D "
                              "only (\"offload\": false)")
        self.scheduler_side = None
        self.worker_side = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import SchedulerSide

            self.scheduler_side = SchedulerSide(vllm_config, kv_cache_config, self.config, self.geometry)
        else:
            from .worker import WorkerSide

            self.worker_side = WorkerSide(vllm_config, self.config, self.geometry)

    # ---- class-level ---------------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        """``LBHNC`` (head-major blocks, so a TP reshard moves contiguous head slices); vLLM's CPU
        backend uses it anyway. None for MLA models (no heads to slice)."""
        mc = getattr(vllm_config, "model_config", None)
        if mc is None or getattr(mc, "use_mla", False):
            return None
        return "LBHNC"

    @property
    def requires_kv_delivery(self) -> bool:
        """Producers hand KV off; a pure offload cache is best effort."""
        return self.config.is_producer

    # ---- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, "torch.Tensor"]) -> None:
        """See :meth:`tpu_sync.vllm.worker.WorkerSide.register_kv_caches`."""
        assert self.worker_side is not None
        self.worker_side.register_kv_caches(kv_caches)

    def register_runner(self, runner: Any) -> None:
        """The engine's model runner: vLLM-TorchTPU calls this after :meth:`register_kv_caches`;
        tpu-inference calls only this, with ``runner.kv_caches`` a list of sharded
        ``jax.Array`` s. See :meth:`tpu_sync.vllm.worker.WorkerSide.register_runner`."""
        if self.worker_side is not None:
            self.worker_side.register_runner(runner)

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        """This worker's endpoint address and block format, for the scheduler side."""
        if self.worker_side is None or self.worker_side.caches is None:
            return None
        return self.worker_side.handshake()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Takes the step's metadata (before the forward, also inside vLLM's
        ``MultiConnector``) and registers the requests whose prefill completes this step, so
        their layers are published as the forward computes them."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None and isinstance(connector_metadata, TpuSyncMetadata):
            self.worker_side.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Runs this step's lookups and host-tier loads (synchronous; with ``layerwise`` started
        on a background thread), registrations, and starts pulls (asynchronous)."""
        meta = self._connector_metadata
        if self.worker_side is not None and isinstance(meta, TpuSyncMetadata):
            self.worker_side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With ``layerwise``: waits until this layer of the step's pulls and host-tier loads is
        in the KV cache (see :meth:`tpu_sync.vllm.worker.WorkerSide.wait_for_layer_load`).
        Otherwise a no-op: loads finish in :meth:`start_load_kv`, before the forward."""
        if self.worker_side is not None and self.config.layerwise:
            self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        """With ``layerwise``: stages and publishes this layer of the requests whose prefill
        completes this step, so decode instances pull it while the next layer is computed.
        Otherwise a no-op: blocks are saved whole, every layer at once, in :meth:`wait_for_save`."""
        if self.worker_side is not None and self.config.layerwise:
            self.worker_side.save_kv_layer(layer_name)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before the forward: waits for the host-tier saves of requests preempted this step
        (vLLM freed their blocks; ``async_saves``)."""
        if self.worker_side is not None and isinstance(kv_connector_metadata, TpuSyncMetadata):
            self.worker_side.handle_preemptions(kv_connector_metadata)

    def wait_for_save(self) -> None:
        """Saves the prompt blocks this step filled to the host tier: queues their D2H and
        returns (``async_saves``, the default; the blocks stay allocated until the saves are
        done), or copies them before returning."""
        meta = self._connector_metadata
        if self.worker_side is not None and isinstance(meta, TpuSyncMetadata):
            self.worker_side.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set) -> KVConnectorTransferResults:
        """Registrations done, pulls finished (and which of them failed)."""
        if self.worker_side is None:
            return KVConnectorTransferResults()
        return self.worker_side.get_transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set) -> Tuple[Optional[set], Optional[set]]:
        """``(finished_sending, finished_recving)`` (for vLLM versions without
        :meth:`get_transfer_results`)."""
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set:
        """Blocks a host-tier load or a pull did not fill (vLLM recomputes them)."""
        if self.worker_side is None:
            return set()
        return self.worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        """Host-tier lookup answers and counters for the scheduler side."""
        if self.worker_side is None:
            return None
        return self.worker_side.build_worker_meta()

    def get_kv_connector_stats(self) -> Any:
        """This interval's transfer and offload statistics (workers; None when there are none)."""
        if self.worker_side is None:
            return None
        return self.worker_side.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> Any:
        """Rebuilds :class:`~tpu_sync.vllm.stats.TpuSyncConnectorStats` from its data dict."""
        from .stats import TpuSyncConnectorStats

        return TpuSyncConnectorStats(data=dict(data)) if data is not None else TpuSyncConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        """The connector's Prometheus metrics (``vllm:tpu_sync_*``, :mod:`tpu_sync.vllm.stats`)."""
        from .stats import TpuSyncPromMetrics

        return TpuSyncPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Closes the host tier and the endpoint."""
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # ---- scheduler side ------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: Dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Records the workers' endpoint addresses (keyed by TP rank)."""
        if self.scheduler_side is not None:
            self.scheduler_side.set_handshake(metadata)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Keeps the cache manager (to read a request's block ids; vLLM 0.32)."""
        bind = getattr(super(), "bind_kv_cache_manager", None)
        if bind is not None:
            bind(kv_cache_manager)
        if self.scheduler_side is not None:
            self.scheduler_side.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Any) -> None:
        """Starts tracking a request."""
        if self.scheduler_side is not None:
            self.scheduler_side.on_new_request(request)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> Tuple[int, ...]:
        """The KV cache groups a load restores: every transfer group for a P/D pull (it moves the
        request's own blocks and state slot, so vLLM must not zero them), vLLM's default (the
        prefix-cacheable groups) for host-tier loads."""
        params = getattr(request, "kv_transfer_params", None)
        if params and params.get("do_remote_prefill") and self.config.is_consumer:
            return tuple(self._kv_cache_config.transfer_group_ids)
        return tuple(super().get_loaded_kv_cache_group_ids(request))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """See :meth:`tpu_sync.vllm.scheduler.SchedulerSide.get_num_new_matched_tokens`."""
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plans the pull or host-tier load into the allocated blocks."""
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Dict[CacheHitSource, int]:
        """HOST for host-tier hits, P2P for KV pulled from a prefill instance."""
        assert self.scheduler_side is not None
        return self.scheduler_side.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's work for the workers."""
        assert self.scheduler_side is not None
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Takes the workers' reports."""
        if self.scheduler_side is not None:
            self.scheduler_side.update_connector_output(connector_output)

    def request_finished_all_groups(self, request: Any, block_ids: tuple) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """vLLM's hybrid allocator (``SupportsHMA``): ``block_ids`` holds one list per KV cache
        group. See :meth:`tpu_sync.vllm.scheduler.SchedulerSide.request_finished_all_groups`."""
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished_all_groups(request, block_ids)

    def request_finished(self, request: Any, block_ids: list) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Producer: ``(True, kv_transfer_params)`` for a prefilled request to hand off."""
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        """Blocks held for pullers (freed once registered, next step) or for host-tier saves
        (freed once saved) come back without preempting anyone."""
        return bool(self.scheduler_side and self.scheduler_side.pending_frees())
