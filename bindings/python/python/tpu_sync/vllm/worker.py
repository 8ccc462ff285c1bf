"""The connector's worker side: moves KV between vLLM's per-layer tensors and the host tier or
other engines, as the scheduler side's :class:`~tpu_sync.vllm.metadata.TpuSyncMetadata` says.
Needs vLLM and torch.

Hooks (vLLM's order within a step): ``start_load_kv`` (before the forward when the step has
synchronous loads, else after it) runs host-tier lookups, host-tier loads, registrations of
finished prefill requests, starts pulls (which wait, up to the pull timeout, for a producer that
has not registered the request yet) and queues rejects (sent by a background thread, so a dead
producer never stalls the model runner); ``wait_for_save`` (after the forward) saves the prompt
blocks the step filled; ``get_transfer_results`` reports registrations done, pulls finished or
failed; ``get_block_ids_with_load_errors`` the blocks a load or pull did not deliver;
``build_connector_worker_meta`` the lookup answers. Without ``layerwise`` the per-layer hooks
are no-ops: loads complete before the forward and saves run after it, whole blocks at a time.

With ``layerwise`` (see :mod:`tpu_sync.vllm.config`): ``start_load_kv`` also registers the
requests whose prefill completes this step (nothing staged yet), starts this step's
layer-wise pulls, and starts host-tier loads on a background thread; ``save_kv_layer(layer)``
stages and publishes that layer of the registered requests; ``wait_for_layer_load(layer)``
waits until that layer of every pull and load of the step is in the KV tensors;
``wait_for_save`` publishes any layer not saved through the hook and ends the step's pulls and
loads (failures become load errors).
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from tpu_sync.torch_kv import rows_contiguous

from . import compat
from ._api import reports_failed_recving
from .backends import KvCaches, make_host_tier, make_pd_transport
from .compat import NULL_BLOCK_ID, KvGeometry
from .config import ConnectorConfig
from .metadata import RecvSpec, RejectSpec, TpuSyncHandshake, TpuSyncMetadata, TpuSyncWorkerMetadata

log = logging.getLogger("tpu_sync.vllm")

#: How long a consumer retries a pull that the producer does not know yet (the producer
#: registers the request one engine step after it finished).
UNKNOWN_REQUEST_RETRY_S = 0.05
#: Longest wait for queued host-tier saves (a preempted request's, a lookup's, shutdown).
SAVE_WAIT_S = 60.0


@dataclass
class _LayerLoad:
    """Host-tier loads of one step, read from the tier on a background thread and written into
    the KV tensors layer by layer (``ready[l]`` set once layer ``l`` of every block is in)."""

    ops: List[Any]
    ready: List[threading.Event]
    thread: Optional[threading.Thread] = None
    #: blocks delivered per op (set by the thread before any layer is written)
    delivered: Optional[List[int]] = None
    error: Optional[BaseException] = None


@dataclass
class _Pull:
    spec: RecvSpec
    deadline: float
    handle: Any = None
    next_try: float = 0.0
    #: a JAX runner's shard addresses when the pull started (a forward must not move them)
    ptrs: Any = None


def _save(tier: Any, op: Any) -> int:
    """Saves a :class:`~tpu_sync.vllm.metadata.TierOp` (its blocks of every layer, D2H) to the
    host tier; returns how many of its blocks are in the tier afterwards."""
    if getattr(op, "group_block_ids", None) is not None:
        return int(tier.put_groups(op.hashes, op.group_block_ids, op.parent))
    return int(tier.put(op.hashes, op.block_ids, op.parent))


class _Saver:
    """Host-tier saves on a background thread (``async_saves``): :meth:`submit` queues a save
    op and returns; the thread copies the blocks out of the KV tensors (D2H) into the tier, one
    op at a time, in order. Tracks what is pending per request and per block hash, so the
    worker can report a finished request's blocks free only once their saves are done, wait for
    a preempted request's saves before vLLM reuses its blocks, and make a lookup of a block
    still being saved wait for it (read-your-writes). Back-pressure: an op that would take the
    pending blocks past ``max_pending_blocks`` is refused (the caller drops it: a future miss),
    so a slow or full tier never stalls the engine. Thread-safe."""

    def __init__(self, tier: Any, max_pending_blocks: int, copier: Any = None) -> None:
        self.tier = tier
        self.max_pending_blocks = max_pending_blocks
        #: the framework-copy adapter whose host mirrors the saves read (None: the caches
        #: themselves): each op comes with the ``finish`` of its staging, and its mirror blocks
        #: are dropped after the save
        self.copier = copier
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._by_req: Dict[str, int] = {}
        self._by_hash: Dict[bytes, int] = {}
        self._blocks = 0
        #: finished ops not yet taken: (op, blocks in the tier afterwards, error or None)
        self._results: List[Any] = []
        self._thread = threading.Thread(target=self._run, name="tpu-sync-saves", daemon=True)
        self._thread.start()

    def has_room(self, blocks: int) -> bool:
        """Whether an op of ``blocks`` blocks would be queued now (only the submitting thread
        adds blocks, so the answer holds until its next :meth:`submit`)."""
        with self._cv:
            return not (self._blocks and self._blocks + blocks > self.max_pending_blocks)

    def submit(self, op: Any, finish: Optional[Callable[[], None]] = None) -> bool:
        """Queues ``op`` (with ``finish``, the staging of its blocks into the copier's mirrors
        to wait for first); False (nothing queued) when the pending blocks would pass the cap."""
        n = len(op.hashes)
        with self._cv:
            if self._blocks and self._blocks + n > self.max_pending_blocks:
                return False
            self._blocks += n
            self._by_req[op.req_id] = self._by_req.get(op.req_id, 0) + 1
            for h in op.hashes:
                self._by_hash[h] = self._by_hash.get(h, 0) + 1
        self._q.put((op, finish))
        return True

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            op, finish = item
            err: Optional[BaseException] = None
            n = 0
            try:
                if finish is not None:
                    finish()  # the framework's D2H into the mirrors
                n = _save(self.tier, op)
            except Exception as e:  # a failed save is a future miss
                err = e
            finally:
                if self.copier is not None:
                    self.copier.drop(_op_ids(op))
            with self._cv:
                self._blocks -= len(op.hashes)
                left = self._by_req[op.req_id] - 1
                if left:
                    self._by_req[op.req_id] = left
                else:
                    del self._by_req[op.req_id]
                for h in op.hashes:
                    c = self._by_hash[h] - 1
                    if c:
                        self._by_hash[h] = c
                    else:
                        del self._by_hash[h]
                self._results.append((op, n, err))
                self._cv.notify_all()

    def pending(self, req_id: str) -> int:
        """Save ops of ``req_id`` queued or running."""
        with self._cv:
            return self._by_req.get(req_id, 0)

    def pending_blocks(self) -> int:
        with self._cv:
            return self._blocks

    def wait_requests(self, req_ids: Any, timeout: float) -> bool:
        """Waits until no save of ``req_ids`` is pending; False after ``timeout`` seconds."""
        with self._cv:
            return self._cv.wait_for(lambda: not any(r in self._by_req for r in req_ids), timeout)

    def wait_hashes(self, hashes: Any, timeout: float) -> bool:
        """Waits until no save of a block in ``hashes`` is pending; False after ``timeout``."""
        with self._cv:
            return self._cv.wait_for(lambda: not any(h in self._by_hash for h in hashes), timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Waits until nothing is queued or running; False after ``timeout`` seconds."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._blocks, timeout)

    def take_results(self) -> List[Any]:
        with self._cv:
            out, self._results = self._results, []
            return out

    def close(self, timeout: float) -> bool:
        """Lets the queued saves finish (up to ``timeout`` seconds) and stops the thread."""
        self._q.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


class WorkerSide:
    """Worker-side state of :class:`~tpu_sync.vllm.connector.TpuSyncConnector`. Called from
    the model-runner thread only."""

    def __init__(self, vllm_config: Any, cfg: ConnectorConfig, geometry: KvGeometry) -> None:
        self.cfg = cfg
        self.geometry = geometry
        self.vllm_config = vllm_config
        self.caches: Optional[KvCaches] = None
        #: what made :attr:`caches`' in-place views where no copier owns them (sparse MLA caches)
        self._views_owner: Any = None
        self.tier: Any = None
        self.transport: Any = None
        self._leases: Dict[str, Any] = {}
        self._pulls: Dict[str, _Pull] = {}
        #: this step computed no token (``TpuSyncMetadata.idle``)
        self._step_idle = False
        #: the step's metadata whose registrations :meth:`bind` made before the forward
        self._bound: Optional[TpuSyncMetadata] = None
        self._sent: Set[str] = set()
        #: stages and publishes layers off the model's thread (created on first use)
        self._stager: Optional[_Stager] = None
        self._load_errors: Set[int] = set()
        #: host-tier loads reported like pulls (``TierOp.report``): request -> delivered whole
        self._loads_reported: Dict[str, bool] = {}
        #: the last step's metadata as tpu-inference's DP scheduler merged it, and its unpacked form
        self._dp_meta: Optional[Tuple[Any, Any]] = None
        self._report = TpuSyncWorkerMetadata()
        self._src_layouts: Dict[str, Dict[str, Any]] = {}
        self._reject_queue: "queue.Queue[Optional[RejectSpec]]" = queue.Queue()
        self._reject_thread: Optional[threading.Thread] = None
        self._pull_waits = False
        # Asynchronous host-tier saves (``async_saves``): the saver, the requests with a save
        # op (the scheduler delays freeing their blocks), and those of them that finished and
        # wait for their saves before they are reported in ``finished_sending``.
        self._saver: Optional[_Saver] = None
        self._save_reqs: Set[str] = set()
        self._save_finished: Set[str] = set()
        # Layer-wise state (``layerwise``): layer index by name, registrations being staged
        # this step (xfer id -> spec), this step's pulls read layer by layer, host-tier loads.
        self._layer_index: Dict[str, int] = {}
        self._layer_sends: Dict[int, Any] = {}
        self._layer_pulls: Dict[str, _Pull] = {}
        self._layer_load: Optional[_LayerLoad] = None
        #: counters: blocks saved / loaded, pulls done / failed / cancelled, registrations,
        #: failed loads, lookups, rejects sent to producers (and those that failed), whether AMX
        #: tile permission was granted; layer-wise registrations, pulls and host-tier load ops;
        #: asynchronous saves: ops that failed, blocks dropped by back-pressure, waits for a
        #: save (a preempted request's, or a lookup of a block being saved); microseconds of the
        #: successful pulls (each from its start to its last byte written); both-at-once pulls
        #: (started once the producer described the request); empty engine steps that waited for
        #: a pull (``idle_wait_ms``), failed background publishes; microseconds both-at-once pulls
        #: waited for their producer's registration (successful pulls); requests not registered
        #: because no decode rank pulls from this rank (a replica the plan does not read);
        #: requests refused to their consumers (registration failed or given up: their pulls
        #: fail at once).
        self.stats: Dict[str, int] = dict(saved_blocks=0, loaded_blocks=0, pulls_done=0, pulls_failed=0, pulls_cancelled=0,
                                          registered=0, register_failed=0, failed_loads=0, lookups=0, rejects_sent=0,
                                          rejects_failed=0, amx_permission=0, layerwise_registered=0,
                                          layerwise_pulls=0, layerwise_loads=0, saves_failed=0, saves_dropped=0,
                                          save_waits=0, pull_us=0, pulls_deferred=0, idle_waits=0, publish_failed=0, describe_us=0,
                                          register_skipped=0, states_placed=0, refused=0)
        #: this interval's observations for vLLM's connector-stats hooks (None: vLLM lacks them).
        self.xfer_stats: Any = None
        try:
            from .stats import TpuSyncConnectorStats

            self.xfer_stats = TpuSyncConnectorStats()
        except ImportError:  # an older vLLM without KVConnectorStats
            pass

    # ---- start-up -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        """Checks vLLM's tensors are the per-layer cache this connector moves (the CPU backend's
        LBHNC ``[num_blocks, heads, block_size, 2 * head_dim]``, or a TPU backend's ragged paged
        attention v3 ``[num_blocks, block_size, R, P, D']`` when the geometry's ``kv_order`` is
        ``rpa3``/``rpa3hd64``, or vLLM-TorchTPU's batched kernel's ``SEQ_ALONG_LANE``
        ``[num_blocks, 2 * H, D' / P, P, block_size]`` for ``rpa-sal``:
        :meth:`KvGeometry.layer_shape`; or, for an MLA model on a TPU (``rpamla``),
        vLLM-TorchTPU's dense MLA latent cache ``[num_blocks, block_size / P, P, D']``,
        :meth:`KvGeometry.torch_mla_shape`, the same latent on every TP rank; each of these
        token-major caches also with kernel pages smaller than the scheduler's block,
        ``[num_blocks * s, block_size / s, ...]``, seen as scheduler blocks without a copy:
        :func:`_scheduler_blocks`), orders them by layer, and opens
        the host tier and the P/D endpoint over zero-copy views of them (CPU tensors), or over
        host mirrors filled and written back by torch's own copies (accelerator tensors, such as
        vLLM-TorchTPU's: ``torch_backend``, :mod:`tpu_sync.torch_kv`).

        Raises:
            ValueError: another cache layout (e.g. a GPU backend's ``[2, blocks, ...]``), tensors
                that differ from each other or from the model's geometry, non-contiguous tensors;
            NotImplementedError, UnsupportedError: see :meth:`_torch_kv`; NotImplementedError:
                sparse MLA layers (a ``(nope, rope)`` pair of caches per layer) for a geometry
                without :attr:`KvGeometry.mla_parts` (those are :meth:`_register_sparse_mla`'s).
        """
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        g = self.geometry
        if g.mla_parts:
            self._register_sparse_mla(kv_caches)
            return
        mla = g.kv_order == compat.MLA_ORDER
        if mla and g.block_size % g.packing:
            raise ValueError(f"TpuSyncConnector: block size {g.block_size} with vLLM-TorchTPU's MLA cache, which packs "
                             f"{g.packing} {g.dtype} tokens to a row: the last row of every block holds padding "
                             f"slots, which tpu_sync does not map; use a multiple of {g.packing}")
        if compat.uses_amx(g.block_format):
            # vLLM's AMX bf16 attention kernel uses AMX tiles without asking the kernel for them;
            # a P/D consumer's first forward is a decode step, which would die with SIGILL.
            self.stats["amx_permission"] = int(compat.request_amx_tiles())
        names = sorted(kv_caches, key=lambda n: (extract_layer_index(n), n))
        if g.groups:
            covered = sorted(int(l) for grp in g.groups for l in grp["layers"])
            if covered != list(range(len(names))):
                raise ValueError(f"TpuSyncConnector: the KV cache groups cover cache layers {covered}, vLLM "
                                 f"registered {len(names)} KV tensors")
        tensors = [kv_caches[n] for n in names]
        if mla:
            split = [n for n in names if isinstance(kv_caches[n], (list, tuple))]
            if split:
                # vllm-torchtpu 0.29.0 runner/kv_cache_manager.py: a sparse MLA layer
                # (use_sparse, DeepSeek-V3.2 style) holds a (nope, rope) pair of caches, each in
                # a layout of its own (TPU_SPARSE_MLA_NOPE_LAYOUT / _ROPE_LAYOUT).
                raise NotImplementedError(f"TpuSyncConnector: layer {split[0]} is a sparse MLA layer (a (nope, rope) "
                                          "pair of caches, DeepSeek-V3.2 style), but the model's geometry is dense "
                                          "MLA (its config has no index_topk): sparse MLA caches are mapped for "
                                          "models whose config has it, from their KV cache config (docs/tpu.md)")
        if len(tensors) != g.num_layers:
            extra = (" (an MLA model with indexer caches, such as DeepSeek-V3.2's, registers more caches than "
                     "attention layers: its geometry must be the sparse MLA one, from a config with index_topk)"
                     if mla and len(tensors) > g.num_layers else "")
            raise ValueError(f"TpuSyncConnector: {len(tensors)} KV tensors for {g.num_layers} layers{extra}")
        want = g.torch_mla_shape() if mla else g.layer_shape()
        kind = ("the TPU backends' ragged paged attention v3 per-layer KV cache" if g.is_rpa3 else
                "vLLM-TorchTPU's batched ragged paged attention SEQ_ALONG_LANE per-layer KV cache" if g.is_sal else
                "vLLM-TorchTPU's MLA latent cache (PallasMLAttentionBackend, the MLA v2 kernel's packed tokens)"
                if mla else "vLLM's LBHNC per-layer KV cache")
        group_of = g.group_of_layer()
        attn = [i for i in range(len(names)) if not g.is_state_group(group_of[i])]
        #: layers whose kernel pages tpu_sync sees through a strided logical view of the
        #: scheduler's blocks (moved by the framework's copies only)
        logical = set()
        for i in attn:
            if not isinstance(tensors[i], (list, tuple)):
                tensors[i], as_logical = _scheduler_blocks(names[i], tensors[i], want, g)
                if as_logical:
                    logical.add(i)
        first = tensors[attn[0]]
        for i, (n, t) in enumerate(zip(names, tensors)):
            if g.is_state_group(group_of[i]):
                continue  # checked and viewed below (a tuple of state tensors: vLLM-TorchTPU's)
            if isinstance(t, (list, tuple)):
                raise ValueError(f"TpuSyncConnector: layer {n} has a list of KV tensors; expected one tensor")
            shape = tuple(int(s) for s in t.shape)
            if i in logical:
                pass  # kernel pages: the scheduler's blocks in a logical order (_scheduler_blocks)
            elif len(shape) != 1 + len(want) or shape[1:] != want:
                raise ValueError(
                    f"TpuSyncConnector needs {kind} [num_blocks, {', '.join(str(d) for d in want)}] "
                    f"({g.kv_order}, {g.dtype}); layer {n} has shape {list(shape)}"
                )
            if t.shape != first.shape or t.dtype != first.dtype or (i not in logical and not rows_contiguous(t)):
                raise ValueError(f"TpuSyncConnector: layer {n} differs from layer {names[attn[0]]}, or its blocks are "
                                 f"not contiguous (strides {list(t.stride())})")
            if compat.TORCH_TO_TPU_SYNC_DTYPE.get(str(t.dtype)) != g.dtype:
                raise ValueError(f"TpuSyncConnector: layer {n} is {t.dtype}, the model's KV dtype is {g.dtype}")
        if logical:
            logical_view = g.view_shape(int(first.shape[0])) or (int(first.shape[0]),) + tuple(want)
            if len(logical) != len(attn):
                raise ValueError("TpuSyncConnector: some layers' kernel pages are viewed as scheduler blocks and some "
                                 "are not: their caches differ")
        for i, n in enumerate(names):
            if g.is_state_group(group_of[i]):
                _check_state_tensors(n, tensors[i], g.groups[group_of[i]], int(first.shape[0]), g.tp)
        torch_kv = self._torch_kv(tensors, g, logical_view if logical else None, names)
        if torch_kv is None:
            for i, n in enumerate(names):
                if g.is_state_group(group_of[i]):
                    tensors[i] = _state_view(n, tensors[i], g.groups[group_of[i]], int(first.shape[0]), g.tp)
        from tpu_sync.torch_kv import PartsKv

        layer_block_bytes = (torch_kv.parts[0].block_bytes if isinstance(torch_kv, PartsKv) else
                             torch_kv.block_bytes if torch_kv is not None else
                             int(first.stride(0)) * int(first.element_size()))
        if layer_block_bytes != g.layer_block_bytes:
            if torch_kv is not None:
                torch_kv.close()
            raise ValueError(f"TpuSyncConnector: block stride {layer_block_bytes} B, expected {g.layer_block_bytes} B")
        try:
            rank = int(get_tensor_model_parallel_rank())
        except Exception:  # no TP group (single process)
            rank = 0
        self.caches = KvCaches(names=names, tensors=tensors, num_blocks=int(first.shape[0]),
                               layer_block_bytes=layer_block_bytes, tp_rank=rank, layer_group=g.group_of_layer(),
                               view_shape=g.view_shape(int(first.shape[0])))
        if torch_kv is not None:
            self.caches._client = torch_kv.client  # type: ignore[attr-defined]
            self.caches.views = torch_kv.views()
            self.caches.copier = torch_kv
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._open(rank)

    def _register_sparse_mla(self, kv_caches: Dict[str, Any]) -> None:
        """:meth:`register_kv_caches` of vLLM-TorchTPU's sparse MLA caches
        (:attr:`KvGeometry.mla_parts`): each sparse layer's ``[nope, rope]`` list becomes two
        cache layers, each indexer's K cache one, in vLLM layer order; every tensor is checked
        against its part's shape formula and layout, and tpu_sync sees each as ``[num_blocks,
        block_size, lanes]`` fp8 bytes (the same memory: every token of a page is one contiguous
        row of ``lanes`` bytes at ``slot * lanes`` in either layout; the indexer's
        ``SEQ_ALONG_LANE`` cache is moved in whole blocks, so its view's inner order does not
        matter). CPU tensors are viewed in
        place; accelerator tensors move through torch's copies, one :class:`TorchKv` per part
        (:class:`tpu_sync.torch_kv.PartsKv`).

        Raises:
            ValueError: a layer count, list length, shape, dtype (another layout than the
                geometry's) or block count other than the geometry's; non-contiguous tensors;
            NotImplementedError: layer-wise transfers (not supported with these caches yet)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        from tpu_sync.torch_kv import PartsKv, TorchKv

        g = self.geometry
        bs = g.block_size
        if self.cfg.layerwise:
            raise NotImplementedError("TpuSyncConnector: layer-wise transfers of sparse MLA caches are not supported "
                                      "yet (docs/tpu.md); use whole-request transfers")
        if bs % 4:
            raise ValueError(f"TpuSyncConnector: block size {bs} with vLLM-TorchTPU's sparse MLA caches, whose rope and "
                             "indexer caches pack 4 tokens to a row: use a multiple of 4")
        names = compat.layer_order(list(kv_caches))
        layers: List[Tuple[str, str, Any]] = []  # (cache layer name, part name, tensor)
        for n in names:
            v = kv_caches[n]
            if isinstance(v, (list, tuple)):
                if len(v) != 2:
                    raise ValueError(f"TpuSyncConnector: sparse MLA layer {n} registered {len(v)} caches; expected "
                                     "[nope, rope]")
                layers += [(n + "#nope", "nope", v[0]), (n + "#rope", "rope", v[1])]
            else:
                layers.append((n, "indexer", v))
        want = g.part_of_layer()
        got = [p for _, p, _ in layers]
        if got != [p.get("name") for p in want]:
            raise ValueError(f"TpuSyncConnector: vLLM registered sparse MLA caches {got} in layer order; the geometry "
                             f"(from the KV cache config) has {[p.get('name') for p in want]}")
        nb = None
        by_part: Dict[str, List[int]] = {}
        tensors = []
        for i, ((name, part, t), spec) in enumerate(zip(layers, want)):
            lanes, layout = int(spec["lanes"]), str(spec["layout"])
            dtype = "torch.uint8" if part == "indexer" else compat.SPARSE_MLA_LAYOUTS[layout]
            word = 4 if dtype == "torch.uint32" else 1
            if part == "nope":
                shape = (bs, lanes // 4) if layout == "sparsecore" else (bs, lanes // 128, 128)
            elif layout == "seq_along_lane":  # the indexer's: byte j of every token in row j
                shape = (lanes // 4, 4, bs)
            else:  # rope, indexer: 4 tokens to a row
                shape = (bs // 4, lanes) if layout == "sparsecore" else (bs // 4, 4, lanes)
            have = tuple(int(d) for d in t.shape)
            if str(t.dtype) != dtype or have[1:] != shape:
                raise ValueError(f"TpuSyncConnector: sparse MLA {part} cache {name} is {list(have)} {t.dtype}; the "
                                 f"{layout} layout of {lanes}-byte tokens is [num_blocks, "
                                 f"{', '.join(str(d) for d in shape)}] {dtype} (vllm-torchtpu 0.29.0 "
                                 "kernels/mla/kv_cache_utils.py; both sides must use the same layout)")
            if nb is None:
                nb = have[0]
            if have[0] != nb or not t.is_contiguous() or int(t[0].numel()) * word != bs * lanes:
                raise ValueError(f"TpuSyncConnector: sparse MLA cache {name} has {have[0]} blocks (others {nb}), is "
                                 f"not contiguous (strides {list(t.stride())}) or its blocks are not {bs} x {lanes} "
                                 "bytes")
            by_part.setdefault(part, []).append(i)
            tensors.append(t)
        if nb is None:
            raise ValueError("TpuSyncConnector: no sparse MLA caches registered")
        backend = str(self.cfg.extra.get("torch_backend", "auto"))
        copy_api = str(self.cfg.extra.get("torch_copy_api", "auto"))
        kvs: List[Any] = []
        client = None
        try:
            for part, idx in by_part.items():
                spec = want[idx[0]]
                # tpu-sync's shapes: rpamla [N, BS, lanes]; the SEQ_ALONG_LANE indexer as opaque
                # LBHNC regions of one head, [N, 1, BS, 132].
                view = ((nb, 1, bs, int(spec["lanes"])) if spec["layout"] == "seq_along_lane" else
                        (nb, bs, int(spec["lanes"])))
                tk = TorchKv([tensors[i] for i in idx], backend=backend, copy_api=copy_api, client=client,
                             block_size=bs, view_shape=view, view_dtype="f8e4m3fn")
                client = tk.client
                kvs.append(tk)
            parts = PartsKv(kvs, list(by_part.values()))
            views = parts.views()
        except BaseException:
            for tk in kvs:
                tk.close()
            raise
        log.info("tpu_sync: sparse MLA caches (%s) on %s: back end %s (%s), copies %s",
                 ", ".join(f"{p}: {len(i)} layers" for p, i in by_part.items()), parts.device, parts.backend,
                 parts.backend_reason, parts.copy_api)
        try:
            rank = int(get_tensor_model_parallel_rank())
        except Exception:  # no TP group (single process)
            rank = 0
        sizes = g.layer_bytes()
        self.caches = KvCaches(names=[n for n, _, _ in layers], tensors=tensors, num_blocks=nb,
                               layer_block_bytes=max(sizes), tp_rank=rank, layer_bytes=sizes)
        self.caches._client = parts.client  # type: ignore[attr-defined]
        self.caches.views = views
        if parts.backend == "framework-copy":
            self.caches.copier = parts
        else:
            self._views_owner = parts  # closed at shutdown
        self._layer_index = {n: i for i, (n, _, _) in enumerate(layers)}
        self._open(rank)

    def _torch_kv(self, tensors: List[Any], g: KvGeometry, logical_view: Optional[Tuple[int, ...]] = None,
                  names: Optional[List[str]] = None) -> Any:
        """The :class:`tpu_sync.torch_kv.TorchKv` that moves accelerator tensors through torch's
        own copies (``torch_backend``: ``framework-copy``, the default for tensors not in host
        memory), or None where tpu_sync views the tensors in place (CPU tensors). With Mamba
        state groups a :class:`tpu_sync.torch_kv.PartsKv` of the attention layers' ``TorchKv``
        and one :class:`tpu_sync.torch_kv.StateKv` per state group (its layers' state tensors
        laid one after another in each slot of host mirrors); a state layer registered as a tuple
        of separate tensors (vLLM-TorchTPU's per-layer caches) is always moved so. The back end
        and why it was chosen are logged and in :attr:`adapter_stats`.

        Raises:
            NotImplementedError: ``framework-copy`` with layer-wise transfers (not supported
                yet; docs/tpu.md); UnsupportedError (tpu_sync.errors): ``pjrt-view`` of
                accelerator tensors or of state layers registered as separate tensors,
                ``batch_transfer`` without torch_tpu; InvalidArgumentError: ``pjrt-view`` of
                kernel pages that only the framework's copies can see as scheduler blocks
                (``logical_view``: the shape tpu_sync sees their mirrors in)."""
        from tpu_sync.torch_kv import _fail
        from tpu_sync.errors import UnsupportedError

        backend = str(self.cfg.extra.get("torch_backend", "auto"))
        group_of = g.group_of_layer()
        states = [i for i in range(len(tensors)) if g.is_state_group(group_of[i])]
        split = [i for i in states if isinstance(tensors[i], (list, tuple))]
        attn_layers = [i for i in range(len(tensors)) if i not in states]
        attn = [tensors[i] for i in attn_layers]
        on_host = all(getattr(getattr(t, "device", None), "type", "cpu") == "cpu" for t in attn)
        # Per-layer strided views of one block-major bundle (vLLM-TorchTPU's
        # VLLM_TPU_BLOCK_MAJOR_KV) cannot be viewed as PJRT buffers either.
        whole = all(t.is_contiguous() for t in attn)
        if split and backend == "pjrt-view":
            n = names[split[0]] if names else f"layer {split[0]}"
            raise _fail(UnsupportedError, f"TpuSyncConnector: state layer {n} is {len(tensors[split[0]])} separate "
                        "tensors (vLLM-TorchTPU's per-layer Mamba caches), which no PJRT buffer views as one slot: "
                        "use torch_backend framework-copy (or auto)")
        if not split and (backend == "pjrt-view" or (backend == "auto" and on_host and whole)):
            if not (on_host and whole):
                from tpu_sync.torch_kv import TorchKv

                TorchKv(attn, backend="pjrt-view")  # raises, naming the device or the strides
            return None
        if self.cfg.layerwise:
            raise NotImplementedError(f"TpuSyncConnector: layer-wise transfers with KV tensors moved by torch's "
                                      f"copies (torch_backend framework-copy; tensors on {attn[0].device}) are not "
                                      "supported yet (issue 25; docs/tpu.md)")
        from tpu_sync.torch_kv import PartsKv, StateKv, TorchKv

        copy_api = str(self.cfg.extra.get("torch_copy_api", "auto"))
        if split and backend == "auto" and on_host and whole:
            backend = "framework-copy"  # the attention layers move with the states
        # With KV cache groups each layer's tensor is copied at its own group's blocks only
        # (vLLM binds one tensor to the layers at one position of every group).
        attn_groups = sorted({group_of[i] for i in attn_layers})
        local = {grp: k for k, grp in enumerate(attn_groups)}
        tk = TorchKv(attn, backend=backend, copy_api=copy_api, block_size=g.block_size,
                     view_shape=logical_view or g.view_shape(int(attn[0].shape[0])),
                     layer_group=[local[group_of[i]] for i in attn_layers] if g.groups else None)
        log.info("tpu_sync: KV tensors on %s: back end %s (%s), copies %s", tk.device, tk.backend, tk.backend_reason,
                 tk.copy_api)
        if not states:
            return tk
        parts: List[Any] = [tk]
        try:
            layers, groups = [attn_layers], [attn_groups]
            nb = int(attn[0].shape[0])
            for sg in sorted({group_of[i] for i in states}):
                ls = [i for i in states if group_of[i] == sg]
                grp = g.groups[sg]
                for i in ls:
                    if not isinstance(tensors[i], (list, tuple)):
                        _check_raw_state(names[i] if names else f"layer {i}", tensors[i], grp, nb, g.tp)
                parts.append(StateKv([[x[:nb] for x in _state_tensors(tensors[i])] for i in ls],
                                     int(grp["slot_bytes"]), view_dtype=_state_buffer_dtype(grp),
                                     copy_api=tk.copy_api, client=tk.client))
                layers.append(ls)
                groups.append([sg])
            out = PartsKv(parts, layers, groups)
        except BaseException:
            for p in parts:
                p.close()
            raise
        log.info("tpu_sync: Mamba state layers %s moved through torch's copies (%s)", [len(ls) for ls in layers[1:]],
                 tk.copy_api)
        return out

    def register_runner(self, runner: Any) -> None:
        """The model runner, after :meth:`register_kv_caches` (vLLM-TorchTPU: nothing more to
        do), or instead of it (tpu-inference: ``runner.kv_caches`` is a list of ``jax.Array`` s,
        one per layer, each sharded over the mesh's ``model`` axis, one TP rank per shard, all in
        this process). The caches are read through :class:`tpu_sync.jax_kv.JaxKv`, again at every
        hook (each forward re-assigns them); an MLA model's latent cache (``rpamla``) is replicated
        over the ``model`` axis, one replica per TP rank, and a pull writes every replica. The
        back end (``jax_backend``: ``auto``,
        ``pjrt-view``, ``framework-copy``) and why it was chosen are in the log and in
        :attr:`jax_stats`. With such a runner this worker registers and pulls every TP rank's
        blocks through one endpoint, saves synchronously, and one host-tier entry holds a block of
        every rank. A hybrid model's state layers (gated delta nets: ``(conv, recurrent)`` tuples
        in ``runner.kv_caches``, in runner-owned slots) move for P/D through
        :class:`tpu_sync.jax_state.JaxHybridKv` (:meth:`_jax_caches`): a producer stages a
        request's state from its slot when it registers it, right after the forward that
        completes its prefill; a consumer writes a pulled state into the request's slot when
        the metadata of the step in which the request enters the runner's batch is bound
        (:meth:`bind`), before that step's forward.

        Raises:
            ValueError: no caches, or caches that disagree with the model's geometry (TP,
                per-rank shape, dtype, layers, state bytes per rank);
                NotImplementedError: what is not supported with a JAX runner yet (layer-wise
                transfers, KV cache groups with MLA layers, the host tier or speculative decoding
                with state layers, a producer of state layers without ``early_register``);
                UnsupportedError (tpu_sync.errors): shardings not mapped
                (docs/tpu.md); ImportError without jax."""
        if self.caches is not None:
            return
        caches = getattr(runner, "kv_caches", None)
        if not caches:
            raise ValueError("TpuSyncConnector: register_runner without registered KV caches, and the runner has no "
                             "kv_caches")
        g = self.geometry
        states = bool(g.groups) and g.has_state
        spec = getattr(self.vllm_config, "speculative_config", None) is not None
        if ((g.groups and g.kv_order == compat.MLA_ORDER) or self.cfg.layerwise or g.mla_parts
                or g.kv_order not in ("rpa3", "rpa3hd64", compat.MLA_ORDER)
                or (states and (self.cfg.offload or spec or (self.cfg.is_producer and not self.cfg.early_register)))):
            what = ("layer-wise transfers" if self.cfg.layerwise else
                    "sparse MLA caches (vLLM-TorchTPU's; tpu-inference has none)" if g.mla_parts else
                    "KV cache groups with MLA layers" if g.groups and g.kv_order == compat.MLA_ORDER else
                    f"the {g.kv_order} cache" if g.kv_order not in ("rpa3", "rpa3hd64", compat.MLA_ORDER) else
                    "the host tier with state (Mamba) layers" if self.cfg.offload else
                    "speculative decoding with state (Mamba) layers (the runner gives a request several "
                    "consecutive state slots)" if spec else
                    "a producer of state (Mamba) layers without early_register (the state must be staged "
                    "before the runner gives the request's slot back)")
            raise NotImplementedError(f"TpuSyncConnector: {what} with a JAX model runner (tpu-inference) are not "
                                      "supported yet (issue 25; docs/tpu.md)")
        jx = self._jax_caches(runner, g)
        want = tuple(g.layer_shape())
        problems = []
        sched_dp = compat.dp_scheduler_size(self.vllm_config)
        if jx.dp != sched_dp:
            # tpu-inference 0.32.0 core/sched/dp_scheduler.py: with DP > 1 one vLLM scheduler
            # per DP rank over num_blocks / DP blocks, whose metadata the connector sends in the
            # form that scheduler merges (TpuSyncMetadata.to_dp_form).
            problems.append(f"split over {jx.dp} data-parallel replica(s) of the mesh's data axis, while the "
                            f"engine's DP scheduler has {sched_dp} (vllm_config.sharding_config.total_dp_size)")
        if jx.dp > 1:
            from ._api import KVConnectorTransferResults, _TransferResults

            if KVConnectorTransferResults is _TransferResults:  # tpu_sync's stand-in: vLLM 0.29
                problems.append("split over data-parallel replicas, which needs vLLM's failed_recving (vLLM >= 0.30: "
                                "a failed load is reported by request, since no rank's scheduler can read global "
                                "block ids)")
        if self.cfg.extra.get("cluster") and len(jx.ranks) > 1:
            # The cluster directory describes one store per TP rank (its layout, rank and
            # namespace), while this worker's host-tier entries hold a block of every rank of a
            # replica (entry_ranks): a peer would read them as one rank's.
            problems.append(f"hold {len(jx.ranks)} ranks (DP {jx.dp} x TP {jx.tp}) in one process, whose host-tier "
                            "entries hold every rank's bytes: the cluster tier (cluster settings) shares one store "
                            "per rank and is not supported with such a runner yet (one rank per runner is)")
        if jx.num_layers != g.num_layers:
            problems.append(f"{jx.num_layers} layers, the model has {g.num_layers}")
        if jx.tp != g.tp:
            problems.append(f"sharded over {jx.tp} devices of the model axis, vLLM's TP is {g.tp}")
        if jx.mla != (g.kv_order == compat.MLA_ORDER):
            problems.append(f"{'are' if jx.mla else 'are not'} an MLA latent cache, while the model's cache is "
                            f"{g.kv_order}")
        elif tuple(jx.view_shape[1:]) != want:
            what = ("tpu-inference's MLA cache [num_blocks, block_size, D'] as tpu_sync views it" if jx.mla else
                    f"ragged paged attention v3, {g.heads_per_rank} heads per rank")
            problems.append(f"per-rank shard [num_blocks, {', '.join(map(str, jx.view_shape[1:]))}], expected "
                            f"[num_blocks, {', '.join(map(str, want))}] ({what})")
        if jx.model_dtype != g.dtype:
            problems.append(f"dtype {jx.model_dtype}, the model's KV dtype is {g.dtype}")
        if problems:
            jx.close()
            raise ValueError("TpuSyncConnector: the runner's KV caches " + "; ".join(problems))
        self.caches = KvCaches(names=[f"layer.{i}" for i in range(jx.num_layers)], tensors=[],
                               num_blocks=jx.num_blocks * jx.dp, layer_block_bytes=g.layer_block_bytes, tp_rank=0,
                               layer_group=g.group_of_layer(), jax=jx, copier=jx)
        self.caches._client = jx.client  # type: ignore[attr-defined]
        self.caches.refresh()
        self._layer_index = {}
        log.info("tpu_sync: JAX model runner: TP ranks %s in this process (DP %d), back end %s (%s)", jx.ranks, jx.dp,
                 jx.backend, jx.backend_reason)
        self._open(0)

    def _jax_caches(self, runner: Any, g: KvGeometry) -> Any:
        """A JAX runner's caches: :class:`tpu_sync.jax_kv.JaxKv` over every cache layer, or for a
        model with state (Mamba, GDN) groups a :class:`tpu_sync.jax_state.JaxHybridKv` of the
        attention layers' ``JaxKv`` and one :class:`tpu_sync.jax_state.JaxStateKv` per state
        group, whose mirrors' rows are the state group's scheduler block ids and whose device
        slots are the runner's per-request slots (``input_batch.mamba_state_indices_cpu``,
        tpu-inference's ``mamba_cache_mode="none"``; docs/tpu.md).

        Raises:
            ValueError: state shards that are not the model's state at the mesh's TP."""
        from tpu_sync.jax_kv import JaxKv

        backend = str(self.cfg.extra.get("jax_backend", "auto"))
        layer_arrays = _runner_layer_arrays(runner, g) if g.groups else None
        if not (g.groups and g.has_state):
            return JaxKv(runner, backend=backend, block_size=g.block_size if g.kv_order == compat.MLA_ORDER else None,
                         layer_arrays=layer_arrays, layer_group=g.group_of_layer() if g.groups else None)
        from tpu_sync.jax_state import JaxHybridKv, JaxStateKv

        assert layer_arrays is not None
        group_of = g.group_of_layer()
        kinds = ["state" if g.is_state_group(k) else "attention" for k in range(len(g.groups))]
        attn_groups = [k for k, kind in enumerate(kinds) if kind != "state"]
        attn_layers = [i for i in range(g.num_layers) if kinds[group_of[i]] != "state"]
        local = {k: n for n, k in enumerate(attn_groups)}
        attn = JaxKv(runner, backend=backend, layer_arrays=[layer_arrays[i] for i in attn_layers],
                     layer_group=[local[group_of[i]] for i in attn_layers])
        parts: Dict[int, Any] = {}
        layer_kinds: List[Tuple[int, int]] = []
        try:
            for k, kind in enumerate(kinds):
                if kind != "state":
                    continue
                grp = g.groups[k]
                ls = [i for i in range(g.num_layers) if group_of[i] == k]
                st = JaxStateKv(runner, [layer_arrays[i] for i in ls], int(grp["slot_bytes"]),
                                view_dtype=_state_buffer_dtype(grp), client=attn.client,
                                mirror_blocks=attn.num_blocks)
                parts[k] = st
                want = compat.state_rank_bytes(grp["state"], g.tp)
                if st.part_bytes != list(want):
                    raise ValueError(f"TpuSyncConnector: the runner's state layers of KV cache group {k} hold "
                                     f"{st.part_bytes} bytes a slot per rank (components in order), the model's "
                                     f"state at TP={g.tp} is {list(want)}")
            for i in range(g.num_layers):
                k = group_of[i]
                if kinds[k] == "state":
                    layer_kinds.append((k, [j for j in range(g.num_layers) if group_of[j] == k].index(i)))
                else:
                    layer_kinds.append((k, attn_layers.index(i)))
            return JaxHybridKv(attn, parts, layer_kinds, kinds, lambda req_id: _runner_state_slot(runner, req_id))
        except BaseException:
            for st in parts.values():
                st.close()
            attn.close()
            raise

    @property
    def jax_stats(self) -> Optional[Dict[str, Any]]:
        """A JAX runner's back end, the reason for it, and its counters (None otherwise)."""
        jx = getattr(self.caches, "jax", None)
        return None if jx is None else jx.stats()

    @property
    def adapter_stats(self) -> Dict[str, Any]:
        """How this worker reads and writes the KV caches: ``backend`` (``pjrt-view``: in place;
        ``framework-copy``: the framework's own copies through host mirrors), the reason, and for
        ``framework-copy`` the copy API and counters (:mod:`tpu_sync.torch_kv`,
        :mod:`tpu_sync.jax_kv`). Empty before the caches are registered."""
        if self.caches is None:
            return {}
        cp = self.caches.copier
        if cp is not None:
            return dict(cp.stats(), framework="jax" if cp is self.caches.jax else "torch")
        return dict(backend="pjrt-view", backend_reason="the KV tensors are in host memory: viewed in place",
                    framework="torch")

    def _open(self, rank: int) -> None:
        """Opens the host tier and the P/D endpoint over the registered caches."""
        g = self.geometry
        assert self.caches is not None
        names, layer_block_bytes = self.caches.names, self.caches.layer_block_bytes
        if self.cfg.offload:
            self.tier = make_host_tier(self.cfg, g, self.caches)
            cp = self.caches.copier
            if self.cfg.async_saves and cp is not None and cp is self.caches.jax:
                # A JAX runner's saves read its arrays (or stage them by JAX's copies) on the model
                # thread, between the forwards that re-assign them: synchronous.
                log.info("tpu_sync: host-tier saves of a JAX model runner are synchronous (async_saves ignored)")
            elif self.cfg.async_saves:
                # Torch tensors through framework copies: the D2H is issued on the model thread
                # (stage_async) and waited for, with the tier write, on the saver's.
                self._saver = _Saver(self.tier, self.cfg.max_pending_save_blocks, cp)
        if self.cfg.pd:
            self.transport = make_pd_transport(self.cfg, g, self.caches)
            try:
                self._pull_waits = "wait_for_registration" in inspect.signature(self.transport.pull).parameters
            except (TypeError, ValueError):
                self._pull_waits = False
        if self.cfg.metrics_addr:
            import tpu_sync

            try:
                addr = tpu_sync.serve_metrics(self.cfg.metrics_addr, rank=rank)
                log.info("tpu_sync: metrics of TP rank %d on http://%s/metrics", rank, addr)
            except Exception as e:  # metrics are never a reason to fail the engine
                log.warning("tpu_sync: metrics endpoint on %s (rank %d) not started: %s", self.cfg.metrics_addr,
                            rank, e)
        log.info("tpu_sync: %d layers x %d blocks of %d B (%s), offload=%s, endpoint=%s", len(names),
                 self.caches.num_blocks, layer_block_bytes, g.block_format, self.tier is not None,
                 getattr(self.transport, "address", None))

    def handshake(self) -> TpuSyncHandshake:
        """This worker's endpoint, for the scheduler side."""
        assert self.caches is not None
        jx = self.caches.jax
        return TpuSyncHandshake(tp_rank=self.caches.tp_rank, address=getattr(self.transport, "address", None),
                                block_format=self.geometry.block_format, num_blocks=self.caches.num_blocks,
                                tp_ranks=None if jx is None else list(jx.ranks), dp=self._dp)

    # ---- per step ------------------------------------------------------------------------

    def start_load_kv(self, meta: TpuSyncMetadata) -> None:
        """Lookups, host-tier loads (synchronous, or started layer-wise), registrations and pull
        starts of this step."""
        meta = self._unpacked(meta)
        self._step_idle = bool(getattr(meta, "idle", False))
        if getattr(meta, "hello", False) and self.caches is not None:
            # A scheduler without the start-up handshake (tpu-inference's DP ranks) asked.
            self._report.handshakes[self.caches.tp_rank] = self.handshake()
        if self.caches is not None:
            self.caches.refresh()  # a JAX runner's arrays of this step
            if self._bound is not meta:
                self._commit_pending_states()  # a caller without bind, before its forward
        if self.tier is not None:
            for req_id, hashes in meta.lookups.items():
                self._report.lookup_hits[req_id] = self._lookup(req_id, hashes)
            if self.cfg.layerwise and meta.loads and hasattr(self.tier, "get_host"):
                self._start_layer_loads(list(meta.loads))
            else:
                for op in meta.loads:
                    self._load(op)
        if self.transport is not None:
            if self._bound is not meta:
                self._register_step(meta)  # not bound before the forward (a caller without bind)
            self._bound = None
            self._sent.update(getattr(meta, "handoffs", ()))
            now = time.monotonic()
            for r in getattr(meta, "layer_recvs", ()):
                self._start_layer_pull(_Pull(spec=r, deadline=now + r.timeout_s))
            for s in meta.sends:
                self._register(s)
            for rj in getattr(meta, "rejects", ()):
                self._reject(rj)
            now = time.monotonic()
            for r in meta.recvs:
                self._pulls[r.req_id] = _Pull(spec=r, deadline=now + r.timeout_s)
            self._poll_starts()

    def bind(self, meta: TpuSyncMetadata) -> None:
        """Before the step's forward (vLLM's ``bind_connector_metadata``): withdraws and
        registers the requests whose prefill completes this step, so that ``save_kv_layer``
        publishes each layer as the forward writes it. (vLLM calls ``start_load_kv`` only after
        the forward when the step has no synchronous loads, too late for that.)"""
        meta = self._unpacked(meta)
        self._commit_pending_states()
        if self.transport is not None:
            self._register_step(meta)
            self._bound = meta

    def _commit_pending_states(self) -> None:
        """A JAX runner's pulled states (:class:`tpu_sync.jax_state.JaxHybridKv`) whose requests
        entered the runner's batch this step: written into their slots. From :meth:`bind`,
        which vLLM calls every step after the runner placed the step's requests and before the
        forward; ``start_load_kv`` runs after the forward in steps without synchronous loads
        (vLLM 0.32's ``_get_kv_connector_output``), too late for the forward that reads them.

        Raises:
            RuntimeError: a state that could not be written (the request must not compute from
                whatever its slot held; :meth:`JaxHybridKv.commit_pending`)."""
        cp = self.caches.copier if self.caches is not None else None
        if not hasattr(cp, "commit_pending"):
            return
        # (No refresh: the states read the runner's arrays themselves, and a commit changes no
        # buffer tpu_sync views.)
        for req_id in cp.commit_pending():
            self.stats["states_placed"] += 1
            log.debug("tpu_sync: %s: pulled state written into its slot", req_id)

    def _register_step(self, meta: TpuSyncMetadata) -> None:
        for xfer in getattr(meta, "withdraws", ()):
            self._withdraw(xfer)
        for xfer, reason in getattr(meta, "refusals", ()):
            self._withdraw(xfer, refuse=reason)
        for s in getattr(meta, "layer_sends", ()):
            self._register_layers(s)

    # ---- layer-wise ----------------------------------------------------------------------

    def _sends_whole(self) -> bool:
        """Whether this step's early registrations are made whole in ``wait_for_save`` instead
        of layer by layer: a transport without layers; caches reached through the framework's
        copies (accelerator torch tensors, a JAX runner on a TPU), whose blocks must be staged
        into the host mirrors on the model's thread before tpu_sync reads them; or a JAX runner
        (any back end), whose forward never calls the layer hooks and whose next forward donates
        the arrays: staged on the model's thread right after the forward, nothing reads them
        while the next one runs (a view stays valid only where the donation is in place)."""
        return not hasattr(self.transport, "register_layers") or (
            self.caches is not None and (self.caches.copier is not None or self.caches.jax is not None))

    @property
    def _dp(self) -> int:
        """Data-parallel replicas of the caches (a JAX runner's ``data`` axis; else 1)."""
        jx = self.caches.jax if self.caches is not None else None
        return 1 if jx is None else int(jx.dp)

    def _placement(self, block_ids: Any, first_token: int = 0, next_token: Optional[int] = None) -> Dict[str, Any]:
        """The tpu_sync placement of blocks ``block_ids`` of these caches: with DP (a JAX
        runner's replicas), global ids as tpu-inference's DP scheduler gives them, mapped to
        their replica's local ids and ``dp_rank`` in a layout of ``dp`` replicas (per KV cache
        group with groups; vLLM's null block, id 0, stays 0)."""
        assert self.caches is not None
        jx = self.caches.jax
        if jx is not None and jx.dp > 1:
            d, local = jx.split(_flat_ids(block_ids))
            if block_ids and isinstance(block_ids[0], (list, tuple)):
                off = d * int(jx.num_blocks)
                local = [[NULL_BLOCK_ID if int(b) == NULL_BLOCK_ID else int(b) - off for b in g] for g in block_ids]
            p = compat.placement(self.geometry.tpu_sync_layout(jx.num_blocks, jx.dp), local, first_token, next_token)
            p["dp_rank"] = d
            return p
        return compat.placement(self.geometry.tpu_sync_layout(self.caches.num_blocks), block_ids, first_token,
                                next_token)

    def _unpacked(self, meta: Any) -> Any:
        """The step's metadata with tpu-inference's DP scheduler's merge undone
        (:meth:`TpuSyncMetadata.from_dp_form`; the same object for every hook of the step);
        ``meta`` itself otherwise."""
        if meta is None or not getattr(meta, "requests_meta", None):
            return meta
        if self._dp_meta is not None and self._dp_meta[0] is meta:
            return self._dp_meta[1]
        out = meta.from_dp_form(self._dp)
        self._dp_meta = (meta, out)
        return out

    def _register_layers(self, s: Any) -> None:
        """Registers a request whose prefill completes this step, before its layers exist."""
        assert self.caches is not None
        if self._sends_whole():
            self._layer_sends[s.xfer_id] = s  # registered whole in wait_for_save
            return
        try:
            placement = self._placement(s.block_ids)
            pullers = self._pullers(placement, s)
            if pullers == 0:
                return
            self.transport.register_layers(s.xfer_id, placement, s.num_tokens, s.lease_s, pullers)
            self._layer_sends[s.xfer_id] = s
            self.stats["registered"] += 1
            self.stats["layerwise_registered"] += 1
        except Exception as e:  # the consumer's pull fails and it recomputes
            log.error("tpu_sync: layer-wise registration of %s (transfer %s) failed: %s", s.req_id, s.xfer_id, e)
            self.stats["register_failed"] += 1
            self._refuse(s.xfer_id, f"the producer could not register request {s.req_id}: {e}")

    def _withdraw(self, xfer_id: int, refuse: Optional[str] = None) -> None:
        """Ends a layer-wise registration; with ``refuse`` (the reason), its consumers' pulls of
        it fail at once (:meth:`_refuse`) instead of waiting for a registration."""
        self._layer_sends.pop(xfer_id, None)
        if self._stager is not None:
            self._stager.wait_xfer(xfer_id)  # its queued publishes first (rare: aborts)
        if refuse is not None and hasattr(self.transport, "refuse"):
            self._refuse(xfer_id, refuse, live_too=True)
        elif hasattr(self.transport, "withdraw"):
            try:
                self.transport.withdraw(xfer_id)
            except Exception as e:
                log.debug("tpu_sync: withdrawing transfer %s failed: %s", xfer_id, e)

    def _refuse(self, xfer_id: int, reason: str, live_too: bool = False) -> None:
        """This worker will not serve ``xfer_id``: its consumers' pulls fail at once with
        ``reason`` (:meth:`tpu_sync.Endpoint.refuse`) instead of waiting for a registration
        until their pull timeout, and they recompute. Without ``live_too`` a registration of the
        id that is live (the failure was a second registration of it) keeps serving."""
        refuse = getattr(self.transport, "refuse", None)
        if refuse is None:
            return
        try:
            active = getattr(self.transport, "active", None)
            if not live_too and active is not None and active(xfer_id):
                return
            refuse(xfer_id, reason)
            self.stats["refused"] += 1
        except Exception as e:
            log.warning("tpu_sync: refusing transfer %s failed (its consumers wait out their pull timeout): %s",
                        xfer_id, e)

    def _publish(self, layers: int) -> None:
        """Has layers ``..layers`` of this step's layer-wise registrations staged (D2H) and
        published by the stager thread: the model's thread goes on with the next layer."""
        if not hasattr(self.transport, "publish_layers") or self._sends_whole():
            return
        if self._stager is None:
            self._stager = _Stager(self.transport, self.stats)
        for xfer, s in list(self._layer_sends.items()):
            self._stager.submit(xfer, s.req_id, layers)

    def save_kv_layer(self, layer_name: str) -> None:
        """Layer-wise producer: vLLM wrote ``layer_name`` of this step's tokens; stage and
        publish it (and every layer before it) for the pullers."""
        if not self._layer_sends:
            return
        i = self._layer_index.get(layer_name)
        if i is not None:
            self._publish(i + 1)

    def _start_layer_pull(self, p: _Pull) -> None:
        assert self.caches is not None
        s = p.spec
        try:
            dst = self._placement(s.dst_block_ids, getattr(s, "first_token", 0), getattr(s, "next_token", None))
            src = compat.placement(s.src_layout, s.src_block_ids)
            p.handle = self.transport.pull(s.xfer_id, s.peers, src, dst, s.num_tokens,
                                           wait_for_registration=max(0.0, p.deadline - time.monotonic()),
                                           layerwise=True)
            self.stats["layerwise_pulls"] += 1
        except Exception as e:
            p.handle = _Failed(e)
        self._layer_pulls[s.req_id] = p

    def _fail_layer_pull(self, p: _Pull, err: BaseException) -> None:
        log.error("tpu_sync: layer-wise pull for %s failed: %s", p.spec.req_id, err)
        if p.handle is not None and not isinstance(p.handle, _Failed):
            _cancel(p.handle)
            _close(p.handle)
        p.handle = _Failed(err, booked=True)
        self.stats["pulls_failed"] += 1
        if self.xfer_stats is not None:
            self.xfer_stats.record_failure(_error_kind(err))
        self._load_errors.update(_flat_ids(p.spec.dst_block_ids))
        self._reject(RejectSpec(p.spec.req_id, p.spec.xfer_id, p.spec.peers,
                                f"request {p.spec.req_id}: its pull failed ({type(err).__name__}); recomputed"))

    def _start_layer_loads(self, ops: List[Any]) -> None:
        assert self.caches is not None
        job = _LayerLoad(ops=ops, ready=[threading.Event() for _ in self.caches.names])
        job.thread = threading.Thread(target=self._run_layer_loads, args=(job,), name="tpu-sync-layer-loads",
                                      daemon=True)
        self._layer_load = job
        self.stats["layerwise_loads"] += len(ops)
        job.thread.start()

    def _run_layer_loads(self, job: _LayerLoad) -> None:
        """Background thread: the step's host-tier reads (checksums verified) into bounce
        buffers, then each layer of every delivered block into the KV tensors (H2D)."""
        try:
            import numpy as np

            from tpu_sync import device

            caches = self.caches
            assert caches is not None and caches.views is not None
            lbb = caches.layer_block_bytes
            bounces, delivered, layer_ids = [], [], []
            for op in job.ops:
                buf = np.empty((len(op.block_ids), lbb * len(caches.names)), dtype=np.uint8)
                try:
                    # Every layer's target block at each position (its own group's block).
                    ids = _layer_block_ids(op, caches)
                    n = int(self.tier.get_host(op.hashes, [buf[i] for i in range(len(op.block_ids))]))
                except Exception as e:  # ChecksumError, missing blocks, bad group lists
                    log.warning("tpu_sync: host-tier load of %d blocks for %s failed: %s", len(op.block_ids),
                                op.req_id, e)
                    n, ids = 0, [[] for _ in caches.names]
                bounces.append(buf)
                delivered.append(n)
                layer_ids.append(ids)
            job.delivered = delivered
            for layer, view in enumerate(caches.views):
                # vLLM's null block (a sliding window's blocks before the window) is not written.
                copies = [(view, bid * lbb, buf[i, layer * lbb:(layer + 1) * lbb])
                          for buf, n, ids in zip(bounces, delivered, layer_ids)
                          for i, bid in enumerate(ids[layer][:n]) if bid is not None]
                if copies:
                    device.h2d(copies).wait()
                job.ready[layer].set()
        except BaseException as e:  # a device error: every block of the step counts as failed
            job.error = e
        finally:
            for ev in job.ready:
                ev.set()

    def _end_layer_loads(self) -> None:
        """Waits for the step's layer-wise loads and books them (failed blocks: load errors)."""
        job, self._layer_load = self._layer_load, None
        if job is None:
            return
        if job.thread is not None:
            job.thread.join()
        if job.error is not None:
            log.warning("tpu_sync: layer-wise host-tier load failed: %s", job.error)
        for i, op in enumerate(job.ops):
            delivered = 0 if job.error is not None or job.delivered is None else job.delivered[i]
            self._book_load(op, delivered)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: blocks until layer ``layer_name`` of this step's pulls and host-tier loads
        is in the KV tensors. A pull that fails or passes its deadline is cancelled and its blocks
        reported as load errors (vLLM recomputes them); the forward goes on."""
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        job = self._layer_load
        if job is not None:
            job.ready[i].wait()
        for p in list(self._layer_pulls.values()):
            h = p.handle
            if isinstance(h, _Failed):
                continue
            try:
                left = p.deadline - time.monotonic()
                if left <= 0 or not h.wait_layers(i + 1, timeout=left):
                    self._fail_layer_pull(p, TimeoutError(
                        f"layer {i} of transfer {p.spec.xfer_id} not in within {p.spec.timeout_s} s"))
            except Exception as e:
                self._fail_layer_pull(p, e)

    def _end_layer_pulls(self) -> None:
        """After the forward: every layer-wise pull of the step has all its layers (or failed);
        wait for its completion (the release) and book it."""
        pulls, self._layer_pulls = self._layer_pulls, {}
        for p in pulls.values():
            h = p.handle
            if isinstance(h, _Failed):
                if not h.booked:
                    self._fail_layer_pull(p, h.error)
                continue
            try:
                st = h.wait(max(0.0, p.deadline - time.monotonic()))
            except Exception as e:
                self._fail_layer_pull(p, e)
                continue
            self.stats["pulls_done"] += 1
            self._book_pull(p.spec.req_id, st)
            _close(h)

    def _take_saves(self) -> None:
        """Books the saves the saver finished (counters, warnings)."""
        if self._saver is None:
            return
        for op, n, err in self._saver.take_results():
            self._book_save(op, n, err)

    def _book_save(self, op: Any, n: int, err: Optional[BaseException]) -> None:
        """Counts a finished save: ``n`` blocks in the tier after it, or its error."""
        if err is not None:
            self.stats["saves_failed"] += 1
            log.warning("tpu_sync: saving %d blocks of %s failed: %s", len(op.hashes), op.req_id, err)
            return
        self.stats["saved_blocks"] += n
        self._record("saved_blocks", n)
        self._report.saved_blocks += n

    def handle_preemptions(self, meta: Optional[TpuSyncMetadata]) -> None:
        """Before the forward: waits for the saves of requests vLLM preempted this step (their
        blocks are free and may be written by this very forward)."""
        meta = self._unpacked(meta)
        if self._saver is None or meta is None:
            return
        reqs = [r for r in getattr(meta, "preempted", ()) if self._saver.pending(r)]
        if reqs:
            self.stats["save_waits"] += 1
            if not self._saver.wait_requests(reqs, SAVE_WAIT_S):
                log.error("tpu_sync: saves of preempted requests %s still running after %s s", reqs, SAVE_WAIT_S)

    def _lookup(self, req_id: str, hashes: List[bytes]) -> int:
        self.stats["lookups"] += 1
        if self._saver is not None and not self._saver.wait_hashes(hashes, 0):
            # Blocks of this chain are being saved: wait for them (a D2H of a few blocks), so a
            # request sees what an earlier one stored.
            self.stats["save_waits"] += 1
            self._saver.wait_hashes(hashes, SAVE_WAIT_S)
        old = self._leases.pop(req_id, None)
        if old is not None:
            _close(old)
        try:
            hits = self.tier.lookup(hashes)
            if hits:
                self._leases[req_id] = self.tier.pin(hashes[:hits])
            return int(hits)
        except Exception as e:  # a broken tier is a miss, never a crash
            log.warning("tpu_sync: host-tier lookup for %s failed: %s", req_id, e)
            return 0

    def _load(self, op: Any) -> None:
        delivered = 0
        try:
            cp = self.caches.copier if self.caches is not None else None
            if cp is not None:
                # Written into the mirrors by the tier, committed below: held until then, so a
                # drop of other blocks (the saver thread's, when a save ends) cannot give their
                # pages back in between (the load would commit zeros).
                cp.hold(_op_ids(op))
            try:
                if getattr(op, "group_block_ids", None) is not None:
                    delivered = int(self.tier.get_groups(op.hashes, op.group_block_ids))
                    if cp is not None:  # framework-copy: each group's delivered blocks into its layers
                        cp.commit([g[:delivered] for g in op.group_block_ids])
                else:
                    delivered = int(self.tier.get(op.hashes, op.block_ids))
                    if cp is not None:
                        cp.commit(op.block_ids[:delivered])  # framework-copy: into the caches
            finally:
                if cp is not None:
                    cp.drop(_op_ids(op))
        except Exception as e:  # ChecksumError, missing blocks, device errors
            log.warning("tpu_sync: host-tier load of %d blocks for %s failed: %s", len(op.block_ids), op.req_id, e)
            delivered = 0
        self._book_load(op, delivered)

    def _book_load(self, op: Any, delivered: int) -> None:
        if getattr(op, "report", False):
            # Answered as asynchronous (tpu-inference's DP scheduler): reported by request.
            self._loads_reported[op.req_id] = delivered >= len(op.block_ids)
        if delivered < len(op.block_ids):
            if getattr(op, "report", False):
                pass  # failed_recving names the request; block ids cannot name a DP rank's blocks
            elif getattr(op, "group_block_ids", None) is not None:
                self._load_errors.update(b for g in op.group_block_ids for b in g[delivered:] if b != NULL_BLOCK_ID)
            else:
                self._load_errors.update(op.block_ids[delivered:])
            self._report.failed_loads.add(op.req_id)
            self._report.load_delivered[op.req_id] = int(delivered)
            self.stats["failed_loads"] += 1
            self._record("failed_loads", 1)
        self.stats["loaded_blocks"] += delivered
        self._record("loaded_blocks", delivered)
        self._report.loaded_blocks += delivered
        lease = self._leases.pop(op.req_id, None)
        if lease is not None:
            _close(lease)

    def _pullers(self, placement: Dict[str, Any], s: Any) -> int:
        """How many decode ranks will pull request ``s`` from this worker's ranks (releases its
        registration waits for), or 0 where none will and this worker need not register it: a
        replica the consumers' plans do not read (:func:`compat.pullers_of_rank`; e.g. TP=4 ->
        1 of an MLA latent reads producer rank 0 only), whose staging would otherwise sit unused
        until the lease ends. The lowest producer rank always registers: a both-at-once consumer
        asks it to describe the request (:class:`_Deferred`)."""
        assert self.caches is not None
        jx = self.caches.jax
        # A JAX runner: every rank in this one endpoint, the consumer ranks that pull from any
        # of them (releases count consumer ranks, whatever endpoints they use); with DP, the
        # ranks of the request's replica.
        ranks = ((jx.replica_ranks(int(placement.get("dp_rank", 0))) if jx.dp > 1 else jx.ranks) if jx is not None
                 else [self.caches.tp_rank])
        n = compat.pullers_of_rank(placement, ranks, s.num_tokens, s.decode_tp)
        if n == 0 and all(r % self.geometry.tp for r in ranks):
            self.stats["register_skipped"] += 1
            log.debug("tpu_sync: transfer %s (%s): no decode rank of %d pulls from rank(s) %s; not registered",
                      s.xfer_id, s.req_id, s.decode_tp, list(ranks))
            return 0
        return max(1, n)

    def _register(self, s: Any) -> None:
        assert self.caches is not None
        cp = self.caches.copier
        try:
            placement = self._placement(s.block_ids)
            pullers = self._pullers(placement, s)
            if pullers == 0:
                self._sent.add(s.req_id)  # nothing staged: vLLM may free the blocks
                return
            try:
                if cp is not None:
                    if hasattr(cp, "map_request"):
                        # A JAX runner's state rows: the request's slot (still in the batch).
                        cp.map_request(s.req_id, s.block_ids)
                    # framework-copy: the device's blocks into the mirrors (per group with groups)
                    cp.stage(s.block_ids)
                self.transport.register(s.xfer_id, placement, s.num_tokens, s.lease_s, pullers)
            finally:
                if cp is not None:
                    cp.drop(_flat_ids(s.block_ids))  # staged by the endpoint (or failed)
            self.stats["registered"] += 1
        except Exception as e:  # the consumer's pull fails and it recomputes; blocks are freed
            log.error("tpu_sync: registering %s (transfer %s) failed: %s", s.req_id, s.xfer_id, e)
            self.stats["register_failed"] += 1
            self._refuse(s.xfer_id, f"the producer could not register request {s.req_id}: {e}")
        # The endpoint staged the blocks (or failed): vLLM may free them.
        self._sent.add(s.req_id)

    def _describe_peer(self, s: RecvSpec, dst: Dict[str, Any]) -> Optional[str]:
        """The producer endpoint a both-at-once pull asks for the request's placement: one of
        the producer ranks this worker's ranks read from (:func:`compat.source_ranks`), whose
        registration waits for this worker's release; with several producer ranks, another
        rank's registration may already be released by its own pullers when this one asks.
        None (the transport's first peer) where the planner cannot tell."""
        try:
            # The global ranks of this worker's buffers (a JAX runner's replica: its ranks).
            mine = list(self.caches.kv(dst.get("dp_rank")).keys()) if self.caches is not None else []
            for r in compat.source_ranks(s.src_layout, dst, s.num_tokens, mine):
                if r in s.peers:
                    return s.peers[r]
        except Exception as e:  # the first peer then (every rank of a one-endpoint producer)
            log.debug("tpu_sync: the producer ranks transfer %s reads from: %s", s.xfer_id, e)
        return None

    def _poll_starts(self) -> None:
        """Starts pulls not started yet (retrying while the producer does not know the request)."""
        assert self.caches is not None
        now = time.monotonic()
        for p in self._pulls.values():
            if p.handle is not None or now < p.next_try or now >= p.deadline:
                continue
            s = p.spec
            try:
                dst = self._placement(s.dst_block_ids, getattr(s, "first_token", 0), getattr(s, "next_token", None))
                src = None if s.src_block_ids is None else compat.placement(s.src_layout, s.src_block_ids)
                cp = self.caches.copier
                if cp is not None:
                    if self.geometry.groups:
                        p.ptrs = cp.before_write(s.dst_block_ids, s.num_tokens,
                                                 partial=_partial_blocks(self.geometry, s))
                    else:
                        p.ptrs = cp.before_write(s.dst_block_ids, s.num_tokens - getattr(s, "first_token", 0))
                if s.src_block_ids is None:
                    # Both-at-once: the producer's blocks are known once it registered.
                    # Its buffers are resolved here, on the model's thread: the pull starts on
                    # the describe thread, maybe while a forward replaces a JAX runner's arrays.
                    kv = None
                    if hasattr(self.transport, "buffers"):
                        kv = self.transport.buffers(dst["dp_rank"]) if self._dp > 1 else self.transport.buffers()
                    p.handle = _Deferred(self.transport, s, dst, p.deadline, kv, self._describe_peer(s, dst))
                    self.stats["pulls_deferred"] += 1
                elif self._pull_waits:
                    # The producer registers one engine step after the request finished: the pull
                    # waits for the registration (up to the pull's deadline) instead of failing.
                    p.handle = self.transport.pull(s.xfer_id, s.peers, src, dst, s.num_tokens,
                                                   wait_for_registration=max(0.0, p.deadline - now))
                else:
                    p.handle = self.transport.pull(s.xfer_id, s.peers, src, dst, s.num_tokens)
            except Exception as e:
                if _is_unknown_request(e):
                    p.next_try = now + UNKNOWN_REQUEST_RETRY_S
                else:
                    p.handle = _Failed(e)

    def wait_for_save(self, meta: Optional[TpuSyncMetadata]) -> None:
        """Saves this step's newly full prompt blocks to the host tier (synchronously: vLLM may
        reuse the blocks after the step). Layer-wise: publishes every layer of the step's
        registrations (those the hook did not), ends the step's pulls and host-tier loads."""
        meta = self._unpacked(meta)
        if self._layer_sends:
            assert self.caches is not None
            if self._sends_whole():
                for s in list(self._layer_sends.values()):
                    self._register(s)  # registered whole now (staged first where the framework copies)
                    self._sent.discard(s.req_id)  # handed off through the scheduler's handoffs
            else:
                self._publish(len(self.caches.names))
            self._layer_sends.clear()
        if self._layer_pulls:
            self._end_layer_pulls()
        if self._layer_load is not None:
            self._end_layer_loads()
        if self.tier is None or meta is None:
            return
        if self._saver is not None:
            # Asynchronous: queue the D2H and return; the blocks stay allocated (the scheduler
            # delays freeing a finished request's blocks until get_transfer_results reports
            # its saves done, and handle_preemptions waits for a preempted request's).
            cp = self._saver.copier
            for op in meta.saves:
                self._save_reqs.add(op.req_id)
                finish = None
                if cp is not None and self._saver.has_room(len(op.hashes)):
                    try:
                        finish = cp.stage_async(_op_ids(op))
                    except Exception as e:  # a failed save is a future miss
                        cp.drop(_op_ids(op))
                        self._book_save(op, 0, e)
                        continue
                if not self._saver.submit(op, finish):
                    self.stats["saves_dropped"] += len(op.hashes)
                    log.warning("tpu_sync: %d host-tier saves of %s dropped: %d blocks already queued (cap %d)",
                                len(op.hashes), op.req_id, self._saver.pending_blocks(),
                                self._saver.max_pending_blocks)
            return
        cp = self.caches.copier if self.caches is not None else None
        if cp is not None:
            self.caches.refresh()
        for op in meta.saves:
            if self.cfg.async_saves:
                # Synchronous here (the framework's copies), but the scheduler planned this save
                # as asynchronous and frees the request's blocks once it is reported.
                self._save_reqs.add(op.req_id)
            try:
                try:
                    if cp is not None:
                        cp.stage(_op_ids(op))  # framework-copy: the framework's D2H into the mirrors
                    n = _save(self.tier, op)
                finally:
                    if cp is not None:
                        cp.drop(_op_ids(op))
            except Exception as e:  # a failed save is a future miss
                self._book_save(op, 0, e)
                continue
            self._book_save(op, n, None)

    def get_transfer_results(self, finished_req_ids: Set[str]):
        """Registrations done (``finished_sending``), pulls done or failed (``finished_recving``,
        ``failed_recving``), pulls of aborted requests cancelled (``finished_recving``); ends
        host-tier leases of finished requests."""
        from ._api import KVConnectorTransferResults

        cp = self.caches.copier if self.caches is not None else None
        for req_id in finished_req_ids:
            lease = self._leases.pop(req_id, None)
            if lease is not None:
                _close(lease)
            if hasattr(cp, "forget"):
                cp.forget(req_id)  # a pulled state whose request ended before it had a slot
        res = KVConnectorTransferResults()
        for req_id, ok in self._loads_reported.items():
            res.finished_recving.add(req_id)
            if not ok:
                res.failed_recving.add(req_id)
        self._loads_reported.clear()
        staging = self._stager.busy() if self._stager is not None else set()
        if self._saver is not None or self._save_reqs or self._save_finished:
            # A finished request whose blocks had saves (the scheduler delayed freeing them,
            # ``async_saves``) is reported once they are all done, together with a registration
            # if it had one. Saves made synchronously (caches reached through the framework's
            # copies) are done already, but the scheduler still waits for the report.
            self._take_saves()
            self._save_finished.update(r for r in finished_req_ids if r in self._save_reqs)
            saver = self._saver
            ready = {r for r in self._sent | self._save_finished
                     if (saver is None or not saver.pending(r)) and r not in staging}
            self._sent -= ready
            self._save_finished -= ready
            self._save_reqs -= ready
            res.finished_sending = ready
        elif self._sent:
            # Blocks whose layers are still being staged stay with the request until then.
            res.finished_sending = self._sent - staging
            self._sent = self._sent & staging
        for req_id in finished_req_ids & self._pulls.keys():
            # Aborted while its KV was arriving: vLLM holds the blocks until we report the
            # request; stop writing into them first. Its blocks are no load error (it is gone).
            p = self._pulls.pop(req_id)
            delivered = p.handle is not None and p.handle.done and getattr(p.handle, "error", None) is None
            if p.handle is not None and not p.handle.done:
                _cancel(p.handle)
            if self.caches is not None and self.caches.copier is not None:
                self.caches.copier.drop(_flat_ids(p.spec.dst_block_ids))
            if not delivered:
                # It will never be pulled now: the producers free its KV at once.
                self._reject(RejectSpec(req_id, p.spec.xfer_id, p.spec.peers,
                                        f"request {req_id}: aborted while its KV was being pulled"))
            res.finished_recving.add(req_id)
            self.stats["pulls_cancelled"] += 1
        if self._pulls:
            self._poll_starts()
            if self._step_idle:
                self._step_idle = False
                self._idle_wait()
            now = time.monotonic()
            for req_id, p in list(self._pulls.items()):
                err = None
                if p.handle is None:
                    if now < p.deadline:
                        continue
                    err = TimeoutError(f"producer did not serve transfer {p.spec.xfer_id} within {p.spec.timeout_s} s")
                elif not p.handle.done:
                    if now < p.deadline:
                        continue
                    _cancel(p.handle)
                    err = TimeoutError(f"pull of transfer {p.spec.xfer_id} took over {p.spec.timeout_s} s")
                else:
                    err = getattr(p.handle, "error", None)
                    if err is not None and _is_unknown_request(err) and now < p.deadline:
                        # The producer registers one engine step after the request finished.
                        p.handle, p.next_try = None, now + UNKNOWN_REQUEST_RETRY_S
                        continue
                del self._pulls[req_id]
                res.finished_recving.add(req_id)
                cp = self.caches.copier if self.caches is not None else None
                if cp is not None:
                    err = self._land_copied_pull(cp, p, err)
                if err is None:
                    self.stats["pulls_done"] += 1
                    try:
                        st = p.handle.wait(0)
                    except Exception as e:  # stats are best effort
                        log.debug("tpu_sync: no stats of pull %s: %s", req_id, e)
                    else:
                        self._book_pull(req_id, st)
                    if isinstance(p.handle, _Deferred) and p.handle.described_after_s is not None:
                        self.stats["describe_us"] += int(p.handle.described_after_s * 1e6)
                else:
                    log.error("tpu_sync: pull for %s failed: %s", req_id, err)
                    self.stats["pulls_failed"] += 1
                    if self.xfer_stats is not None:
                        self.xfer_stats.record_failure(_error_kind(err))
                    res.failed_recving.add(req_id)
                    self._report.failed_pulls.add(req_id)  # vLLM 0.29 has no failed_recving
                    if self._dp == 1 and not (self.geometry.vllm_groups > 1 and reports_failed_recving()):
                        # (With DP the block ids are global: no rank's scheduler could read them;
                        # with several KV cache groups vLLM 0.32 refuses block-level errors:
                        # failed_recving names the request.)
                        self._load_errors.update(_flat_ids(p.spec.dst_block_ids))
                    # vLLM recomputes (or fails) it: the KV will not be pulled again.
                    self._reject(RejectSpec(req_id, p.spec.xfer_id, p.spec.peers,
                                            f"request {req_id}: its pull failed ({type(err).__name__}); recomputed"))
        return res

    def _idle_wait(self) -> None:
        """An engine step that computed nothing: waits up to ``idle_wait_ms`` for a pull to
        complete (a completion ends the wait at once), instead of letting vLLM spin through
        empty steps while the KV arrives."""
        budget = self.cfg.idle_wait_ms / 1000.0
        if budget <= 0:
            return
        waiting = [p.handle for p in self._pulls.values() if p.handle is not None]
        if any(h.done for h in waiting):
            return
        if waiting and hasattr(waiting[0], "wait"):
            try:
                waiting[0].wait(budget)  # the oldest pull; the others are looked at next step
            except Exception:  # still pending (PendingError), or failed: reported below
                pass
            self.stats["idle_waits"] += 1
        elif not waiting:
            time.sleep(budget)  # pulls waiting to retry (a producer that has not registered yet)
            self.stats["idle_waits"] += 1

    def _land_copied_pull(self, cp: Any, p: _Pull, err: Optional[BaseException]) -> Optional[BaseException]:
        """A finished pull into caches moved by the framework's copies (``after_write`` of
        :class:`tpu_sync.jax_kv.JaxKv` or :class:`tpu_sync.torch_kv.TorchKv`); the error that
        makes it a failed pull, if any."""
        ids = p.spec.dst_block_ids  # one list per KV cache group with groups (framework-copy of torch)
        if err is not None:
            cp.drop(_flat_ids(ids))
            return err
        try:
            self.caches.refresh()
            if hasattr(cp, "map_request"):
                # A JAX runner's state rows: written into the request's slot once it has one.
                cp.map_request(p.spec.req_id, ids)
                cp.after_write(ids, p.ptrs, req_id=p.spec.req_id)
            else:
                cp.after_write(ids, p.ptrs)
            return None
        except Exception as e:  # moved caches, a device error in the framework's copies: recomputed
            return e

    def _reject(self, r: RejectSpec) -> None:
        """Queues a reject for the background thread (it blocks on the network)."""
        if not hasattr(self.transport, "reject"):
            return
        if self._reject_thread is None:
            self._reject_thread = threading.Thread(target=self._send_rejects, name="tpu-sync-rejects", daemon=True)
            self._reject_thread.start()
        self._reject_queue.put(r)

    def _send_rejects(self) -> None:
        while True:
            r = self._reject_queue.get()
            if r is None:
                return
            transport = self.transport
            if transport is None:
                continue
            try:
                transport.reject(r.xfer_id, r.peers, r.reason)
                self.stats["rejects_sent"] += 1
            except Exception as e:  # a dead producer frees it at its lease expiry
                self.stats["rejects_failed"] += 1
                log.info("tpu_sync: reject of transfer %s (%s) failed: %s", r.xfer_id, r.req_id, e)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Blocks that a load or pull reported since the last call did not fill."""
        out, self._load_errors = self._load_errors, set()
        if out and self.geometry.vllm_groups > 1:
            # Only where vLLM has no failed_recving (0.29, vLLM-TorchTPU's base): its scheduler
            # reads these ids for one KV cache group only and raises for a model with several
            # (``_update_requests_with_invalid_blocks``: "TODO: add support for hybrid memory
            # allocator"). Said here, so the engine's error has its cause in the log.
            log.error("tpu_sync: %d blocks of a model with %d KV cache groups failed to load; this vLLM reads load "
                      "errors of one group only and will raise (vLLM >= 0.30 takes them by request: "
                      "docs/vllm.md, \"Hybrid models\")", len(out), self.geometry.vllm_groups)
        return out

    def _book_pull(self, req_id: str, st: Any) -> None:
        """Counts a finished pull's time and bytes (``pull_us``, vLLM's connector stats)."""
        try:
            self.stats["pull_us"] += int(float(st["elapsed_s"]) * 1e6)
            if self.xfer_stats is not None:
                self.xfer_stats.record_pull(st["elapsed_s"], st["bytes"])
        except Exception as e:  # stats are best effort
            log.debug("tpu_sync: no stats of pull %s: %s", req_id, e)

    def _record(self, key: str, n: int) -> None:
        if self.xfer_stats is not None and n:
            self.xfer_stats.add(key, n)

    def take_stats(self) -> Any:
        """This interval's :class:`~tpu_sync.vllm.stats.TpuSyncConnectorStats` (None when empty),
        for vLLM's ``get_kv_connector_stats``."""
        if self.xfer_stats is None or self.xfer_stats.is_empty():
            return None
        return self.xfer_stats.clone_and_reset()

    def flush_saves(self, timeout: float = SAVE_WAIT_S) -> bool:
        """Waits until every queued host-tier save is done and books them; False after
        ``timeout`` seconds. (Tools and tests that read the counters; the engine never needs
        it.)"""
        if self._saver is None:
            return True
        ok = self._saver.wait_idle(timeout)
        self._take_saves()
        return ok

    def build_worker_meta(self) -> Optional[TpuSyncWorkerMetadata]:
        """Lookup answers and counters of this step (None when there is nothing to say)."""
        self._take_saves()
        rep, self._report = self._report, TpuSyncWorkerMetadata()
        return None if rep.is_empty() else rep

    def shutdown(self) -> None:
        """Ends leases and pulls, closes the tier (a shm segment stays) and the endpoint."""
        for lease in self._leases.values():
            _close(lease)
        self._leases.clear()
        for p in list(self._pulls.values()) + list(self._layer_pulls.values()):
            if p.handle is not None:
                _cancel(p.handle)
        for p in self._pulls.values():
            if isinstance(p.handle, _Deferred):
                p.handle.join(1.0)  # it stops at its next step; the endpoint closes below
        self._pulls.clear()
        self._layer_pulls.clear()
        if self._layer_load is not None and self._layer_load.thread is not None:
            self._layer_load.thread.join()
        self._layer_load = None
        if self._saver is not None:
            # Queued saves finish before the tier closes (a warm restart finds them).
            if not self._saver.close(SAVE_WAIT_S):
                log.error("tpu_sync: host-tier saves still running at shutdown after %s s", SAVE_WAIT_S)
            self._saver = None
        if self._stager is not None:
            self._stager.close(SAVE_WAIT_S)
            self._stager = None
        if self._reject_thread is not None:
            self._reject_queue.put(None)
            self._reject_thread.join(timeout=max(1.0, self.cfg.pull_timeout_s))
            self._reject_thread = None
        for obj in (self.tier, self.transport):
            if obj is not None:
                try:
                    obj.close()
                except Exception as e:
                    log.warning("tpu_sync: close failed: %s", e)
        self.tier = self.transport = None
        cp = self.caches.copier if self.caches is not None else None
        if cp is not None:
            cp.close()  # the views and host mirrors (the caches themselves are the engine's)
        if self._views_owner is not None:
            self._views_owner.close()
            self._views_owner = None


class _Stager:
    """Stages (D2H) and publishes the layers of layer-wise registrations on its own thread, in
    submission order, so that a device copy never blocks the model's forward (a TPU's D2H is a
    DMA that runs beside the compute; on the CPU plugin it is a memcpy on the other core). The
    worker reports a request's blocks free (``finished_sending``) only once every queued
    publish of it ran (:meth:`busy`). A failed publish withdraws the registration (its pullers
    fail and recompute) and skips the request's later publishes. Thread-safe."""

    def __init__(self, transport: Any, stats: Dict[str, int]) -> None:
        self._transport, self._stats = transport, stats
        self._q: "queue.Queue[Any]" = queue.Queue()
        self._cv = threading.Condition()
        self._pending: Dict[int, int] = {}  # xfer id -> queued jobs
        self._req: Dict[int, str] = {}  # xfer id -> vLLM request id
        self._failed: Set[int] = set()
        self._queued: Dict[int, int] = {}  # xfer id -> layers queued (while jobs are pending)
        self._thread = threading.Thread(target=self._run, name="tpu-sync-stager", daemon=True)
        self._thread.start()

    def submit(self, xfer: int, req_id: str, layers: int) -> None:
        """Queues the publication of layers ``..layers`` of ``xfer`` (nothing if they were
        queued already)."""
        with self._cv:
            if xfer in self._failed or self._queued.get(xfer, 0) >= layers:
                return
            self._queued[xfer] = layers
            self._pending[xfer] = self._pending.get(xfer, 0) + 1
            self._req[xfer] = req_id
        self._q.put((xfer, req_id, layers))

    def busy(self) -> Set[str]:
        """Requests with publishes queued or running."""
        with self._cv:
            return {self._req[x] for x, n in self._pending.items() if n}

    def wait_xfer(self, xfer: int, timeout: float = SAVE_WAIT_S) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending.get(xfer), timeout)

    def close(self, timeout: float) -> None:
        self._q.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            xfer, req_id, layers = job
            with self._cv:
                skip = xfer in self._failed
            if not skip:
                try:
                    self._transport.publish_layers(xfer, layers)
                except Exception as e:
                    if _is_unknown_request(e):
                        # Its registration ended (every consumer released it, rejected it, or
                        # its lease passed): nothing left to publish to.
                        log.debug("tpu_sync: transfer %s of %s ended before layer %s was published: %s", xfer,
                                  req_id, layers, e)
                        self._mark_failed(xfer)
                        self._done(xfer)
                        continue
                    # Its pullers fail and recompute; vLLM frees the blocks.
                    log.error("tpu_sync: publishing layers of %s (transfer %s) failed: %s", req_id, xfer, e)
                    self._stats["publish_failed"] += 1
                    self._mark_failed(xfer)
                    try:
                        refuse = getattr(self._transport, "refuse", None)
                        if refuse is not None:  # its pullers fail at once, with the reason
                            refuse(xfer, f"the producer could not stage the layers of request {req_id}: {e}")
                        else:
                            self._transport.withdraw(xfer)
                    except Exception as e2:
                        log.debug("tpu_sync: withdrawing transfer %s failed: %s", xfer, e2)
            self._done(xfer)

    def _mark_failed(self, xfer: int) -> None:
        """Skips the request's later publishes."""
        with self._cv:
            if len(self._failed) >= 1024:  # ids of long-gone requests
                self._failed.clear()
            self._failed.add(xfer)

    def _done(self, xfer: int) -> None:
        with self._cv:
            self._pending[xfer] -= 1
            if not self._pending[xfer]:
                del self._pending[xfer]
                self._req.pop(xfer, None)
                self._queued.pop(xfer, None)
            self._cv.notify_all()


class _Deferred:
    """A both-at-once pull (``src_block_ids`` None): a thread asks the producer for the
    request's placement (``transport.describe``), again every 2-50 ms while the producer has
    not registered it (until ``deadline``), then starts the pull with it; the handle answers as
    the pull's once it started. The producer's token count must be the spec's. Thread-safe:
    :meth:`cancel` (the worker's thread) and the start (this object's thread) exclude each
    other, so a cancelled pull never starts writing into blocks vLLM may have freed. ``kv``:
    the destination buffers (``transport.buffers()``), resolved by the caller on the model's
    thread, since this object's thread may run while a forward replaces the caches (None: the
    transport resolves them itself). ``addr``: the producer endpoint asked
    (:meth:`WorkerSide._describe_peer`; None: the first peer's)."""

    def __init__(self, transport: Any, spec: RecvSpec, dst: Any, deadline: float, kv: Any = None,
                 addr: Optional[str] = None) -> None:
        self._transport, self._spec, self._dst, self._deadline = transport, spec, dst, deadline
        self._kv = kv
        #: the producer endpoint to ask (None: the first peer's)
        self._addr = addr
        self._lock = threading.Lock()
        self._cancelled = False
        self._inner: Any = None
        self._error: Optional[BaseException] = None
        #: set once the pull started or failed
        self._settled = threading.Event()
        #: seconds from creation until the producer described the request
        self.described_after_s: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name="tpu-sync-describe", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        with self._lock:
            if self._error is not None:
                return True
            inner = self._inner
        return inner is not None and bool(inner.done)

    @property
    def error(self) -> Optional[BaseException]:
        with self._lock:
            if self._error is not None:
                return self._error
            inner = self._inner
        return None if inner is None else getattr(inner, "error", None)

    def wait(self, timeout: float) -> Any:
        """The pull's :meth:`tpu_sync.Transfer.wait`, after waiting (within ``timeout``) for it
        to start. Raises TimeoutError while it has not started, the failure if it failed."""
        t0 = time.monotonic()
        if not self._settled.wait(timeout):
            raise TimeoutError("the producer has not described the request yet")
        with self._lock:
            inner, err = self._inner, self._error
        if inner is None:
            raise err if err is not None else TimeoutError("not started")
        return inner.wait(max(0.0, timeout - (time.monotonic() - t0)))

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            inner = self._inner
        if inner is not None:
            _cancel(inner)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            self._error = e

    def _run(self) -> None:
        try:
            self._start()
        except Exception as e:  # never leave the pull pending until its deadline
            self._fail(e)
        finally:
            self._settled.set()

    def _start(self) -> None:
        s = self._spec
        t0 = time.monotonic()
        addr = self._addr or (s.peers[min(s.peers)] if s.peers else None)
        if addr is None or not hasattr(self._transport, "describe"):
            self._fail(RuntimeError("this P/D transport cannot ask a producer for its placement "
                                    "(both-at-once requests need tpu_sync's endpoint)"))
            return
        delay = 0.002
        while True:
            with self._lock:
                if self._cancelled:
                    self._error = RuntimeError(f"pull of transfer {s.xfer_id} cancelled")
                    return
            try:
                src, n = self._transport.describe(s.xfer_id, addr)
                break
            except Exception as e:
                if not _is_unknown_request(e):
                    self._fail(e)
                    return
                if time.monotonic() + delay >= self._deadline:
                    self._fail(TimeoutError(f"producer {addr} did not register transfer {s.xfer_id} within "
                                            f"{s.timeout_s} s"))
                    return
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        self.described_after_s = time.monotonic() - t0
        if n != s.num_tokens:
            self._fail(ValueError(f"producer {addr} registered transfer {s.xfer_id} with {n} tokens, "
                                  f"this request expects {s.num_tokens}"))
            return
        with self._lock:
            if self._cancelled:
                self._error = RuntimeError(f"pull of transfer {s.xfer_id} cancelled")
                return
            try:
                kw = {} if self._kv is None else {"kv": self._kv}
                self._inner = self._transport.pull(s.xfer_id, s.peers, src, self._dst, s.num_tokens,
                                                   wait_for_registration=max(0.0, self._deadline - time.monotonic()),
                                                   **kw)
            except Exception as e:
                self._error = e


class _Failed:
    """A pull that failed to start."""

    done = True

    def __init__(self, error: BaseException, booked: bool = False) -> None:
        self.error = error
        #: its failure was already reported (layer-wise pulls)
        self.booked = booked

    def cancel(self) -> None:
        pass


def _scheduler_blocks(name: str, t: Any, want: Tuple[int, ...], g: KvGeometry) -> Tuple[Any, bool]:
    """vLLM's kernel pages smaller than the scheduler's block, seen as scheduler blocks.

    Where the attention kernel runs a fixed block size that the scheduler's block (vLLM's
    ``cache_config.block_size``, what the connector's block ids count) is a multiple of, vLLM
    splits each scheduler block ``b`` into kernel blocks ``b * s .. b * s + s - 1``, with
    ``s = block_size / kernel_block_size`` (``vllm/v1/worker/block_table.py``
    ``map_to_kernel_blocks``). vLLM-TorchTPU then allocates each layer's cache with ``num_blocks
    * s`` kernel blocks of ``kernel_block_size`` tokens (``kv_cache_materializer.py``
    ``make_attention_cache_tensor``, 0.29.0).

    Returns ``(tensor, logical)``:

    * the token-major caches (RPA v3, head_dim 64, the dense MLA latent) in one tensor:
      ``[num_blocks * s, kernel_block_size, ...]`` holds the same bytes as ``[num_blocks,
      block_size, ...]``: that zero-copy view, ``logical`` False;
    * the same caches as strided per-layer views of a block-major bundle (a scheduler block's
      ``s`` kernel pages of one layer lie a bundle row apart): ``[num_blocks, s,
      kernel_block_size, ...]``, ``logical`` True;
    * the ``SEQ_ALONG_LANE`` cache (``[num_blocks * s, 2H, D'/P, P, kernel_block_size]``, tokens
      along each kernel page's lanes): ``[num_blocks, 2H, D'/P, P, s, kernel_block_size]``, the
      order of a ``block_size``-token block's elements, ``logical`` True.

    A logical view's elements are in the order of the scheduler block's layout, but not its
    bytes: only the framework's own copies (``framework-copy``, into contiguous host mirrors
    that then hold exactly those blocks) can move it. Any other tensor is returned unchanged
    (``logical`` False), and the caller's shape check names what it expected.

    Raises:
        ValueError: kernel pages of a bundle that cannot be split into scheduler blocks."""
    shape = tuple(int(d) for d in t.shape)
    if len(shape) != 1 + len(want) or shape[1:] == want:
        return t, False
    if g.is_sal:
        kernel = shape[-1]
        if (shape[2:-1] == want[1:-1] and shape[1] == want[0] and 0 < kernel < want[-1] and want[-1] % kernel == 0
                and shape[0] % (want[-1] // kernel) == 0):
            split = want[-1] // kernel
            # [N * s, 2H, D'/P, P, k] -> [N, 2H, D'/P, P, s, k]: token s_i * k + j of a block.
            return t.unflatten(0, (shape[0] // split, split)).permute(0, 2, 3, 4, 1, 5), True
        return t, False
    if not (g.is_rpa3 or g.kv_order == compat.MLA_ORDER):
        return t, False  # LBHNC: its second axis is heads, not tokens
    rows = shape[1]
    if shape[2:] != want[1:] or not 0 < rows < want[0] or want[0] % rows or shape[0] % (want[0] // rows):
        return t, False
    split = want[0] // rows
    try:
        return t.view((shape[0] // split,) + want), False
    except RuntimeError:
        pass
    try:
        # Strided (a bundle's per-layer view): the s kernel pages of a block as one logical block.
        return t.unflatten(0, (shape[0] // split, split)), True
    except RuntimeError as e:
        raise ValueError(f"TpuSyncConnector: layer {name}'s kernel pages ({list(shape)}, strides {list(t.stride())}) "
                         f"cannot be seen as scheduler blocks of {g.block_size} tokens: {e}") from None


def _state_tensors(t: Any) -> List[Any]:
    """A state layer's tensors: vLLM-TorchTPU's tuple (one tensor per state shape), or vLLM's
    CPU engine's one raw tensor."""
    return list(t) if isinstance(t, (list, tuple)) else [t]


def _state_buffer_dtype(group: Dict[str, Any]) -> str:
    """The tpu_sync dtype a state group's layer buffers are viewed in (as :func:`_state_view`):
    the components' dtype when they share one that divides the slot stride, else ``u8``."""
    dtypes = {c["dtype"] for c in group["state"]["components"]}
    if len(dtypes) == 1:
        dt = next(iter(dtypes))
        name = {"fp8": "f8e4m3fn"}.get(dt, dt)  # the buffer dtype names (tpu_sync.arrays)
        size = {"f32": 4, "bf16": 2, "f16": 2, "f8e4m3fn": 1}.get(name)
        if size and int(group["slot_bytes"]) % size == 0:
            return name
    return "u8"


def _state_dense_bytes(group: Dict[str, Any], tp: int) -> List[int]:
    """Bytes per slot of each component of a state group (``state.components``) on one of
    ``tp`` ranks."""
    return compat.state_rank_bytes(group["state"], tp)


def _check_raw_state(name: str, t: Any, group: Dict[str, Any], num_slots: int, tp: int) -> None:
    """A raw state tensor (vLLM's CPU engine: ``[blocks, 1, 1, dense state bytes]``) moved by
    torch's copies: at least ``num_slots`` blocks of exactly the group's dense state bytes.

    Raises:
        ValueError: naming the layer."""
    dense = sum(_state_dense_bytes(group, tp))
    got = int(t[0].numel()) * int(t.element_size()) if t.dim() and int(t.shape[0]) else 0
    if t.dim() < 2 or int(t.shape[0]) < num_slots or got != dense:
        raise ValueError(f"TpuSyncConnector: state layer {name} is {t.dtype}{list(t.shape)}: {got} B a block; its "
                         f"MambaSpec group needs {num_slots} blocks of {dense} B of state")


def _check_state_tensors(name: str, t: Any, group: Dict[str, Any], num_slots: int, tp: int) -> None:
    """Checks one state layer's registration against its state group: a tuple of tensors
    (vLLM-TorchTPU's per-layer caches: ``torch.zeros((num_blocks, *shape), dtype)`` per state
    shape) must have the group's components, one tensor each, in order, with their dtypes and
    bytes per block, over ``num_slots`` blocks; one raw tensor (vLLM's CPU engine) is checked by
    :func:`_state_view` (or, moved by torch's copies, by its dense bytes).

    Raises:
        ValueError: naming the layer, the component and what differs."""
    comps = group["state"]["components"]
    want = _state_dense_bytes(group, tp)
    ts = _state_tensors(t)
    if not isinstance(t, (list, tuple)):
        if t.dim() and int(t.shape[0]) >= num_slots and int(t[0].numel()) * int(t.element_size()) == sum(want):
            return
        if getattr(getattr(t, "device", None), "type", "cpu") != "cpu":
            raise ValueError(f"TpuSyncConnector: state layer {name} is {t.dtype}{list(t.shape)}: its blocks hold "
                             f"{int(t[0].numel()) * int(t.element_size()) if t.dim() else 0} B, its MambaSpec group's "
                             f"state {sum(want)} B")
        return  # a CPU page pool: _state_view checks it
    if len(ts) != len(comps):
        raise ValueError(f"TpuSyncConnector: state layer {name} registered {len(ts)} tensors; its MambaSpec group has "
                         f"{len(comps)} state shapes")
    for j, (x, c, nb) in enumerate(zip(ts, comps, want)):
        got = int(x[0].numel()) * int(x.element_size()) if x.dim() else 0
        if (compat.TORCH_TO_TPU_SYNC_DTYPE.get(str(x.dtype)) != c["dtype"] or got != nb or x.dim() < 2
                or int(x.shape[0]) != num_slots):
            raise ValueError(f"TpuSyncConnector: state layer {name}: tensor {j} is {x.dtype}{list(x.shape)}; its "
                             f"MambaSpec group needs {c['dtype']} [{num_slots}, ...] of {nb} B a block")


def _state_view(name: str, t: Any, group: Dict[str, Any], num_slots: int, tp: int) -> Any:
    """A dense tensor ``[num_slots, slot_bytes / size]`` over the memory of vLLM's state tensor
    ``t`` of one Mamba layer (the CPU backend registers it as raw bytes ``[blocks, 1, 1, dense
    state bytes]`` with a block stride of ``slot_bytes``, ``MambaSpec.page_size_padded``), of
    the components' dtype when they share one that divides the stride, else uint8: the buffer
    shape tpu_sync's state groups check (``GroupRankKv::shape``). Zero-copy (same storage).

    Raises:
        ValueError: a block stride other than the group's slot stride, fewer dense bytes per
            block than the state's components, or a storage too short for ``num_slots`` slots."""
    import torch

    slot = int(group["slot_bytes"])
    comps = group["state"]["components"]
    dense = sum(_state_dense_bytes(group, tp))
    esz = int(t.element_size())
    stride = int(t.stride(0)) * esz if t.dim() else 0
    per_block = int(t[0].numel()) * esz if t.dim() and int(t.shape[0]) else 0
    if t.dim() < 1 or int(t.shape[0]) < num_slots or stride != slot or per_block < dense:
        raise ValueError(f"TpuSyncConnector: state layer {name} is {t.dtype}{list(t.shape)} with a block stride of "
                         f"{stride} B; its MambaSpec group needs {num_slots} slots of {slot} B holding {dense} B "
                         f"of state")
    dtypes = {c["dtype"] for c in comps}
    torch_of = {v: k for k, v in compat.TORCH_TO_TPU_SYNC_DTYPE.items()}
    dt = torch.uint8
    if len(dtypes) == 1:
        cand = getattr(torch, torch_of[next(iter(dtypes))].replace("torch.", ""))
        if slot % torch.empty(0, dtype=cand).element_size() == 0:
            dt = cand
    dsz = torch.empty(0, dtype=dt).element_size()
    storage = t.untyped_storage()
    off = int(t.storage_offset()) * esz
    if off % dsz or off + num_slots * slot > storage.nbytes():
        raise ValueError(f"TpuSyncConnector: state layer {name}: its storage holds {storage.nbytes()} B from offset "
                         f"{off}, {num_slots} slots need {num_slots * slot} B")
    view = torch.empty(0, dtype=dt, device=t.device)
    view.set_(storage, off // dsz, (num_slots, slot // dsz), (slot // dsz, 1))
    return view


def _error_kind(e: BaseException) -> str:
    """A bounded label for a failed pull: the tpu_sync error's class (``PeerClosedError`` ->
    ``peer_closed``), ``timeout`` for the connector's own deadline, else ``other``."""
    import re

    try:
        from tpu_sync import errors as te

        if isinstance(e, te.TpuSyncError):
            name = type(e).__name__
            return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name[:-5] if name.endswith("Error") else name).lower()
    except Exception:  # pragma: no cover
        pass
    return "timeout" if isinstance(e, TimeoutError) else "other"


def _layer_block_ids(op: Any, caches: KvCaches) -> List[List[Optional[int]]]:
    """The block each cache layer's part of ``op``'s tier entries goes to, per layer: ``op.block_ids``
    for a uniform model; with KV cache groups (``op.group_block_ids``) layer ``l``'s are its
    group's ids, None where the group holds vLLM's null block (not written).

    Raises:
        ValueError: group lists that disagree with the layers' groups or ``op.block_ids``;
        IndexError: a block id out of range."""
    n_layers = len(caches.names)
    gids = getattr(op, "group_block_ids", None)
    if gids is None:
        ids = [int(b) for b in op.block_ids]
        per = [ids] * n_layers
    else:
        groups = caches.layer_group or [0] * n_layers
        if len(gids) != max(groups) + 1 or any(len(g) != len(op.block_ids) for g in gids):
            raise ValueError(f"block ids per group {[len(g) for g in gids]} for {max(groups) + 1} groups and "
                             f"{len(op.block_ids)} blocks")
        per = [[None if int(b) == NULL_BLOCK_ID else int(b) for b in gids[groups[layer]]] for layer in range(n_layers)]
    for ids in per:
        for b in ids:
            if b is not None and not 0 <= b < caches.num_blocks:
                raise IndexError(f"block id {b} out of range 0..{caches.num_blocks}")
    return per


def _runner_state_slot(runner: Any, req_id: str) -> Optional[int]:
    """A request's device state slot in a tpu-inference runner (``mamba_cache_mode="none"``:
    ``input_batch.mamba_state_indices_cpu`` at the request's index, a global slot id, assigned
    when the request enters the persistent batch, ``runner/input_batch.py`` 0.32.0 ``add_request``),
    or that kept by a request out of the batch for a step (``runner.requests[req_id].
    mamba_state_slot``), else None (0 is the null slot)."""
    batch = getattr(runner, "input_batch", None)
    index = getattr(batch, "req_id_to_index", None) or {}
    i = index.get(req_id)
    if i is not None:
        slot = int(batch.mamba_state_indices_cpu[i])
    else:
        # Out of the batch for a step but keeping its slot (persistent_batch_manager.py
        # update_states keeps it in the request's state).
        state = (getattr(runner, "requests", None) or {}).get(req_id)
        slot = getattr(state, "mamba_state_slot", None)
        if slot is None:
            return None
        slot = int(slot)
    return slot if slot > 0 else None


def _runner_layer_arrays(runner: Any, g: KvGeometry) -> List[int]:
    """The index in ``runner.kv_caches`` of each cache layer's array, for a model with KV cache
    groups: tpu-inference's ``runner.layer_name_to_kvcache_index`` (``runner/kv_cache_manager.py``
    0.32.0, ``initialize_kv_cache``: the layers at one position of every attention group may
    share one array), its layer names in cache-layer order (vLLM's numbering of the groups'
    layers); layers that reuse another layer's cache (``runner.shared_kv_cache_layers``, not in
    vLLM's groups) are left out.

    Raises:
        ValueError: a runner without that map, or whose layers are not the groups' layers."""
    index = getattr(runner, "layer_name_to_kvcache_index", None)
    if not isinstance(index, dict) or not index:
        raise ValueError("TpuSyncConnector: a JAX runner of a model with KV cache groups needs "
                         "runner.layer_name_to_kvcache_index (tpu-inference) to find each layer's cache")
    shared = set(getattr(runner, "shared_kv_cache_layers", None) or ())
    names = compat.layer_order([n for n in index if n not in shared])
    if len(names) != g.num_layers:
        raise ValueError(f"TpuSyncConnector: the runner maps {len(names)} layers to KV caches, the model's KV cache "
                         f"groups have {g.num_layers}")
    return [int(index[n]) for n in names]


def _partial_blocks(g: KvGeometry, s: Any) -> List[List[int]]:
    """Per KV cache group, the blocks of a grouped pull ``s`` that it writes only in part, whose
    other token slots a framework copy must keep: the last block when the request ends inside
    it, and a sliding-window group's first block when the window (tokens ``next_token + 1 - w``
    on, ``next_token`` the pull's or ``num_tokens``: :meth:`KvGeometry.held_blocks`) starts
    inside it."""
    out: List[List[int]] = []
    bs = g.block_size
    first_token = int(getattr(s, "first_token", 0))
    nxt = getattr(s, "next_token", None)
    nxt = int(s.num_tokens) if nxt is None else min(int(nxt), int(s.num_tokens))
    for gi, ids in enumerate(s.dst_block_ids):
        ids = [int(b) for b in ids if int(b) != NULL_BLOCK_ID]
        keep: List[int] = []
        if ids and not g.is_state_group(gi):
            w = g.groups[gi].get("sliding_window") if g.groups else None
            start = max(first_token, nxt + 1 - int(w)) if w else first_token
            if start > 0 and start % bs:
                keep.append(ids[0])
            if int(s.num_tokens) % bs and ids[-1] not in keep:
                keep.append(ids[-1])
        out.append(keep)
    return out


def _op_ids(op: Any) -> Any:
    """The blocks a :class:`~tpu_sync.vllm.metadata.TierOp` copies, as the framework-copy
    adapters take them: one list per KV cache group with groups, else its block ids."""
    gids = getattr(op, "group_block_ids", None)
    return gids if gids is not None else op.block_ids


def _flat_ids(ids: Any) -> List[int]:
    """Block ids of a spec: a list, or one list per KV cache group (vLLM's groups share one
    block pool, so the ids are distinct; their null blocks left out)."""
    from tpu_sync import _check

    return _check.flat_block_ids(ids)


def _is_unknown_request(e: BaseException) -> bool:
    try:
        from tpu_sync.errors import UnknownRequestError
    except Exception:  # pragma: no cover
        return False
    return isinstance(e, UnknownRequestError)


def _close(lease: Any) -> None:
    try:
        lease.close()
    except Exception as e:
        log.debug("tpu_sync: closing a lease failed: %s", e)


def _cancel(handle: Any) -> None:
    try:
        handle.cancel()
    except Exception as e:
        log.debug("tpu_sync: cancelling a pull failed: %s", e)
