"""Messages between the connector's scheduler side and its workers (picklable: they cross
process boundaries in vLLM's multiprocess executors). Needs vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class SendSpec:
    """Producer: serve a finished request's blocks.

    Attributes:
        req_id: vLLM request id.
        xfer_id: transfer id (< 2**53) the consumer pulls by.
        block_ids: the request's blocks, in order (same ids on every TP rank); with KV cache
            groups one list per group, each that group's held blocks
            (:meth:`tpu_sync.vllm.compat.KvGeometry.group_held_ids`).
        num_tokens: tokens whose KV the blocks hold.
        lease_s: seconds to keep serving if nobody pulls.
        decode_tp: TP size of the decode instance that pulls (its ranks are the pullers).
    """

    req_id: str
    xfer_id: int
    block_ids: List[int]
    num_tokens: int
    lease_s: float
    decode_tp: int = 1


@dataclass
class RecvSpec:
    """Consumer: pull a prefilled request's blocks into local blocks.

    Attributes:
        req_id: vLLM request id.
        xfer_id: the producer's transfer id.
        peers: producer endpoint address per producer TP rank.
        src_layout: the producer's tpu_sync layout.
        src_block_ids: producer blocks to pull (a contiguous run of the request's blocks; with
            KV cache groups one list per group, its held blocks); None for a both-at-once
            request (the worker asks the producer for its placement once it registered).
        dst_block_ids: local blocks to write, same length and order (with KV cache groups:
            one list per group, as ``src_block_ids``).
        num_tokens: tokens covered by these blocks (the last block may be partial).
        timeout_s: the pull fails after this many seconds.
        first_token: tokens the consumer already holds (a local prefix-cache hit, a multiple
            of its block size): only tokens ``first_token..num_tokens`` are pulled, and
            ``dst_block_ids`` are the local blocks from block ``first_token // block_size`` on.
    """

    req_id: str
    xfer_id: int
    peers: Dict[int, str]
    src_layout: Dict[str, Any]
    src_block_ids: Optional[List[int]]
    dst_block_ids: List[int]
    num_tokens: int
    timeout_s: float
    first_token: int = 0


@dataclass
class RejectSpec:
    """Consumer: tell the producers this request will not be pulled (refused or aborted before
    its pull), so they free its staged KV at once instead of keeping it for the lease.

    Attributes:
        req_id: vLLM request id.
        xfer_id: the producer's transfer id.
        peers: producer endpoint address per producer TP rank.
        reason: why (sent to the producer, logged there).
    """

    req_id: str
    xfer_id: int
    peers: Dict[int, str]
    reason: str


@dataclass
class TierOp:
    """Offload: save blocks to, or load blocks from, the host tier.

    Attributes:
        req_id: vLLM request id.
        hashes: vLLM block hashes (bytes), one per block, a contiguous run of the request's chain.
        block_ids: local blocks, same length and order.
        parent: hash of the block before ``hashes[0]`` (None when the run starts the chain).
        group_block_ids: a model with KV cache groups: the local blocks of every group
            (``[group][i]``, each as long as ``hashes``; vLLM's null block, id 0, where a
            sliding-window group holds no block, which a load skips); None for a uniform model.
    """

    req_id: str
    hashes: List[bytes]
    block_ids: List[int]
    parent: Optional[bytes] = None
    group_block_ids: Optional[List[List[int]]] = None


@dataclass
class TpuSyncMetadata(KVConnectorMetadata):
    """What the workers do in one engine step."""

    lookups: Dict[str, List[bytes]] = field(default_factory=dict)
    loads: List[TierOp] = field(default_factory=list)
    saves: List[TierOp] = field(default_factory=list)
    sends: List[SendSpec] = field(default_factory=list)
    recvs: List[RecvSpec] = field(default_factory=list)
    rejects: List[RejectSpec] = field(default_factory=list)
    #: layer-wise producer (``layerwise``): requests whose prefill completes in this step,
    #: registered before the forward and staged layer by layer as vLLM saves each layer.
    layer_sends: List[SendSpec] = field(default_factory=list)
    #: layer-wise producer: requests handed off (``request_finished`` kept their blocks) whose
    #: layer-wise registration is complete: reported in ``finished_sending`` this step.
    handoffs: List[str] = field(default_factory=list)
    #: layer-wise producer: transfer ids registered early but not handed off (aborted, or more
    #: tokens computed than registered): withdrawn.
    withdraws: List[int] = field(default_factory=list)
    #: consumer (``layerwise``): pulls this step's forward reads layer by layer
    #: (``wait_for_layer_load``); the request is scheduled at once (a synchronous load).
    layer_recvs: List[RecvSpec] = field(default_factory=list)
    #: requests vLLM preempted this step that have host-tier saves (``async_saves``): the
    #: workers wait for those saves before the forward (``handle_preemptions``), since vLLM
    #: freed their blocks at once.
    preempted: List[str] = field(default_factory=list)
    #: no token is computed in this step (every request waits for its KV, or none is left):
    #: the workers may wait for a pull before returning (``idle_wait_ms``).
    idle: bool = False


@dataclass
class TpuSyncWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step.

    Attributes:
        lookup_hits: leading blocks found in the host tier per looked-up request (pinned until
            the request finishes).
        failed_loads: requests whose host-tier load failed (their blocks were reported as load
            errors; vLLM recomputes them, and the scheduler saves them again).
        saved_blocks, loaded_blocks: host-tier blocks saved / loaded this step.
        failed_pulls: requests whose pull failed this step (also in ``finished_recving``; their
            blocks reported as load errors): for vLLM releases whose ``KVConnectorOutput`` has
            no ``failed_recving`` (0.29, which vLLM-TorchTPU forks).
    """

    lookup_hits: Dict[str, int] = field(default_factory=dict)
    failed_loads: Set[str] = field(default_factory=set)
    saved_blocks: int = 0
    loaded_blocks: int = 0
    failed_pulls: Set[str] = field(default_factory=set)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "TpuSyncWorkerMetadata":
        """Combines two workers' reports: a block is usable only if every rank has it (minimum
        of the hits), a load failed if it failed anywhere; counters are per-rank maxima."""
        assert isinstance(other, TpuSyncWorkerMetadata)
        hits = dict(self.lookup_hits)
        for k, v in other.lookup_hits.items():
            hits[k] = min(v, hits.get(k, v))
        return TpuSyncWorkerMetadata(
            lookup_hits=hits,
            failed_loads=self.failed_loads | other.failed_loads,
            saved_blocks=max(self.saved_blocks, other.saved_blocks),
            loaded_blocks=max(self.loaded_blocks, other.loaded_blocks),
            failed_pulls=self.failed_pulls | other.failed_pulls,
        )

    def is_empty(self) -> bool:
        """Nothing to report."""
        return not (self.lookup_hits or self.failed_loads or self.saved_blocks or self.loaded_blocks or
                    self.failed_pulls)


@dataclass
class TpuSyncHandshake(KVConnectorHandshakeMetadata):
    """One worker's P/D endpoint, collected by vLLM at start-up and handed to the scheduler.

    Attributes:
        tp_rank: the worker's TP rank.
        address: ``host:port`` consumers dial (None without P/D).
        block_format: the worker's block format tag (checked against the scheduler's).
        num_blocks: blocks per layer tensor.
        tp_ranks: every TP rank this worker's endpoint serves, when it holds more than its own
            (a JAX model runner holds them all: tpu-inference); None: ``tp_rank`` only.
    """

    tp_rank: int
    address: Optional[str]
    block_format: str
    num_blocks: int
    tp_ranks: Optional[List[int]] = None
