"""Messages between the connector's scheduler side and its workers (picklable: they cross
process boundaries in vLLM's multiprocess executors). Needs vLLM."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from .._check import NULL_BLOCK_ID


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
            one list per group, as ``src_block_ids``), less those of a local hit (below).
        num_tokens: tokens covered by these blocks (the last block may be partial).
        timeout_s: the pull fails after this many seconds.
        first_token: tokens the consumer already holds (a local prefix-cache hit, a multiple
            of its block size): only tokens ``first_token..num_tokens`` are pulled, and
            ``dst_block_ids`` are the local blocks from block ``first_token // block_size`` on
            (with KV cache groups: each group's held blocks from there on,
            :meth:`~tpu_sync.vllm.compat.KvGeometry.group_held_ids`).
        next_token: with KV cache groups, the first token vLLM computes after the pull (the
            last prompt token again after a whole-prompt load; a layer-wise consumer's first
            unloaded token); None: ``num_tokens``. Sliding-window groups pull that token's
            window (``HybridPlacement::next_token``), and ``dst_block_ids`` hold it.
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
    next_token: Optional[int] = None


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
    #: a load reported like a pull (the scheduler answered it as asynchronous): in
    #: ``finished_recving``, and on failure in ``failed_recving`` instead of as load errors
    #: (tpu-inference's DP scheduler: block-level load errors cannot name a DP rank's blocks)
    report: bool = False


#: ``TpuSyncMetadata`` fields of ops whose block ids a DP scheduler offsets, and the field of
#: each op that holds them (a flat list, or one list per KV cache group; a :class:`TierOp` of a
#: model with groups also has ``group_block_ids``): see :func:`_dp_ids`.
_DP_BLOCK_FIELDS = {"loads": "block_ids", "saves": "block_ids", "sends": "block_ids", "layer_sends": "block_ids",
                    "recvs": "dst_block_ids", "layer_recvs": "dst_block_ids"}
#: ``TpuSyncMetadata`` list fields without block ids, moved as they are.
_DP_PLAIN_FIELDS = ("rejects", "handoffs", "withdraws", "refusals", "preempted")


def _dp_ids(op: Any, attr: str) -> List[int]:
    """An op's rank-local block ids as one flat list, the form the DP scheduler offsets: its
    field ``attr`` (a flat list, or one list per KV cache group concatenated in group order),
    then a :class:`TierOp`'s ``group_block_ids`` concatenated likewise."""
    ids = getattr(op, attr)
    out = [int(b) for g in ids for b in g] if _nested(ids) else [int(b) for b in ids]
    gids = getattr(op, "group_block_ids", None)
    if gids is not None:
        out.extend(int(b) for g in gids for b in g)
    return out


def _nested(ids: Any) -> bool:
    return bool(ids) and isinstance(ids[0], (list, tuple))


def _dp_restore(op: Any, attr: str, merged: List[int]) -> Any:
    """``op`` with its block ids (as :func:`_dp_ids` flattened them) replaced by ``merged``,
    the DP scheduler's offset copy, in the op's own structure. In per-group lists vLLM's null
    block stays ``NULL_BLOCK_ID`` (0): every rank's scheduler has its own null block, local id
    0, which the merge offset to ``rank * num_blocks_per_rank`` like any other id; the workers
    skip id 0 (the null block of DP rank 0, the only one that is 0 globally) in those lists.

    Raises:
        ValueError: ``merged`` of another length than the op's ids, or an offset that differs
            between the op's ids (a merge that did not add one rank's offset to all of them)."""
    local = _dp_ids(op, attr)
    if len(merged) != len(local):
        raise ValueError(f"DP entry: {len(merged)} block ids for an op of {len(local)}")
    offsets = {int(m) - b for m, b in zip(merged, local) if b != NULL_BLOCK_ID}
    if len(offsets) > 1:
        raise ValueError(f"DP entry: block ids offset by {sorted(offsets)}: one op's blocks are in one DP rank")
    pos = 0

    def take(ids: Any, nested: bool) -> Any:
        nonlocal pos
        if not nested:
            pos += len(ids)
            return [int(m) for m in merged[pos - len(ids):pos]]
        groups = []
        for g in ids:
            groups.append([NULL_BLOCK_ID if int(b) == NULL_BLOCK_ID else int(m)
                           for b, m in zip(g, merged[pos:pos + len(g)])])
            pos += len(g)
        return groups

    ids = getattr(op, attr)
    gids = getattr(op, "group_block_ids", None)
    # A grouped tier op's flat ids are one group's list (vLLM's first group, maybe a sliding
    # window's, with null blocks): nulls restored there too.
    changes: Dict[str, Any] = {attr: take([ids], True)[0] if gids is not None and not _nested(ids)
                               else take(ids, _nested(ids))}
    if gids is not None:
        changes["group_block_ids"] = take(gids, True)
    return dataclasses.replace(op, **changes)


@dataclass
class DpEntry:
    """One item of a DP rank scheduler's step, in the form tpu-inference's DP scheduler passes
    on (``tpu_inference/core/sched/dp_scheduler.py`` 0.32.0, ``_combine_scheduler_outputs``): it
    builds ``type(meta)()`` and keeps only the ``requests_meta`` list of every rank's metadata,
    adding ``rank * num_blocks_per_rank`` to each entry's non-empty ``local_block_ids``. So an
    op's block ids travel there, rank-local when built and global (the worker's, as
    :class:`tpu_sync.jax_kv.JaxKv` takes them) when the workers read them.

    Attributes:
        kind: the :class:`TpuSyncMetadata` field the item belongs to (``"lookups"``: ``item`` is
            ``(req_id, hashes)``; ``"idle"``: this rank computes nothing this step;
            ``"hello"``: this rank's scheduler has no worker addresses yet, the workers send
            their handshake in their next report).
        item: the op (its block ids as the rank scheduler gave them), or the plain value.
        local_block_ids: the op's block ids (field ``_DP_BLOCK_FIELDS[kind]``, per-group lists
            and a tier op's ``group_block_ids`` concatenated: :func:`_dp_ids`), offset by the
            DP scheduler; empty for items without blocks.
    """

    kind: str
    item: Any = None
    local_block_ids: List[int] = field(default_factory=list)


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
    #: layer-wise producer: transfer ids registered early that will not be served (the request
    #: was aborted, or its blocks cannot be handed off), each with the reason: refused, so that
    #: a both-at-once consumer's pull fails at once instead of waiting out its timeout.
    refusals: List[Tuple[int, str]] = field(default_factory=list)
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
    #: tpu-inference's DP scheduler (DP > 1): every item above as a :class:`DpEntry` (the only
    #: field it passes on); the other fields are then empty. See :meth:`to_dp_form`.
    requests_meta: List[DpEntry] = field(default_factory=list)
    #: the workers should send their handshake (:class:`TpuSyncWorkerMetadata.handshake`)
    hello: bool = False

    def to_dp_form(self) -> "TpuSyncMetadata":
        """This step's items as :class:`DpEntry` s in ``requests_meta`` (block ids rank-local),
        for tpu-inference's DP scheduler to merge with the other ranks'."""
        out: List[DpEntry] = []
        for name, attr in _DP_BLOCK_FIELDS.items():
            for op in getattr(self, name):
                out.append(DpEntry(name, op, _dp_ids(op, attr)))
        for name in _DP_PLAIN_FIELDS:
            out.extend(DpEntry(name, x) for x in getattr(self, name))
        out.extend(DpEntry("lookups", (r, h)) for r, h in self.lookups.items())
        if self.idle:
            out.append(DpEntry("idle"))
        if self.hello:
            out.append(DpEntry("hello"))
        return TpuSyncMetadata(requests_meta=out)

    def from_dp_form(self, dp: int) -> "TpuSyncMetadata":
        """The merged step of ``dp`` rank schedulers (:meth:`to_dp_form`, then the DP
        scheduler's merge) as one :class:`TpuSyncMetadata` whose block ids are global; itself
        when ``requests_meta`` is empty. The step is idle only if every rank's is; ``hello`` if
        any rank asked.

        Raises:
            ValueError: an entry of an unknown kind, or block ids of another length than its op's
            or not offset by one rank's offset (:func:`_dp_restore`)."""
        if not self.requests_meta:
            return self
        out = TpuSyncMetadata()
        idle = 0
        for e in self.requests_meta:
            if e.kind in _DP_BLOCK_FIELDS:
                getattr(out, e.kind).append(_dp_restore(e.item, _DP_BLOCK_FIELDS[e.kind], list(e.local_block_ids)))
            elif e.kind in _DP_PLAIN_FIELDS:
                getattr(out, e.kind).append(e.item)
            elif e.kind == "lookups":
                out.lookups[e.item[0]] = e.item[1]
            elif e.kind == "idle":
                idle += 1
            elif e.kind == "hello":
                out.hello = True
            else:
                raise ValueError(f"unknown DP entry kind {e.kind!r}")
        out.idle = idle >= dp
        return out


@dataclass
class TpuSyncWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step.

    Attributes:
        lookup_hits: leading blocks found in the host tier per looked-up request (pinned until
            the request finishes).
        failed_loads: requests whose host-tier load failed (their blocks were reported as load
            errors; vLLM recomputes them, and the scheduler saves them again).
        load_delivered: of ``failed_loads``, the leading blocks each load did deliver (checked;
            the minimum over the ranks; absent: none): a second try of the request loads
            those, not the entry that failed.
        saved_blocks, loaded_blocks: host-tier blocks saved / loaded this step.
        failed_pulls: requests whose pull failed this step (also in ``finished_recving``; their
            blocks reported as load errors): for vLLM releases whose ``KVConnectorOutput`` has
            no ``failed_recving`` (0.29, which vLLM-TorchTPU forks).
        handshakes: the workers' :class:`TpuSyncHandshake` s by TP rank, sent when a scheduler asked
            (``TpuSyncMetadata.hello``): under tpu-inference's DP scheduler no rank's scheduler
            gets vLLM's start-up handshake, but every rank gets the workers' reports.
    """

    lookup_hits: Dict[str, int] = field(default_factory=dict)
    failed_loads: Set[str] = field(default_factory=set)
    load_delivered: Dict[str, int] = field(default_factory=dict)
    saved_blocks: int = 0
    loaded_blocks: int = 0
    failed_pulls: Set[str] = field(default_factory=set)
    handshakes: Dict[int, "TpuSyncHandshake"] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "TpuSyncWorkerMetadata":
        """Combines two workers' reports: a block is usable only if every rank has it (minimum
        of the hits), a load failed if it failed anywhere; counters are per-rank maxima."""
        assert isinstance(other, TpuSyncWorkerMetadata)
        hits = dict(self.lookup_hits)
        for k, v in other.lookup_hits.items():
            hits[k] = min(v, hits.get(k, v))
        # A rank that reported no failure for a request delivered all of it: the minimum is
        # over the ranks that did.
        delivered = dict(self.load_delivered)
        for k, v in other.load_delivered.items():
            delivered[k] = min(v, delivered.get(k, v))
        return TpuSyncWorkerMetadata(
            lookup_hits=hits,
            failed_loads=self.failed_loads | other.failed_loads,
            load_delivered=delivered,
            saved_blocks=max(self.saved_blocks, other.saved_blocks),
            loaded_blocks=max(self.loaded_blocks, other.loaded_blocks),
            failed_pulls=self.failed_pulls | other.failed_pulls,
            handshakes={**self.handshakes, **other.handshakes},
        )

    def is_empty(self) -> bool:
        """Nothing to report."""
        return not (self.lookup_hits or self.failed_loads or self.saved_blocks or self.loaded_blocks or
                    self.failed_pulls or self.handshakes)


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
    #: data-parallel replicas of the caches (tpu-inference's ``data`` axis on the blocks):
    #: ``num_blocks`` counts all of them, ``num_blocks / dp`` per replica
    dp: int = 1
