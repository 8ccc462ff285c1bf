"""The connector's scheduler side: decides per request what to pull, load, save and serve, and
returns the ``kv_transfer_params`` of finished prefill requests. Needs vLLM.

Per request (vLLM calls, in order):

* **P/D consumer** (``kv_transfer_params.do_remote_prefill``): ``get_num_new_matched_tokens``
  answers ``(prompt tokens, True)`` when the producer's params are valid and its KV geometry
  matches (else ``(0, False)``: the request is prefilled locally). After a local prefix-cache
  hit of ``k`` tokens (block-aligned) it answers the producer's tokens past the hit and pulls
  only those, into the request's own blocks from block ``k / block_size`` on (the plan's
  ``first_token``; the hit's blocks, shared with other requests, are never written), in every
  KV cache group of a hybrid model too; a model with Mamba state groups prefills the rest
  locally instead; ``update_state_after_alloc`` plans the pull into the allocated blocks; the
  worker pulls asynchronously and reports the request in ``finished_recving`` (and
  ``failed_recving`` plus the block ids on failure, so vLLM recomputes or fails it per
  ``kv_load_failure_policy``).
  A request whose KV will not be pulled (refused params, a local prefix hit that covers all
  the producer holds, aborted before its pull, or a failed pull) is *rejected* at the
  producer, which frees its staged KV at once instead of keeping it for the lease. Tokens
  count as pulled (``p2p_tokens``, and P2P in
  :meth:`SchedulerSide.get_external_cache_hit_sources`) only for pulls that succeed; tokens
  recomputed after a failed pull are ``p2p_failed_tokens``.
* **P/D producer** (``do_remote_decode``): ``request_finished`` returns ``(True, params)``:
  vLLM keeps the blocks until the worker reports the request in ``finished_sending``, once the
  endpoint has staged them (or the registration failed). With ``early_register`` (the
  default) the request is registered in the step that completes its prefill and staged right
  after that step's forward (the layer-wise machinery below, all layers published at once), so
  it is staged before the producer answers.
* **Models with Mamba state groups**: the producer prefills the prompt less its last token
  (``on_new_request``) and hands off the KV and state slot after ``T - 1`` tokens; the consumer
  answers ``(T - 1, True)`` and vLLM computes token ``T`` from the pulled state. Params whose
  state covers the whole prompt are refused (vLLM would apply the last token twice).
* **Layer-wise** (``layerwise``): a producer registers a ``do_remote_decode`` request in the
  step that completes its prefill (``layer_sends``: the workers stage each layer as vLLM saves
  it) and hands it off in ``request_finished`` under that transfer id (``handoffs`` next step:
  ``finished_sending``); a request that finished with more tokens than registered is withdrawn
  (``withdraws``) and handed off whole, and one aborted or whose blocks cannot be handed off is
  refused (``refusals``: a both-at-once consumer's pull of it fails at once). A
  consumer answers ``(block-aligned prompt tokens short of the last, False)``: the request is
  scheduled at once, its pull starts before the forward (``layer_recvs``) and the forward
  waits for each layer; a failed pull is reported as load errors (vLLM recomputes or fails
  the request per ``kv_load_failure_policy``).
* **Offload** (host tier): a new request's block hashes are looked up in the workers' tiers
  (``get_num_new_matched_tokens`` answers ``None`` for the one step the lookup takes, then the
  hit); hits load synchronously before the forward (``(n, False)``, leaving at least one prompt
  token to compute); every prompt block that becomes full is saved after the step that computed
  it (``async_saves``, the default: the workers queue the D2H and return, and a finished
  request's blocks are freed once its saves are done: ``request_finished`` answers True and
  the workers report it in ``finished_sending``). Hits are reported as ``CacheHitSource.HOST``.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

from ._api import CacheHitSource

from .compat import (NULL_BLOCK_ID, PAIR_KEY, PARAMS_VERSION, KvGeometry, check_pair_params, check_params,
                     dp_scheduler_size, pair_nonce, pair_xfer_id, peers_from_params, prompt_digest)
from .config import ConnectorConfig
from .metadata import (RecvSpec, RejectSpec, SendSpec, TierOp, TpuSyncHandshake, TpuSyncMetadata,
                       TpuSyncWorkerMetadata)

log = logging.getLogger("tpu_sync.vllm")

#: Largest transfer id (the tpu_sync endpoint's request ids are 1 ..= 2**53 - 1).
MAX_XFER_ID = 2**53 - 1


@dataclass
class _OffloadState:
    """Host-tier bookkeeping of one request."""

    request: Any
    #: leading blocks known to be in the tier (saved, loaded or found by lookup)
    in_tier: int = 0
    #: block-aligned local hit when the load was planned
    load_start: int = 0


class SchedulerSide:
    """Scheduler-side state of :class:`~tpu_sync.vllm.connector.TpuSyncConnector`. Not
    thread-safe (vLLM calls it from the scheduler thread only)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig, geometry: KvGeometry) -> None:
        self.cfg = cfg
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.num_blocks = int(kv_cache_config.num_blocks)
        #: tpu-inference's DP scheduler runs this scheduler for one of ``dp`` ranks, over its
        #: ``num_blocks`` rank-local blocks (see :meth:`build_connector_meta`,
        #: :meth:`update_connector_output`)
        self.dp = dp_scheduler_size(vllm_config)
        if self.dp > 1 and cfg.layerwise:
            from .config import ConfigError

            raise ConfigError(f"TpuSyncConnector under tpu-inference's DP scheduler (DP={self.dp}): "
                              "layerwise not supported yet")
        #: DP: this rank's requests (the workers' finished sets name every rank's), and those
        #: whose pull or load the workers will report in finished_recving
        self._dp_own: Set[str] = set()
        self._dp_recv_pending: Set[str] = set()
        #: DP: finished requests whose pull or load is still to be reported
        self._dp_finished: Set[str] = set()
        from ._api import reports_failed_recving

        #: host-tier loads answered as asynchronous, their failures reported by request
        #: (``failed_recving``): under tpu-inference's DP scheduler, and with several KV cache
        #: groups where vLLM reads ``failed_recving`` (vLLM 0.32 refuses block-level load errors
        #: of such a model: a synchronous load's failure could not be reported)
        self.async_loads = self.dp > 1 or (geometry.vllm_groups > 1 and reports_failed_recving())
        #: a consumer's layer-wise P/D pulls are read within the step (synchronous): not with
        #: several KV cache groups where vLLM reads failed_recving, since vLLM 0.32 takes a
        #: failed synchronous load of such a model only as block ids, which it refuses (the
        #: engine would raise): those pulls are whole and asynchronous, reported by request
        self.sync_layerwise = cfg.layerwise and not (geometry.vllm_groups > 1 and reports_failed_recving())
        if cfg.layerwise and cfg.is_consumer and not self.sync_layerwise:
            log.info("tpu_sync: layer-wise P/D pulls of this model (%d KV cache groups) are whole and asynchronous: "
                     "this vLLM refuses block-level load errors of such a model", geometry.vllm_groups)
        #: not DP: requests whose asynchronous host-tier load is pending, and finished requests
        #: whose workers' finished_sending must not reach vLLM (see request_finished)
        self._load_pending: Set[str] = set()
        self._unreported: Set[str] = set()
        self.layout = geometry.tpu_sync_layout(self.num_blocks)
        self.kv_cache_manager: Any = None
        #: vLLM 0.29 (no ``kv_connector_block_state`` in its scheduler output, no cache manager
        #: bound): every scheduled request's block ids per group, kept from the scheduler outputs
        self._req_blocks: Dict[str, List[List[int]]] = {}
        #: P/D endpoint address per TP rank (from the workers' handshake metadata)
        self.peers: Dict[int, str] = {}
        #: the workers' handshake arrived (with or without endpoint addresses)
        self._handshake_seen = False
        # Random start: a restarted producer does not reuse the ids of its predecessor.
        self._next_xfer = 1 + secrets.randbits(48)
        # P/D
        self._sends: List[SendSpec] = []
        self._recvs: Dict[str, RecvSpec] = {}
        self._sending: Dict[str, float] = {}
        self._pd_local_hit_logged: Set[str] = set()
        #: P/D consumer requests with a local prefix hit: the hit's tokens (block-aligned), as
        #: answered by the last get_num_new_matched_tokens (update_state_after_alloc follows it)
        self._pd_first: Dict[str, int] = {}
        #: P/D consumer requests answered with a synchronous layer-wise load (``(m, False)``):
        #: update_state_after_alloc routes them to the layer-wise pulls, every other pull to the
        #: asynchronous ones (whatever its token count)
        self._pd_sync: Set[str] = set()
        self._rejects: List[RejectSpec] = []
        #: tokens of pulls planned or running, counted as pulled once they succeed
        self._pulling: Dict[str, int] = {}
        # Layer-wise P/D
        self._pd_reqs: Dict[str, Any] = {}
        self._early: Dict[str, SendSpec] = {}
        self._layer_sends: List[SendSpec] = []
        self._handoffs: List[str] = []
        self._withdraws: List[int] = []
        self._refusals: List[Tuple[int, str]] = []
        self._layer_recvs: List[RecvSpec] = []
        # Offload
        #: requests with host-tier saves planned (``async_saves``): their blocks are freed once
        #: the workers report the saves done; of them, finished requests whose frees wait
        self._save_planned: Set[str] = set()
        self._save_delayed: Set[str] = set()
        self._off: Dict[str, _OffloadState] = {}
        self._lookup_wanted: Dict[str, List[bytes]] = {}
        self._lookup_sent: Set[str] = set()
        self._hits: Dict[str, int] = {}
        self._loads: List[TierOp] = []
        # Hit source per request (for get_external_cache_hit_sources) and counters.
        self._source: Dict[str, CacheHitSource] = {}
        #: counters: tokens loaded from the host tier / pulled from producers (successful pulls
        #: only) / planned to be pulled but recomputed after a failed pull, host-tier blocks saved
        #: and loaded (as reported by the workers), failed loads, lookups, KV handed off, params
        #: refused, requests rejected at their producers; layer-wise consumer requests pulled
        #: whole instead (a sliding window the producer's blocks do not cover from the first
        #: computed token); P/D prompts a producer of a model with state groups shortened by their
        #: last token; P/D requests a consumer prefilled locally because the sliding window of the
        #: first token vLLM computes after the load starts before the producer's held blocks;
        #: P/D pulls after a local prefix hit (only the tokens past the hit pulled) and the hits'
        #: tokens.
        self.stats: Dict[str, int] = dict(
            host_hit_tokens=0, p2p_tokens=0, p2p_failed_tokens=0, saved_blocks=0, loaded_blocks=0, failed_loads=0,
            lookups=0, handed_off=0, refused_params=0, rejects=0, layerwise_whole=0, state_truncated=0,
            window_local=0, p2p_partial=0, p2p_local_hit_tokens=0,
        )

    # ---- start-up -----------------------------------------------------------------------

    def set_handshake(self, metadata: Dict[int, Any]) -> None:
        """Records each TP rank's endpoint address; checks the workers agree with the scheduler
        on the block format and block count."""
        for rank, meta in metadata.items():
            if not isinstance(meta, TpuSyncHandshake):
                continue
            self._handshake_seen = True
            if meta.block_format != self.geometry.block_format:
                raise RuntimeError(
                    f"TpuSyncConnector: worker {rank} packs blocks as {meta.block_format!r}, the "
                    f"scheduler expected {self.geometry.block_format!r}"
                )
            if meta.num_blocks != self.num_blocks * self.dp:
                log.warning("tpu_sync: worker %s has %s blocks, scheduler %s x %s DP ranks", rank, meta.num_blocks,
                            self.num_blocks, self.dp)
            if meta.address:
                for r in getattr(meta, "tp_ranks", None) or [meta.tp_rank]:
                    self.peers[int(r)] = meta.address

    # ---- admission -----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """Starts host-tier bookkeeping of a request. A producer of a model with state groups
        prefills a ``do_remote_decode`` request's prompt less its last token (see
        :meth:`_truncate_for_state`)."""
        if self.dp > 1:
            self._dp_own.add(request.request_id)
        if self.cfg.offload:
            self._off[request.request_id] = _OffloadState(request)
        params = getattr(request, "kv_transfer_params", None)
        if self.geometry.has_state and self.cfg.is_producer and params and params.get("do_remote_decode"):
            self._truncate_for_state(request, params)
        if ((self.cfg.layerwise or self.cfg.early_register) and self.cfg.is_producer and params
                and params.get("do_remote_decode")):
            self._pd_reqs[request.request_id] = request

    def _truncate_for_state(self, request: Any, params: Dict[str, Any]) -> None:
        """Drops the last prompt token of a P/D request of a model with state groups (as vLLM's
        Mooncake connector does), so the producer hands off the KV and the recurrent state after
        prompt tokens ``[0, T - 1)``: vLLM's consumer computes the last prompt token itself
        (``Scheduler._update_waiting_for_remote_kv`` recomputes it when the connector supplies the
        whole prompt), which must start from the state before that token, and with
        ``mamba_cache_mode="none"`` no earlier state than the latest one exists. The producer's
        one sampled token then follows ``T - 1`` tokens (a P/D proxy discards it). Once per
        request (``tpu_sync_truncated`` in its params); prompts of one token are left whole (the
        consumer then prefills locally)."""
        if params.get("tpu_sync_truncated") or int(request.num_prompt_tokens) <= 1:
            return
        if getattr(request, "prompt_token_ids", None) is None:
            return  # prompt embeddings: not truncated, the consumer prefills locally
        request.prompt_token_ids.pop()
        request._all_token_ids.pop()
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["tpu_sync_truncated"] = True
        self.stats["state_truncated"] += 1

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """Tokens the connector can provide beyond ``num_computed_tokens`` (block-aligned local
        hit), and whether they arrive asynchronously. Side-effect free except for queueing one
        host-tier lookup per request. Host-tier loads are asynchronous too where
        :attr:`async_loads` (a failed load is then reported by request, not by block id)."""
        params = request.kv_transfer_params
        if self.dp > 1:
            self._dp_own.add(request.request_id)
            if (params and params.get("do_remote_decode") and self.cfg.is_producer
                    and len(self.peers) < self.geometry.tp and not self._handshake_seen):
                # No worker addresses yet (they come in the workers' first report, after this
                # rank asked): a request finished now could not be handed off. Ask again next
                # step (the empty step carries the request for the addresses). A handshake
                # without addresses (no P/D endpoint) ends the wait: request_finished then
                # logs that it hands nothing off.
                return None, False
        if params and params.get("do_remote_prefill") and self.cfg.is_consumer:
            self._pd_first.pop(request.request_id, None)
            self._pd_sync.discard(request.request_id)
            if num_computed_tokens > 0 and self.geometry.has_state:
                # A local prefix-cache hit of a model with Mamba state groups: the producer's
                # state slot is the state after its tokens, and a hit's state (vLLM's "align"
                # mode) is indexed by blocks the connector does not map. Compute the rest of the
                # prompt here instead.
                if request.request_id not in self._pd_local_hit_logged:
                    self._pd_local_hit_logged.add(request.request_id)
                    log.info("tpu_sync: request %s hit %d tokens locally (a model with state groups); "
                             "prefilling the rest locally", request.request_id, num_computed_tokens)
                return 0, False
            n = self._remote_tokens(request, params)
            # After a local prefix-cache hit of k tokens (block-aligned, in every KV cache
            # group) only the producer's tokens from k on are pulled, into this request's own
            # blocks (the plan covers that token range, in every group; the hit's blocks, shared
            # with other requests, are never written).
            k = int(num_computed_tokens)
            if n is None or n <= k:
                return 0, False  # unusable params, or a hit that covers all the producer has
            last = min(n, int(request.num_tokens) - 1)  # the token vLLM computes after the load
            if self._sync_layerwise(params):
                # A synchronous load read layer by layer by this step's forward; vLLM computes
                # at least the last prompt token (block-aligned, as host-tier hits).
                m = (last // self.block_size) * self.block_size
                if m <= k:
                    return 0, False
                if self._layerwise_covers(m, n, k):
                    self._pd_first[request.request_id] = k
                    self._pd_sync.add(request.request_id)
                    return m - k, False
                # The forward from token m reads a sliding window's block the producer does not
                # hold: pull the rest whole instead (asynchronously).
                self.stats["layerwise_whole"] += 1
            if not self._layerwise_covers(last, n, k):
                # vLLM computes token min(n, T - 1) after a load of n tokens (the last prompt
                # token again after a whole-prompt load), whose sliding window starts one block
                # before the producer's held blocks of n tokens (vLLM's producer freed that block
                # before request_finished; a consumer told of n tokens gets its null block
                # there) and after the hit: no load from this producer computes it right, so
                # prefill it locally (the producer is told: reject).
                if request.request_id not in self._pd_local_hit_logged:
                    self._pd_local_hit_logged.add(request.request_id)
                    self.stats["window_local"] += 1
                    log.info("tpu_sync: request %s: the window of the recomputed token %d starts before the "
                             "producer's blocks of %d tokens (and after a local hit of %d); prefilling locally",
                             request.request_id, last, n, k)
                return 0, False
            self._pd_first[request.request_id] = k
            return n - k, True
        st = self._off.get(request.request_id)
        if st is None or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        bs = self.block_size
        # Look up every full prompt block (those found need no save), but load at most up to the
        # last block that leaves one prompt token to compute: vLLM samples from its logits.
        prompt_blocks = min(len(request.block_hashes), request.num_prompt_tokens // bs)
        max_blocks = min(prompt_blocks, (request.num_tokens - 1) // bs)
        start = num_computed_tokens // bs
        if max_blocks <= start:
            return 0, False
        hits = self._hits.get(request.request_id)
        if hits is None:
            if request.request_id not in self._lookup_sent:
                self._lookup_wanted[request.request_id] = [bytes(h) for h in request.block_hashes[:prompt_blocks]]
            return None, False
        st.in_tier = max(st.in_tier, hits)
        n = min(hits, max_blocks)
        if n <= start:
            return 0, False
        st.load_start = start
        return (n - start) * bs, self.async_loads

    def _sync_layerwise(self, params: Dict[str, Any]) -> bool:
        """Whether a P/D request is loaded layer by layer within the step that computes it (a
        synchronous answer): ``layerwise``, and the producer's blocks are named in ``params``.
        A both-at-once request (pair nonce) or a producer whose params describe instead
        (``remote_describe``: tpu-inference's DP scheduler) is pulled whole, asynchronously:
        its placement is known only once the producer answers."""
        return bool(self.sync_layerwise and not pair_nonce(params) and not params.get("remote_describe"))

    def _layerwise_covers(self, m: int, n: int, first: int = 0) -> bool:
        """Whether a consumer that has the KV of tokens ``[0, m)`` pulled from a producer's
        held blocks of ``n`` tokens (:meth:`KvGeometry.held_blocks`) may compute tokens from
        ``m`` on: every group's blocks that computing token ``m`` reads (its held blocks of
        ``m`` tokens: a sliding window ``w`` reads tokens ``[m + 1 - w, m)``) are among the
        producer's, or before ``first`` (a local prefix hit of ``first`` tokens, whose blocks
        vLLM's hybrid manager keeps for the window of every later token). Always true without
        KV cache groups or sliding windows."""
        g = self.geometry
        return all(g.held_blocks(i, m, first)[0] >= g.held_blocks(i, n)[0] for i in range(g.num_groups))

    def _remote_tokens(self, request: Any, params: Dict[str, Any]) -> Optional[int]:
        """Tokens the producer's params offer for this request, or None when they are unusable
        (logged; the request is then prefilled locally)."""
        if pair_nonce(params) is not None and not params.get("remote_block_ids"):
            return self._pair_tokens(request, params)
        why = check_params(params)
        if why is None:
            why = self.geometry.mismatch(params["remote_geometry"])
            if why:
                why = "KV geometry differs: " + why
        n = int(params.get("remote_num_tokens") or 0)
        prompt = list(request.prompt_token_ids or [])
        if why is None and n > len(prompt):
            why = f"producer has {n} tokens, the prompt {len(prompt)}"
        if why is None and self.geometry.has_state and n >= len(prompt):
            # vLLM recomputes the last prompt token of a request whose whole prompt was loaded;
            # a state taken after it would see that token twice.
            why = (f"the producer's state covers all {len(prompt)} prompt tokens; a model with state groups "
                   f"needs the state before the last one (a producer of this connector prefills T - 1)")
        if why is None and params.get("remote_prompt_digest") != prompt_digest(prompt[:n]):
            why = "the producer's prompt tokens differ from this request's"
        if why is not None:
            self.stats["refused_params"] += 1
            log.warning("tpu_sync: request %s: not pulling KV (%s); prefilling locally", request.request_id, why)
            return None
        return n

    def _pair_tokens(self, request: Any, params: Dict[str, Any]) -> Optional[int]:
        """A both-at-once request (the router sent the prompt to the producer and here at once,
        :func:`~tpu_sync.vllm.compat.pair_params`): the producer prefills the whole prompt (the
        prompt less its last token for a model with state groups) and registers it under the id
        both sides derive from the router's nonce and those tokens, so this side knows the
        transfer id and token count before the producer allocated its blocks; the workers ask
        the producer for its placement (blocks) and pull as soon as it registered. Writes the
        id and token count into ``params`` (for the pull and for rejects). None when the params
        are unusable (logged)."""
        why = check_pair_params(params)
        if why is None:
            why = self.geometry.mismatch(params["remote_geometry"])
            if why:
                why = "KV geometry differs: " + why
        if why is None and self.geometry.groups:
            why = "both-at-once transfers of models with KV cache groups are not supported"
        prompt = list(request.prompt_token_ids or [])
        n = len(prompt) - 1 if self.geometry.has_state else len(prompt)
        if why is None and n <= 0:
            why = "no prompt tokens to pull"
        if why is not None:
            if request.request_id not in self._pd_local_hit_logged:
                self._pd_local_hit_logged.add(request.request_id)
                self.stats["refused_params"] += 1
                log.warning("tpu_sync: request %s: not pulling KV (%s); prefilling locally", request.request_id, why)
            return None
        params["remote_request_id"] = pair_xfer_id(str(pair_nonce(params)), prompt_digest(prompt[:n]))
        params["remote_num_tokens"] = n
        return n

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plans the pull or load into the blocks vLLM allocated."""
        req_id = request.request_id
        params = request.kv_transfer_params
        is_pd = bool(params and params.get("do_remote_prefill") and self.cfg.is_consumer)
        if num_external_tokens <= 0:
            if is_pd:
                params["do_remote_prefill"] = False  # one transfer per request
                # Prefilled locally (refused params or a local prefix hit): the producer's KV
                # will never be pulled.
                self._reject(req_id, params, "the decode instance prefills it locally")
            return
        bs = self.block_size
        all_ids = blocks.get_block_ids()
        block_ids = list(all_ids[0])
        if is_pd:
            params["do_remote_prefill"] = False
            n = int(params["remote_num_tokens"])
            nb = -(-n // bs)
            # A local prefix hit of `first` tokens: its blocks are this request's first ones
            # (shared, already computed); the pull fills blocks first // bs .. nb only.
            first = self._pd_first.pop(req_id, 0)
            dst_ids: Any = block_ids[first // bs:nb]
            src_ids: Any
            if not params.get("remote_block_ids"):
                src_ids = None  # both-at-once: the workers ask the producer for its blocks
            else:
                src_ids = ([[int(b) for b in g] for g in params["remote_block_ids"]] if self.geometry.groups
                           else [int(b) for b in params["remote_block_ids"]])
            next_token = None
            if self.geometry.groups:
                # One block table per KV cache group: each group's held blocks, of the windows
                # of the first token vLLM computes after the load (the last prompt token again
                # after a whole-prompt load; a layer-wise load's first unloaded token).
                next_token = min(first + num_external_tokens, int(request.num_tokens) - 1)
                if next_token >= n:
                    next_token = None  # the default (a peer from before next_token takes that)
                try:
                    dst_ids = self.geometry.group_held_ids(all_ids, n, first, next_token)
                except ValueError as e:
                    # vLLM waits for this request's load: make it a pull that fails at once (no
                    # source blocks), so its blocks are load errors (recomputed or failed per
                    # kv_load_failure_policy), nothing is written, and the producer is told.
                    log.error("tpu_sync: request %s: not pulling KV: %s", req_id, e)
                    # Never the hit's blocks (shared with other requests): only this request's
                    # own become load errors.
                    dst_ids = [[int(b) for b in g[first // bs:]] for g in all_ids]
                    src_ids = []
            spec = RecvSpec(
                req_id=req_id,
                xfer_id=int(params["remote_request_id"]),
                peers=peers_from_params(params),
                src_layout=_remote_layout(params),
                src_block_ids=src_ids,
                dst_block_ids=dst_ids,
                num_tokens=n,
                timeout_s=self.cfg.pull_timeout_s,
                first_token=first,
                next_token=next_token,
            )
            if first:
                self.stats["p2p_partial"] += 1
                self.stats["p2p_local_hit_tokens"] += first
            self._source[req_id] = CacheHitSource.P2P
            sync = req_id in self._pd_sync
            self._pd_sync.discard(req_id)
            if self.cfg.layerwise and sync and src_ids is not None:
                # Pulled and read within the next step (failures come back as load errors).
                self._layer_recvs.append(spec)
                self.stats["p2p_tokens"] += num_external_tokens
                return
            self._recvs[req_id] = spec
            self._pulling[req_id] = num_external_tokens
            return
        st = self._off.get(req_id)
        if st is None:
            return
        start = st.load_start
        n = num_external_tokens // bs
        hashes = [bytes(h) for h in st.request.block_hashes[start:start + n]]
        op = TierOp(req_id, hashes, block_ids[start:start + n], report=self.async_loads)
        if self.geometry.groups:
            # Per group; a sliding-window group's blocks before its window are vLLM's null
            # block (id 0): the worker does not write them.
            op.group_block_ids = [[int(b) for b in ids[start:start + n]] for ids in all_ids]
        self._loads.append(op)
        st.in_tier = max(st.in_tier, start + n)
        self._source[req_id] = CacheHitSource.HOST
        self.stats["host_hit_tokens"] += num_external_tokens

    def _reject(self, req_id: str, params: Dict[str, Any], reason: str) -> None:
        """Queues a reject of the producer's transfer named by ``params`` (if it names one)."""
        try:
            xfer = int(params["remote_request_id"])
            peers = peers_from_params(params)
        except (KeyError, TypeError, ValueError, AttributeError):
            return  # no usable transfer to reject
        if not 1 <= xfer < 2**53 or not peers:
            return
        self._rejects.append(RejectSpec(req_id, xfer, peers, f"request {req_id}: {reason}"))
        self.stats["rejects"] += 1

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Dict[CacheHitSource, int]:
        """All of a request's external tokens come from one source: HOST (the host tier) or P2P
        (a prefill instance). vLLM asks at admission, before the transfer; a request whose pull
        failed is never attributed to P2P again (its retry's tokens come from wherever the retry
        finds them)."""
        if num_external_tokens <= 0:
            return {}
        return {self._source.get(request.request_id, CacheHitSource.EXTERNAL_UNSPECIFIED): num_external_tokens}

    # ---- per step ------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> TpuSyncMetadata:
        """This step's work for the workers: lookups, loads, pulls, registrations, and saves of
        prompt blocks that this step fills."""
        meta = TpuSyncMetadata(
            lookups=self._lookup_wanted,
            loads=self._loads,
            sends=self._sends,
            recvs=list(self._recvs.values()),
            rejects=self._rejects,
            handoffs=self._handoffs,
            withdraws=self._withdraws,
            refusals=self._refusals,
            layer_recvs=self._layer_recvs,
        )
        self._handoffs, self._withdraws, self._refusals, self._layer_recvs = [], [], [], []
        self._track_blocks(scheduler_output)
        meta.idle = not int(getattr(scheduler_output, "total_num_scheduled_tokens", 1) or 0)
        if self._pd_reqs:
            meta.layer_sends = self._plan_layer_sends(scheduler_output)
        self._lookup_sent.update(self._lookup_wanted)
        self.stats["lookups"] += len(self._lookup_wanted)
        self._lookup_wanted, self._loads, self._sends, self._recvs, self._rejects = {}, [], [], {}, []
        if self.cfg.offload:
            meta.saves = self._plan_saves(scheduler_output)
            if self.cfg.async_saves:
                self._save_planned.update(op.req_id for op in meta.saves)
                meta.preempted = [r for r in (getattr(scheduler_output, "preempted_req_ids", None) or ())
                                  if r in self._save_planned]
        if self.dp == 1:
            self._load_pending.update(op.req_id for op in meta.loads if op.report)
        if self.dp > 1:
            # tpu-inference's DP scheduler passes on only requests_meta (block ids offset to the
            # global ones) and never hands this rank's scheduler the workers' handshake: ask
            # the workers for it in their report.
            self._dp_recv_pending.update(r.req_id for r in meta.recvs)
            self._dp_recv_pending.update(op.req_id for op in meta.loads if op.report)
            meta.hello = self.cfg.pd and len(self.peers) < self.geometry.tp
            return meta.to_dp_form()
        return meta

    def _plan_layer_sends(self, scheduler_output: Any) -> List[SendSpec]:
        """Layer-wise producer: registrations of requests whose prefill completes this step."""
        out: List[SendSpec] = []
        if len(self.peers) < self.geometry.tp:
            return out  # no endpoint addresses: request_finished hands nothing off either
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            req = self._pd_reqs.get(req_id)
            if req is None or req_id in self._early:
                continue
            n = int(req.num_prompt_tokens)
            # num_computed_tokens is advanced only after build_connector_meta.
            if int(req.num_computed_tokens) + int(n_sched) < n:
                continue
            nb = -(-n // self.block_size)
            send_ids: Any
            if self.geometry.groups:
                # Each KV cache group's held blocks of the whole prompt (the blocks vLLM holds
                # while this step's forward computes it).
                all_ids = self._block_ids(scheduler_output, req_id, all_groups=True)
                try:
                    send_ids = None if all_ids is None else self.geometry.group_held_ids(all_ids, n)
                except ValueError as e:
                    log.error("tpu_sync: request %s: not registering KV layer by layer: %s", req_id, e)
                    send_ids = None
                if send_ids is None:
                    continue
            else:
                ids = self._block_ids(scheduler_output, req_id)
                if ids is None or len(ids) < nb:
                    continue
                send_ids = [int(b) for b in ids[:nb]]
            xfer_id = self._new_xfer(req, n)
            spec = SendSpec(req_id, xfer_id, send_ids, n, self.cfg.lease_s, self._decode_tp(req.kv_transfer_params))
            self._early[req_id] = spec
            out.append(spec)
        return out

    def _new_xfer(self, request: Any, n: int) -> int:
        """The transfer id to register a producer's request under: derived from the router's
        nonce and the prompt's first ``n`` tokens for a both-at-once request
        (:func:`~tpu_sync.vllm.compat.pair_xfer_id`; its consumer pulls that id), else the next
        of this scheduler's ids."""
        nonce = pair_nonce(getattr(request, "kv_transfer_params", None))
        if nonce is not None:
            return pair_xfer_id(nonce, prompt_digest(list(request.prompt_token_ids or [])[:n]))
        xfer_id = self._next_xfer
        self._next_xfer = self._next_xfer % MAX_XFER_ID + 1
        return xfer_id

    def _decode_tp(self, params: Dict[str, Any]) -> int:
        try:
            return max(1, int(params.get("decode_tp_size") or self.cfg.decode_tp_size))
        except (TypeError, ValueError):
            return self.cfg.decode_tp_size

    def _plan_saves(self, scheduler_output: Any) -> List[TierOp]:
        bs = self.block_size
        saves: List[TierOp] = []
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._off.get(req_id)
            if st is None:
                continue
            req = st.request
            # num_computed_tokens is advanced only after build_connector_meta.
            done = min(req.num_computed_tokens + n_sched, req.num_prompt_tokens)
            full = min(done // bs, len(req.block_hashes))
            if full <= st.in_tier:
                continue
            all_ids = self._block_ids(scheduler_output, req_id, all_groups=True)
            if all_ids is None or any(len(ids) < full for ids in all_ids):
                continue
            ids = list(all_ids[0])
            group_ids = None
            if self.geometry.groups:
                # A tier entry holds the block of every group: save up to the first block that
                # some group no longer holds (a sliding window's null block).
                good = st.in_tier
                while good < full and all(int(g[good]) != NULL_BLOCK_ID for g in all_ids):
                    good += 1
                if good <= st.in_tier:
                    continue
                full = good
                group_ids = [[int(b) for b in g[st.in_tier:full]] for g in all_ids]
            parent = bytes(req.block_hashes[st.in_tier - 1]) if st.in_tier else None
            saves.append(TierOp(req_id, [bytes(h) for h in req.block_hashes[st.in_tier:full]], ids[st.in_tier:full],
                                parent, group_ids))
            st.in_tier = full
        return saves

    def _track_blocks(self, so: Any) -> None:
        """Keeps the block ids of the scheduled requests from ``so`` where vLLM offers no way to
        read every running request's (0.29: its ``kv_connector_block_state`` lists only the
        requests that got blocks this step, in full; else a new request's ``block_ids``, a
        running one's ``new_block_ids`` appended, a resumed one's replacing them); forgotten once
        finished or preempted."""
        state = getattr(so, "kv_connector_block_state", None)
        if (state is not None and hasattr(state, "resolve_block_ids")) or self.kv_cache_manager is not None:
            return
        snapshot = getattr(state, "block_ids", None) if state is not None else None
        if snapshot is not None:
            for req_id, ids in snapshot.items():
                self._req_blocks[req_id] = [[int(b) for b in g] for g in ids]
        else:
            for r in getattr(so, "scheduled_new_reqs", None) or ():
                self._req_blocks[r.req_id] = [[int(b) for b in g] for g in r.block_ids]
            cached = getattr(so, "scheduled_cached_reqs", None)
            resumed = set(getattr(cached, "resumed_req_ids", None) or ())
            for req_id, new in zip(getattr(cached, "req_ids", ()), getattr(cached, "new_block_ids", ())):
                if new is None:
                    continue
                cur = self._req_blocks.get(req_id)
                if req_id in resumed or cur is None or len(cur) != len(new):
                    self._req_blocks[req_id] = [[int(b) for b in g] for g in new]
                else:
                    for g, ids in enumerate(new):
                        cur[g].extend(int(b) for b in ids)
        for req_id in list(getattr(so, "finished_req_ids", None) or ()) + list(
                getattr(so, "preempted_req_ids", None) or ()):
            self._req_blocks.pop(req_id, None)

    def _block_ids(self, scheduler_output: Any, req_id: str, all_groups: bool = False) -> Any:
        """The request's block ids of group 0 (or, with ``all_groups``, the tuple of every
        group's), or None when the request is gone."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        try:
            ids = None
            if state is not None and hasattr(state, "resolve_block_ids"):
                ids = state.resolve_block_ids(req_id)
            elif self.kv_cache_manager is not None:
                ids = self.kv_cache_manager.get_block_ids(req_id)
            else:
                ids = self._req_blocks.get(req_id)
            if ids is not None:
                return [list(g) for g in ids] if all_groups else list(ids[0])
        except Exception as e:  # request gone (aborted) between schedule and here
            log.debug("tpu_sync: no block ids for %s: %s", req_id, e)
        return None

    def update_connector_output(self, output: Any) -> None:
        """Takes the workers' lookup answers and failed loads; forgets finished sends. Under
        tpu-inference's DP scheduler every rank's scheduler gets the whole ``output`` (its own
        copy): the finished sets are cut to this rank's requests here, before vLLM's scheduler
        reads them (it asserts it knows every request named there; it reads ``failed_recving``
        earlier, by ``requests.get``, which skips other ranks' ids), and a handshake in the
        report gives this rank the workers' addresses."""
        meta = output.kv_connector_worker_meta
        if self.dp > 1:
            self._dp_filter(output)
        if isinstance(meta, TpuSyncWorkerMetadata) and meta.handshakes:
            self.set_handshake(meta.handshakes)
        if isinstance(meta, TpuSyncWorkerMetadata):
            for req_id, hits in meta.lookup_hits.items():
                if req_id in self._lookup_sent:
                    self._lookup_sent.discard(req_id)
                    self._hits[req_id] = int(hits)
            for req_id in meta.failed_loads:
                st = self._off.get(req_id)
                if st is not None:
                    # The blocks the load delivered (checked) are in the tier; vLLM recomputes
                    # from the first bad block (or, an asynchronous load, all of them): save the
                    # recomputed blocks again.
                    good = st.load_start + int(meta.load_delivered.get(req_id, 0))
                    st.in_tier = min(st.in_tier, good)
                    # Never the same load again: vLLM asks once more for a request whose
                    # asynchronous load failed (with kv_load_failure_policy "recompute" it
                    # returns to the waiting queue), and an unreadable entry would fail every
                    # time; the blocks before it load again (a peer that evicted blocks since
                    # the lookup delivers a shorter prefix: that prefix is a hit).
                    if req_id in self._hits:
                        self._hits[req_id] = min(self._hits[req_id], good)
                    self.stats["failed_loads"] += 1  # this rank's requests only (DP: every rank reads all)
            # The engine's totals (under DP every rank reads the same report).
            self.stats["saved_blocks"] += meta.saved_blocks
            self.stats["loaded_blocks"] += meta.loaded_blocks
        if self._unreported and output.finished_sending:
            # Requests vLLM freed when their load was reported (request_finished): the workers'
            # one report of their saves must not reach vLLM, which asserts it knows each.
            gone = output.finished_sending & self._unreported
            self._unreported -= gone
            output.finished_sending = output.finished_sending - gone
        for req_id in output.finished_sending or ():
            self._sending.pop(req_id, None)
            self._save_delayed.discard(req_id)
        self._load_pending.difference_update(output.finished_recving or ())
        failed = set(getattr(output, "failed_recving", None) or ())
        if isinstance(meta, TpuSyncWorkerMetadata):
            failed |= meta.failed_pulls  # vLLM 0.29's output has no failed_recving
        for req_id in output.finished_recving or ():
            n = self._pulling.pop(req_id, None)
            if n is None:
                continue  # not a pull (or aborted: not counted)
            if req_id in failed:
                # Recomputed (or failed) by vLLM: not pulled. Never attribute it to P2P again.
                self.stats["p2p_failed_tokens"] += n
                self._source.pop(req_id, None)
            else:
                self.stats["p2p_tokens"] += n

    def _dp_filter(self, output: Any) -> None:
        """DP: keeps only this rank's requests in ``output``'s finished (and failed) sets, and
        forgets requests whose last report this is."""
        own = self._dp_own
        for name in ("finished_sending", "finished_recving", "failed_recving"):
            ids = getattr(output, name, None)
            if ids:
                setattr(output, name, {r for r in ids if r in own})
        if output.finished_sending:
            # A request vLLM frees when its load or pull is reported (see request_finished):
            # the workers' report of its (finished) saves must not reach vLLM.
            output.finished_sending = {r for r in output.finished_sending if r not in self._dp_finished}
        for req_id in output.finished_recving or ():
            self._dp_recv_pending.discard(req_id)
        for req_id in output.finished_sending or ():
            own.discard(req_id)  # sent after request_finished: vLLM frees the request now
        for req_id in output.finished_recving or ():
            if req_id in self._dp_finished:
                own.discard(req_id)
                self._dp_finished.discard(req_id)

    # ---- completion ----------------------------------------------------------------------

    def request_finished_all_groups(self, request: Any,
                                    block_ids: Any) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """vLLM's hybrid-allocator form of :meth:`request_finished` (``SupportsHMA``):
        ``block_ids`` holds one list per KV cache group. A uniform model's one list goes to
        :meth:`request_finished` unchanged.

        Raises:
            ValueError: a group count other than the KV cache config's."""
        if len(block_ids) != self.geometry.num_groups:
            raise ValueError(f"TpuSyncConnector: {len(block_ids)} lists of block ids for "
                             f"{self.geometry.num_groups} KV cache groups")
        if not self.geometry.groups:
            return self.request_finished(request, list(block_ids[0]))
        return self.request_finished(request, [list(g) for g in block_ids], grouped=True)

    def request_finished(self, request: Any, block_ids: List[Any],
                         grouped: bool = False) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Producer: keeps a prefilled request's blocks and returns the params a decode instance
        pulls with. Offload with ``async_saves``: keeps the blocks of a request with host-tier
        saves until the workers report them done (in ``finished_sending``, with its P/D
        registration if it has one). Everyone: drops the request's state. ``grouped``:
        ``block_ids`` holds one list per KV cache group (see
        :meth:`request_finished_all_groups`)."""
        delay, params = self._request_finished(request, block_ids, grouped)
        req_id = request.request_id
        if self.dp > 1 and req_id in self._dp_recv_pending:
            # Finished while waiting for its load or pull: vLLM frees it when that is reported
            # (finished_recving) and then no longer knows it, so no finished_sending may name
            # it (_dp_filter drops the workers'). Its saves are done: it was readmitted after a
            # preemption, whose step waited for them (handle_preemptions).
            self._save_planned.discard(req_id)
            self._dp_finished.add(req_id)
            return delay, params
        if req_id in self._load_pending:
            # Finished while its asynchronous host-tier load is pending (not DP): vLLM holds its
            # blocks until that load is reported (finished_recving) and frees it then. Its saves
            # are done (it was readmitted after a preemption, whose step waited for them:
            # handle_preemptions), so its blocks are not kept for them, and the workers' report
            # of them is dropped (update_connector_output).
            self._load_pending.discard(req_id)
            if req_id in self._save_planned:
                self._save_planned.discard(req_id)
                self._unreported.add(req_id)
            return delay, params
        if req_id in self._save_planned:
            self._save_planned.discard(req_id)
            self._save_delayed.add(req_id)
            delay = True
        if self.dp > 1 and not delay:
            self._dp_own.discard(req_id)
        return delay, params

    def _request_finished(self, request: Any, block_ids: List[Any],
                          grouped: bool) -> Tuple[bool, Optional[Dict[str, Any]]]:
        req_id = request.request_id
        params = request.kv_transfer_params
        if params and self.cfg.is_consumer:
            if params.get("do_remote_prefill"):
                # Finished (aborted) before admission: its KV was never pulled.
                self._reject(req_id, params, "aborted before its KV was pulled")
            elif req_id in self._recvs:
                # Admitted, but aborted before the workers started the pull.
                self._reject(req_id, params, "aborted before its pull started")
        for d in (self._off, self._hits, self._lookup_wanted, self._recvs, self._source, self._pulling,
                  self._pd_reqs, self._pd_first):
            d.pop(req_id, None)
        early = self._early.pop(req_id, None)
        self._lookup_sent.discard(req_id)
        self._pd_local_hit_logged.discard(req_id)
        self._pd_sync.discard(req_id)
        if not (params and params.get("do_remote_decode") and self.cfg.is_producer):
            if early is not None:
                self._withdraws.append(early.xfer_id)
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            if early is not None:  # a both-at-once consumer's pull fails at once
                self._refusals.append((early.xfer_id, f"request {req_id} was aborted on the producer"))
            return False, None  # aborted: nothing to hand off
        n = int(request.num_computed_tokens)
        nb = -(-n // self.block_size)
        if grouped:
            if len(self.peers) < self.geometry.tp:
                log.error("tpu_sync: request %s: no P/D endpoint address from the workers; not handing off KV",
                          req_id)
                return False, None
            try:
                held = self.geometry.group_held_ids(block_ids, n) if n > 0 else None
            except ValueError as e:
                log.error("tpu_sync: request %s: not handing off KV: %s", req_id, e)
                held = None
            if held is None:
                if early is not None:
                    self._refusals.append((early.xfer_id,
                                           f"the producer cannot hand off the blocks of request {req_id}"))
                return False, None
            if early is not None:
                if early.num_tokens == n and early.block_ids == held:
                    # Registered layer by layer during the prefill: hand that registration off.
                    self._handoffs.append(req_id)
                    self._sending[req_id] = time.monotonic() + self.cfg.lease_s
                    self.stats["handed_off"] += 1
                    return True, self._params(request, early.xfer_id, held, n)
                self._withdraws.append(early.xfer_id)  # more tokens than registered: whole request
            xfer_id = self._new_xfer(request, n)
            self._sends.append(SendSpec(req_id, xfer_id, held, n, self.cfg.lease_s, self._decode_tp(params)))
            self._sending[req_id] = time.monotonic() + self.cfg.lease_s
            self.stats["handed_off"] += 1
            return True, self._params(request, xfer_id, held, n)
        if n <= 0 or len(block_ids) < nb:
            if early is not None:
                self._refusals.append((early.xfer_id, f"the producer cannot hand off the blocks of request {req_id}"))
            return False, None
        if early is not None:
            if early.num_tokens == n and early.block_ids == [int(b) for b in block_ids[:nb]]:
                # Registered layer by layer during the prefill: hand that registration off.
                self._handoffs.append(req_id)
                self._sending[req_id] = time.monotonic() + self.cfg.lease_s
                self.stats["handed_off"] += 1
                return True, self._params(request, early.xfer_id, early.block_ids, n)
            self._withdraws.append(early.xfer_id)  # more tokens than registered: whole request
        if len(self.peers) < self.geometry.tp:
            log.error("tpu_sync: request %s: no P/D endpoint address from the workers; not handing off KV", req_id)
            return False, None
        ids = [int(b) for b in block_ids[:nb]]
        xfer_id = self._new_xfer(request, n)
        decode_tp = self._decode_tp(params)
        self._sends.append(SendSpec(req_id, xfer_id, ids, n, self.cfg.lease_s, decode_tp))
        self._sending[req_id] = time.monotonic() + self.cfg.lease_s
        self.stats["handed_off"] += 1
        return True, self._params(request, xfer_id, ids, n)

    def pair_template(self) -> Optional[Dict[str, Any]]:
        """What this producer's ``kv_transfer_params`` hold for every request: its version,
        engine id, endpoint addresses, block count, geometry and TP size. A router that sends
        a prompt to a producer and a consumer at once gives the consumer
        :func:`~tpu_sync.vllm.compat.pair_params` of these (every producer answer's params also
        hold them). None until the workers' addresses are known."""
        if len(self.peers) < self.geometry.tp:
            return None
        return dict(
            tpu_sync_version=PARAMS_VERSION,
            remote_engine_id=self.engine_id,
            remote_addresses={str(r): a for r, a in sorted(self.peers.items())},
            remote_num_blocks=self.num_blocks,
            remote_geometry=self.geometry.to_dict(),
            tp_size=self.geometry.tp,
        )

    def _params(self, request: Any, xfer_id: int, ids: List[int], n: int) -> Dict[str, Any]:
        """The ``kv_transfer_params`` a decode instance pulls transfer ``xfer_id`` with."""
        prompt = list(request.prompt_token_ids or [])
        d = dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            tpu_sync_version=PARAMS_VERSION,
            remote_engine_id=self.engine_id,
            remote_request_id=xfer_id,
            remote_addresses={str(r): a for r, a in sorted(self.peers.items())},
            remote_block_ids=ids,
            remote_num_tokens=n,
            remote_num_blocks=self.num_blocks,
            remote_geometry=self.geometry.to_dict(),
            remote_prompt_digest=prompt_digest(prompt[:n]),
            tp_size=self.geometry.tp,
        )
        if self.dp > 1:
            # This rank's block ids are local to its share of the caches (tpu-inference's DP
            # scheduler offsets them only inside the workers' metadata): the consumer asks this
            # producer's endpoint for the placement it registered, as a both-at-once one does.
            del d["remote_block_ids"]
            d["remote_describe"] = True
        nonce = pair_nonce(request.kv_transfer_params)
        if nonce is not None:
            d[PAIR_KEY] = nonce  # the router can check which request it answers
        return d

    def pending_sends(self) -> int:
        """Finished requests whose blocks are still held for pullers."""
        return len(self._sending)

    def pending_frees(self) -> int:
        """Finished requests whose blocks are still held: for pullers, or for host-tier saves
        (``async_saves``)."""
        return len(self._sending.keys() | self._save_delayed)


def _remote_layout(params: Dict[str, Any]) -> Dict[str, Any]:
    g = params["remote_geometry"]
    geom = KvGeometry(**{k: g[k] for k in KvGeometry.__dataclass_fields__ if k in g})
    return geom.tpu_sync_layout(int(params["remote_num_blocks"]))
