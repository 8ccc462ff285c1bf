"""The connector's transfer statistics through vLLM 0.32's connector-stats hooks.

* Workers collect :class:`TpuSyncConnectorStats` per engine step
  (``KVConnectorBase_V1.get_kv_connector_stats``); vLLM aggregates the workers' objects
  (``aggregate``), rebuilds them in the logger process from the data dict
  (``build_kv_connector_stats``), logs ``reduce()`` with its throughput line, and hands the dict
  to :class:`TpuSyncPromMetrics` (``build_prom_metrics``), whose metrics ``vllm serve`` exposes on
  its ``/metrics`` beside vLLM's own:

  ==========================================  =========  ==========================================
  name (as exposed)                           type       meaning
  ==========================================  =========  ==========================================
  ``vllm:tpu_sync_xfer_time_seconds``         histogram  duration of each completed P/D pull
  ``vllm:tpu_sync_bytes_transferred_total``   counter    KV bytes those pulls received
  ``vllm:tpu_sync_transfers_total``           counter    P/D pulls completed
  ``vllm:tpu_sync_failed_transfers_total``    counter    failed pulls, label ``kind`` (the error)
  ``vllm:tpu_sync_offload_loaded_blocks_total``  counter  blocks loaded from the host tier
  ``vllm:tpu_sync_offload_saved_blocks_total``   counter  blocks saved to the host tier
  ``vllm:tpu_sync_offload_failed_loads_total``   counter  host-tier loads that did not deliver
  ==========================================  =========  ==========================================

The library's own ``tpu_sync_*`` metrics (``tpu_sync.metrics()``; the connector's
``metrics_addr`` option serves them per rank) cover the layers below (device copies, network
bytes by transport, host-tier hits and occupancy).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Union

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

_LISTS = ("transfer_duration", "bytes_transferred", "failed_transfers")
_COUNTS = ("loaded_blocks", "saved_blocks", "failed_loads")


@dataclass
class TpuSyncConnectorStats(KVConnectorStats):
    """Observations of one interval: per completed pull its duration (s) and bytes; per failed pull
    its error kind; block counts of the host tier. Serializable (lists and ints)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        for k in _LISTS:
            self.data.setdefault(k, [])
        for k in _COUNTS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data: Dict[str, Union[List[Any], int]] = {k: [] for k in _LISTS}
        self.data.update({k: 0 for k in _COUNTS})

    def __getitem__(self, key: str) -> Any:
        """``stats["data"]``: the data dict. vLLM 0.29's ``MultiConnector`` Prometheus metrics
        (``MultiKVConnectorPromMetrics.observe``, hence vLLM-TorchTPU's ``TPUMultiConnector``)
        index each child's stats as ``stats_data["data"]``, and in an in-process engine that is
        this object, not its serialized dict (vLLM 0.32 passes the child's data itself)."""
        if key == "data":
            return self.data
        raise KeyError(key)

    def record_pull(self, seconds: float, nbytes: int) -> None:
        self.data["transfer_duration"].append(float(seconds))
        self.data["bytes_transferred"].append(int(nbytes))

    def record_failure(self, kind: str) -> None:
        self.data["failed_transfers"].append(str(kind))

    def add(self, key: str, n: int) -> None:
        self.data[key] = int(self.data[key]) + int(n)

    def clone_and_reset(self) -> "TpuSyncConnectorStats":
        old = copy.deepcopy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in _LISTS) and not any(self.data[k] for k in _COUNTS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is not None and not other.is_empty():
            for k in _LISTS:
                self.data[k].extend(other.data.get(k, []))
            for k in _COUNTS:
                self.data[k] = int(self.data[k]) + int(other.data.get(k, 0))
        return self

    def reduce(self) -> Dict[str, Union[int, float]]:
        d = self.data["transfer_duration"]
        b = self.data["bytes_transferred"]
        secs = sum(d)
        return {
            "Num successful transfers": len(d),
            "Num failed transfers": len(self.data["failed_transfers"]),
            "Avg xfer time (ms)": round(secs / len(d) * 1e3, 3) if d else 0,
            "Avg MB per transfer": round(sum(b) / len(b) / 2**20, 3) if b else 0,
            "Throughput (MB/s)": round(sum(b) / 2**20 / secs, 3) if secs > 0 else 0,
            "Offload loaded blocks": int(self.data["loaded_blocks"]),
            "Offload saved blocks": int(self.data["saved_blocks"]),
            "Offload failed loads": int(self.data["failed_loads"]),
        }


class TpuSyncPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics (see the module docstring), one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: Dict[type, type], labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        buckets = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
        per = lambda m: create_metric_per_engine(m, self.per_engine_labelvalues)  # noqa: E731
        self.xfer_time = per(self._histogram_cls(
            name="vllm:tpu_sync_xfer_time_seconds", buckets=buckets, labelnames=labelnames,
            documentation="Duration of tpu-sync P/D KV pulls (completed ones)."))
        self.bytes = per(self._counter_cls(
            name="vllm:tpu_sync_bytes_transferred", labelnames=labelnames,
            documentation="KV bytes received by tpu-sync P/D pulls."))
        self.transfers = per(self._counter_cls(
            name="vllm:tpu_sync_transfers", labelnames=labelnames,
            documentation="tpu-sync P/D pulls completed."))
        self._failed = self._counter_cls(
            name="vllm:tpu_sync_failed_transfers", labelnames=labelnames + ["kind"],
            documentation="tpu-sync P/D pulls failed, by error kind.")
        self.loaded = per(self._counter_cls(
            name="vllm:tpu_sync_offload_loaded_blocks", labelnames=labelnames,
            documentation="KV blocks loaded from the tpu-sync host tier."))
        self.saved = per(self._counter_cls(
            name="vllm:tpu_sync_offload_saved_blocks", labelnames=labelnames,
            documentation="KV blocks saved to the tpu-sync host tier."))
        self.failed_loads = per(self._counter_cls(
            name="vllm:tpu_sync_offload_failed_loads", labelnames=labelnames,
            documentation="tpu-sync host-tier loads that did not deliver every block."))

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for s in d.get("transfer_duration", []):
            self.xfer_time[engine_idx].observe(s)
        n = len(d.get("transfer_duration", []))
        if n:
            self.transfers[engine_idx].inc(n)
        b = sum(d.get("bytes_transferred", []))
        if b:
            self.bytes[engine_idx].inc(b)
        for kind in d.get("failed_transfers", []):
            self._failed.labels(*self.per_engine_labelvalues[engine_idx], kind).inc()
        for key, m in (("loaded_blocks", self.loaded), ("saved_blocks", self.saved),
                       ("failed_loads", self.failed_loads)):
            v = int(d.get(key, 0))
            if v:
                m[engine_idx].inc(v)
