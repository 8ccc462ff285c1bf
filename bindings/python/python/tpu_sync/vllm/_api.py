"""vLLM's connector API across the releases this connector runs on: vLLM 0.32 (the CPU engines
of the tests) and vLLM 0.29 (the release vLLM-TorchTPU 0.29 forks; its connector interface is
upstream 0.29.0's, ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` identical in both
wheels). Names that only 0.32 has get stand-ins here. Imports vLLM.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Set

__all__ = ["CacheHitSource", "KVConnectorTransferResults", "reports_failed_recving"]


class _CacheHitSource(str, enum.Enum):
    """vLLM 0.32's ``CacheHitSource`` (``vllm.v1.metrics.cache_hit_source``, the same members and
    values), for vLLM releases without it (0.29, which vLLM-TorchTPU 0.29 forks: there nothing
    asks for hit sources)."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"


try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vLLM 0.29
    CacheHitSource = _CacheHitSource  # type: ignore[misc,assignment]


@dataclass
class _TransferResults:
    """vLLM 0.32's ``KVConnectorTransferResults``, for vLLM releases without it (0.29: the
    connector answers ``get_finished`` from it, and failed pulls reach vLLM through
    ``get_block_ids_with_load_errors`` only)."""

    finished_sending: Set[str] = field(default_factory=set)
    finished_recving: Set[str] = field(default_factory=set)
    failed_recving: Set[str] = field(default_factory=set)


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM 0.29
    KVConnectorTransferResults = _TransferResults  # type: ignore[misc,assignment]


def reports_failed_recving() -> bool:
    """Whether this vLLM reads ``failed_recving`` (vLLM >= 0.30's ``KVConnectorTransferResults``):
    a failed asynchronous load can be reported by request. vLLM 0.32 also refuses block-level
    load errors from a model with several KV cache groups (``Scheduler._handle_invalid_blocks``:
    group-local block ids cannot name a request), so there a failed load must be reported by
    request."""
    return KVConnectorTransferResults is not _TransferResults
