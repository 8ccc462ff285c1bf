"""SGLang P/D disaggregation transfer backend ``tpu_sync``: prefill and decode exchange KV through
:class:`tpu_sync.Endpoint`, resharded when their TP sizes differ.

Selected with ``--disaggregation-transfer-backend tpu_sync`` on both engines (the
``tpu_sync`` plugin adds the choice; no SGLang file is edited, see
:func:`tpu_sync.sglang.pd_hooks.install_hooks`).

The classes derive from SGLang's ``disaggregation/common/conn.py`` (bootstrap server, rank
mapping, ZMQ control sockets, timeouts, heartbeats, failure records, abort notifications) and
add the data plane:

1. **Decode** (:class:`TpuSyncKVReceiver`): ``init`` resolves the prefill ranks through the
   bootstrap server and registers this rank once per prefill rank (its ZMQ address, TP rank and
   size, KV geometry). ``send_metadata(kv_indices, aux_index)`` sends every target prefill rank
   the request's destination pages and metadata row.
2. **Prefill** (:class:`TpuSyncKVSender`): ``send(kv_indices)`` collects the pages of each
   chunk; after the last chunk a worker thread registers the request with its
   :class:`tpu_sync.Endpoint` (``register``: the pages of every layer are copied D2H into the
   endpoint's staging, so SGLang may free them once the room reports ``Success``), with as many
   expected releases as decode ranks pull from this rank (from the reshard plan,
   :class:`tpu_sync.Plan`), and sends each decode rank a ``READY`` message: the endpoint
   address, the source placement, and the request's metadata row (first output token,
   logprobs, ...) with its CRC-32.
3. **Decode**, once every target prefill rank is ready: one :meth:`tpu_sync.Endpoint.pull` from
   the prefill ranks that hold this rank's KV heads, written in place into the request's pages
   (zero-copy views of SGLang's device buffers), resharded from the prefill's placement to this
   engine's. Every byte is checked against the library's checksums in transit. When the pull
   has landed, the metadata row is written and the room reports ``Success``.

**Failures are explicit.** A failed pull (peer closed, timeout, checksum, unknown request), a
registration that fails, a lost prefill (SGLang's heartbeat to the bootstrap server), a
geometry mismatch or a waiting timeout marks the room ``KVPoll.Failed`` with its reason, and
``failure_exception()`` raises it, so SGLang aborts the request. A room never reports
``Success`` before its pull completed, and a pull still in flight when its room fails or is
cleared is cancelled and waited for before SGLang may reuse the pages.

**Layouts.** The KV of an SGLang MHA pool is ``2 * L`` buffers (``K_0..K_{L-1}``,
``V_0..V_{L-1}``), each ``[pages, page_size, heads, head_dim]`` (MLA: ``L`` latent buffers).
To tpu_sync this is a model of ``2 * L`` layers with one plane, TP over the model's KV heads,
block = page, order ``nhd`` (:func:`layout_of`). A rank's placement lists its page ids (the
same on every TP rank, as in SGLang).

Environment (both roles): ``TPU_SYNC_SGLANG_PD_TIMEOUT_S`` (endpoint connect/progress timeout,
default 30), ``TPU_SYNC_SGLANG_PD_LEASE_S`` (how long a prefill keeps an unpulled request
staged, default 600), ``TPU_SYNC_SGLANG_PD_TRANSPORT`` (``tcp`` by default: plain TCP, no
authentication, for trusted networks; ``tls`` or ``quic`` with
``TPU_SYNC_SGLANG_PD_PSK_HEX``), and SGLang's own ``SGLANG_HOST_IP`` (the address both the
ZMQ sockets and the endpoint bind to), ``SGLANG_DISAGGREGATION_*`` timeouts and heartbeats.

Not handled (refused at start-up with a clear error): hybrid models (state pools), speculative
draft KV, PP, attention CP/DCP, KV cache sharding, decode host destinations, decode-side
radix-cache prefixes (``decode_prefix_len > 0``), the ``prefill_complete`` allocation policy.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from . import stats
from ._devpool import DevicePool, UnsupportedPoolError

log = logging.getLogger("tpu_sync.sglang")

from .pd_hooks import BACKEND  # noqa: E402  (``--disaggregation-transfer-backend`` value)

REG_TAG = b"TPS_REG"
META_TAG = b"TPS_META"
READY_TAG = b"TPS_READY"
STATUS_TAG = b"TPS_STATUS"

_MAX_RID = (1 << 53) - 1

# Bounds on what peers' messages can make this process keep (issue 24): registered decode
# peers, rooms with metadata waiting for the prefill's request, decode ranks per room, and the
# prefill ranks a READY may name. Past them a message is refused (logged; the room fails).
MAX_DECODE_PEERS = 4096
MAX_PENDING_ROOMS = 65536
MAX_RANKS = 1024


def aux_copies(data: bytes, lens: Any, item_lens: List[int], data_lens: Optional[List[int]],
               aux_index: int) -> List[Tuple[int, int, int, int]]:
    """The copies of one metadata row from a prefill's READY message into this decode's
    metadata buffers: ``(buffer, dst_offset, src_offset, nbytes)`` per buffer, after checking
    every length and index that came from the wire: ``lens`` (the prefill's item bytes per
    buffer) must be non-negative ints equal to ``item_lens`` (ours) for each of our buffers;
    ``data`` must hold all of them (no read past its end); ``aux_index`` must be a row of each
    buffer (``data_lens``: each buffer's total bytes, when known). Raises ``ValueError``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"metadata row is {type(data).__name__}, not bytes")
    if not isinstance(lens, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in lens):
        raise ValueError("metadata item lengths must be a list of ints")
    if not isinstance(aux_index, int) or aux_index < 0:
        raise ValueError(f"metadata row index {aux_index!r} is not a row")
    out = []
    at = 0
    for i, mine in enumerate(item_lens):
        if i >= len(lens):
            break
        n = lens[i]
        if n != mine:
            raise ValueError(f"metadata buffer {i}: prefill item {n} bytes, decode {mine}")
        if data_lens is not None and i < len(data_lens) and (aux_index + 1) * n > int(data_lens[i]):
            raise ValueError(f"metadata row {aux_index} is outside buffer {i} ({data_lens[i]} bytes of "
                             f"{n}-byte rows)")
        if at + n > len(data):
            raise ValueError(f"metadata row of {len(data)} bytes is shorter than its items "
                             f"({at + n} bytes by buffer {i})")
        out.append((i, n * aux_index, at, n))
        at += n
    return out


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v else default


def request_id_of(room: int) -> int:
    """The tpu_sync request id of bootstrap room ``room`` (``1 .. 2^53-1``; the same on every
    rank of both engines)."""
    return int(room) % _MAX_RID + 1


def layout_of(geometry: Dict[str, Any], tp: int, num_pages: int) -> Dict[str, Any]:
    """The tpu_sync layout of an engine's KV (see the module docs). ``geometry``:
    :meth:`TpuSyncKVManager.geometry`."""
    import tpu_sync

    model = tpu_sync.model("sglang", num_layers=int(geometry["buffers"]), num_kv_heads=int(geometry["kv_heads"]),
                           head_dim=int(geometry["head_dim"]), kv_planes=1, dtype=str(geometry["dtype"]))
    return tpu_sync.layout(model, tp=int(tp), block_size=int(geometry["page_size"]), order="nhd",
                           num_blocks=int(num_pages))


def placement_of(layout: Dict[str, Any], pages: List[int]) -> Dict[str, Any]:
    """Placement of a request whose pages ``pages`` are the same on every TP rank."""
    import tpu_sync

    tp = int(layout["spec"]["tp"])
    return tpu_sync.placement(layout, [list(map(int, pages)) for _ in range(tp)])


def pull_pairs(src: Dict[str, Any], dst: Dict[str, Any], num_tokens: int) -> Dict[int, List[int]]:
    """Destination rank -> the source ranks it pulls from (the reshard plan's pairs)."""
    import tpu_sync

    plan = tpu_sync.Plan(src, dst, int(num_tokens))
    try:
        out: Dict[int, set] = {}
        for s in plan.spans():
            out.setdefault(int(s.dst_rank), set()).add(int(s.src_rank))
        return {d: sorted(v) for d, v in out.items()}
    finally:
        plan.close()


class _PdUnsupported(RuntimeError):
    pass


# ---- prefill-side records -------------------------------------------------------------------


@dataclass
class _DecodePeer:
    """One decode rank registered with this prefill rank (its ``TPS_REG`` message)."""

    ip: str
    port: int
    tp_rank: int
    tp_size: int
    geometry: Dict[str, Any]
    mismatch: Optional[str] = None


@dataclass
class _TransferInfo:
    """One decode rank's destination for a room (its ``TPS_META`` message). ``endpoint``,
    ``dst_port``, ``is_dummy`` and ``required_dst_info_num`` are the names SGLang's common code
    reads (``_room_notify_targets``, ``resolve_kv_replica_factor``)."""

    room: int
    endpoint: str
    dst_port: int
    tp_rank: int
    pages: np.ndarray
    aux_index: Optional[int]
    required_dst_info_num: int
    is_dummy: bool
    decode_prefix_len: int = 0


@dataclass
class _PrefillRoom:
    chunks: List[Tuple[int, np.ndarray]] = field(default_factory=list)
    total: Optional[int] = None
    aux_index: Optional[int] = None
    registered: bool = False
    events: List[Any] = field(default_factory=list)


# ---- decode-side records --------------------------------------------------------------------


@dataclass
class _DecodeRoom:
    pages: np.ndarray
    aux_index: int
    expected: int
    ready: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    transfer: Any = None
    closed: bool = False


class TpuSyncKVManager(CommonKVManager):
    """Per-rank transfer state of one engine (prefill or decode); see the module docs.

    The device KV pool arrives through :meth:`attach` (the plugin calls it right after SGLang
    builds the manager in ``_init_kv_manager``); control messages received before are handled
    once it has.

    Raises:
        UnsupportedPoolError, RuntimeError: a configuration this backend does not handle.
    """

    kv_status_msg_tag = STATUS_TAG
    kv_status_msg_carries_reason = True
    reports_transfer_latency = False

    def __init__(self, args: Any, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: Optional[bool] = False) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._check_supported(args)
        import tpu_sync

        self._lock = threading.RLock()
        self._attached = threading.Event()
        self.dev: Optional[DevicePool] = None
        self._geometry: Optional[Dict[str, Any]] = None
        self._views: List[Any] = []
        self.counters: Dict[str, int] = dict(registrations=0, registered_bytes=0, ready_sent=0, pulls=0,
                                             pulls_done=0, pull_bytes=0, pull_failures=0, meta_received=0,
                                             failures=0)
        kw: Dict[str, Any] = dict(timeout=_env_float("TPU_SYNC_SGLANG_PD_TIMEOUT_S", 30.0),
                                  transport=os.environ.get("TPU_SYNC_SGLANG_PD_TRANSPORT", "tcp"),
                                  name=f"sglang-{disaggregation_mode.value}-{self.local_ip}-{self.rank_port}")
        # A busy engine can starve the endpoint's threads for seconds; a dead peer closes its
        # sockets and is seen at once, so the silence limit is generous (docs/sglang.md).
        hb = _env_float("TPU_SYNC_SGLANG_PD_HEARTBEAT_TIMEOUT_S", 30.0)
        kw.update(heartbeat_timeout=hb, heartbeat_interval=min(1.0, hb / 5))
        psk = os.environ.get("TPU_SYNC_SGLANG_PD_PSK_HEX")
        if psk:
            kw["psk"] = bytes.fromhex(psk)
        if disaggregation_mode == DisaggregationMode.PREFILL:
            kw["listen"] = f"{self.local_ip}:0"
            kw["lease_s"] = _env_float("TPU_SYNC_SGLANG_PD_LEASE_S", 600.0)
            self.endpoint = tpu_sync.Endpoint(**kw)
            self.endpoint_address = str(self.endpoint.address)
            self._decode_peers: Dict[Tuple[str, int], _DecodePeer] = {}
            self._prefill_rooms: Dict[int, _PrefillRoom] = {}
            self._work: "queue.Queue[Optional[int]]" = queue.Queue()
            threading.Thread(target=self._prefill_control_loop, daemon=True, name="tpu-sync-pd-control").start()
            threading.Thread(target=self._prefill_worker, daemon=True, name="tpu-sync-pd-register").start()
        else:
            kw["listen"] = None
            self.endpoint = tpu_sync.Endpoint(**kw)
            self.endpoint_address = ""
            self._decode_rooms: Dict[int, _DecodeRoom] = {}
            threading.Thread(target=self._decode_control_loop, daemon=True, name="tpu-sync-pd-control").start()
            self._start_heartbeat_checker_thread()
        log.info("tpu_sync.sglang P/D: %s rank %d/%d, endpoint %s", disaggregation_mode.value, self.attn_tp_rank,
                 self.attn_tp_size, self.endpoint_address or "(client)")

    # ---- set-up ------------------------------------------------------------------------------

    def _check_supported(self, args: Any) -> None:
        from sglang.srt.runtime_context import get_disagg, get_parallel

        why = []
        if getattr(args, "state_types", None):
            why.append(f"state pools {[getattr(s, 'value', s) for s in args.state_types]} (hybrid models)")
        if int(getattr(args, "num_draft_entries", 0) or 0):
            why.append("speculative draft KV")
        if self.pp_size > 1:
            why.append("PP > 1")
        if self.attn_cp_size > 1 or self.dcp_size > 1:
            why.append("attention CP / DCP")
        if self.kv_shard_size > 1:
            why.append("KV cache sharding")
        if self.defer_decode_allocation:
            why.append("--disaggregation-decode-allocation-policy prefill_complete")
        if get_disagg().disaggregation_decode_host_receive_threshold < 1:
            why.append("decode host KV destinations")
        if getattr(get_parallel(), "enable_cp_tp_group_sharing", False):
            why.append("CP-TP group sharing")
        if why:
            raise _PdUnsupported("tpu_sync P/D backend does not handle: " + "; ".join(why))

    def attach(self, queue_obj: Any) -> None:
        """Takes the device KV pool from SGLang's bootstrap/prealloc queue (``token_to_kv_pool``,
        ``draft_token_to_kv_pool``, ``scheduler.model_config``) and makes the zero-copy views.

        Raises:
            UnsupportedPoolError: the pool is not a full-attention MHA/MLA pool, or a draft pool
                is present.
        """
        if getattr(queue_obj, "draft_token_to_kv_pool", None) is not None:
            raise UnsupportedPoolError("tpu_sync P/D backend: speculative draft KV is not handled")
        dev = DevicePool(queue_obj.token_to_kv_pool)
        heads = int(queue_obj.scheduler.model_config.get_total_num_kv_heads()) if not dev.mla else 1
        expected = max(1, heads // self.attn_tp_size) if not dev.mla else 1
        if dev.heads != expected:
            raise UnsupportedPoolError(f"tpu_sync P/D backend: {dev.heads} KV heads on this rank, expected {expected} "
                                       f"({heads} heads over TP={self.attn_tp_size})")
        if dev.page_size != int(self.kv_args.page_size):
            raise UnsupportedPoolError("tpu_sync P/D backend: pool page size differs from kv_args.page_size")
        self.dev = dev
        self._geometry = dict(buffers=dev.planes * dev.layers, planes=dev.planes, layers=dev.layers, kv_heads=heads,
                              head_dim=dev.head_dim, dtype=dev.layout_dtype, page_size=dev.page_size,
                              mla=dev.mla, num_pages=dev.num_pages)
        self._views = dev.typed_views()
        self._attached.set()
        self._publish()

    def geometry(self) -> Dict[str, Any]:
        """This engine's KV geometry (buffers, planes, layers, total KV heads, head_dim, dtype,
        page size)."""
        self._attached.wait()
        assert self._geometry is not None
        return dict(self._geometry)

    def layout(self, tp: Optional[int] = None) -> Dict[str, Any]:
        assert self.dev is not None
        return layout_of(self.geometry(), self.attn_tp_size if tp is None else tp, self.dev.num_pages)

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counters[k] = self.counters.get(k, 0) + int(v)
        self._publish()

    def _publish(self) -> None:
        stats.publish(f"pd-{self.disaggregation_mode.value}", self.snapshot)

    def snapshot(self) -> Dict[str, Any]:
        """Counters, the endpoint's :meth:`tpu_sync.Endpoint.stats`, role, TP rank and size."""
        with self._lock:
            out: Dict[str, Any] = dict(self.counters, role=self.disaggregation_mode.value, tp_rank=self.attn_tp_rank,
                                       tp_size=self.attn_tp_size)
        try:
            out["endpoint"] = self.endpoint.stats()
        except Exception:
            pass
        return out

    def _fail(self, room: int, reason: str) -> None:
        log.error("tpu_sync.sglang P/D: room %s failed: %s", room, reason)
        self._count(failures=1)
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self.conclude_failure(bootstrap_room=room, failure_reason=reason)
        else:
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)

    # ---- decode -> prefill messages (built on decode) ------------------------------------------

    def build_receiver_registration_message(self) -> List[bytes]:
        return [REG_TAG, self.local_ip.encode("ascii"), str(self.rank_port).encode("ascii"),
                str(self.kv_args.engine_rank).encode("ascii"), str(self.attn_tp_size).encode("ascii"),
                json.dumps(self.geometry()).encode()]

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int, kv_indices: Any,
                                        aux_index: Optional[int], state_indices: Optional[List],
                                        decode_prefix_len: Optional[int], is_dummy: bool,
                                        device_kv_indices: Any = None) -> List[bytes]:
        pages = np.asarray(kv_indices, dtype=np.int32)
        return [META_TAG, str(bootstrap_room).encode("ascii"), self.local_ip.encode("ascii"),
                str(self.rank_port).encode("ascii"), str(self.kv_args.engine_rank).encode("ascii"),
                b"" if is_dummy else pages.tobytes(), b"" if is_dummy or aux_index is None else str(aux_index).encode(),
                str(required_dst_info_num).encode("ascii"), b"1" if is_dummy else b"0",
                str(int(decode_prefix_len or 0)).encode("ascii")]

    # ---- prefill side ---------------------------------------------------------------------------

    def _prefill_control_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while True:
            try:
                msg = recv()
                if msg is None:
                    continue
                self._attached.wait()
                if msg[0] == REG_TAG:
                    self._on_register(msg)
                elif msg[0] == META_TAG:
                    self._on_meta(msg)
                elif msg[0] == ABORT_TAG:
                    self._on_abort(msg)
                else:
                    log.warning("tpu_sync.sglang P/D: dropping an unknown control message (%d frames)", len(msg))
            except Exception as e:  # a malformed message must not stop the control thread
                log.error("tpu_sync.sglang P/D: control message failed: %s", e)

    def _on_register(self, msg: List[bytes]) -> None:
        ip, port = msg[1].decode("ascii"), int(msg[2])
        peer = _DecodePeer(ip=ip, port=port, tp_rank=int(msg[3]), tp_size=int(msg[4]), geometry=json.loads(msg[5]))
        mine = self.geometry()
        diff = [f"{k}: prefill {mine[k]!r}, decode {peer.geometry.get(k)!r}" for k in
                ("buffers", "planes", "layers", "kv_heads", "head_dim", "dtype", "page_size", "mla")
                if peer.geometry.get(k) != mine[k]]
        if diff:
            peer.mismatch = "KV geometry differs between prefill and decode: " + "; ".join(diff)
            log.error("tpu_sync.sglang P/D: decode %s:%d: %s", ip, port, peer.mismatch)
        if not (0 < port < 65536 and 0 <= peer.tp_rank < peer.tp_size <= MAX_RANKS):
            raise ValueError(f"decode registration {ip}:{port} with TP rank {peer.tp_rank} of {peer.tp_size}")
        with self._lock:
            if (ip, port) not in self._decode_peers and len(self._decode_peers) >= MAX_DECODE_PEERS:
                raise ValueError(f"decode registration {ip}:{port} refused: {MAX_DECODE_PEERS} decode peers "
                                 "are registered")
            self._decode_peers[(ip, port)] = peer

    def _on_meta(self, msg: List[bytes]) -> None:
        room = int(msg[1])
        ip, port = msg[2].decode("ascii"), int(msg[3])
        is_dummy = msg[8] == b"1"
        info = _TransferInfo(room=room, endpoint=ip, dst_port=port, tp_rank=int(msg[4]),
                             pages=np.frombuffer(msg[5], dtype=np.int32).copy(),
                             aux_index=int(msg[6]) if msg[6] else None, required_dst_info_num=int(msg[7]),
                             is_dummy=is_dummy, decode_prefix_len=int(msg[9]))
        if not 1 <= info.required_dst_info_num <= MAX_RANKS:
            raise ValueError(f"room {room}: {info.required_dst_info_num} decode ranks announced")
        self._count(meta_received=1)
        with self._lock:
            if room not in self.transfer_infos and len(self.transfer_infos) >= MAX_PENDING_ROOMS:
                raise ValueError(f"room {room} refused: {MAX_PENDING_ROOMS} rooms are waiting")
            if len(self.transfer_infos.get(room, {})) >= info.required_dst_info_num and \
                    (ip, port) not in self.transfer_infos.get(room, {}):
                raise ValueError(f"room {room}: more decode ranks than the {info.required_dst_info_num} announced")
            infos = self.transfer_infos.setdefault(room, {})
            infos[(ip, port)] = info
            complete = len(infos) == info.required_dst_info_num
            peer = self._decode_peers.get((ip, port))
        if peer is None:
            self._fail(room, f"decode {ip}:{port} sent metadata without registering first")
            return
        if peer.mismatch:
            self._fail(room, peer.mismatch)
            return
        if info.decode_prefix_len:
            self._fail(room, "tpu_sync P/D backend does not handle decode-side prefixes (decode radix cache)")
            return
        if complete:
            self.req_to_decode_prefix_len[room] = 0
            self.update_status(room, KVPoll.WaitingForInput)

    def _on_abort(self, msg: List[bytes]) -> None:
        note = AbortNotification.from_zmq(msg)
        if note is None:
            return
        room = note.room
        status = self.request_status.get(room)
        if status is not None and status != KVPoll.Success:
            self.record_failure(room, "Aborted by the decode instance")
            self.update_status(room, KVPoll.Failed)
        with self._lock:
            r = self._prefill_rooms.get(room)
            registered = r is not None and r.registered
        if registered:
            # Pulls in progress fail; the staging is released now instead of at the lease.
            self.endpoint.unregister(request_id_of(room))

    def add_transfer_request(self, bootstrap_room: int, kv_indices: Any, index_slice: slice, is_last_chunk: bool,
                             aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                             num_kv_tokens: Optional[int] = None, *, wait_event: Any = None,
                             indices_event: Any = None, trace_ctx: Any = None) -> None:
        """Called by :meth:`CommonKVSender.send` for every chunk: records the chunk's pages; the
        last chunk queues the registration."""
        room = bootstrap_room
        if room not in self.request_status or self.check_status(room) == KVPoll.Failed:
            return
        if state_indices:
            self._fail(room, "tpu_sync P/D backend does not handle state pools")
            return
        with self._lock:
            r = self._prefill_rooms.setdefault(room, _PrefillRoom())
            r.chunks.append((int(index_slice.start or 0), np.asarray(kv_indices, dtype=np.int64).copy()))
            for ev in (wait_event, indices_event):
                if ev is not None:
                    r.events.append(ev)
            if is_last_chunk:
                r.total = int(index_slice.stop)
                r.aux_index = aux_index
        if is_last_chunk:
            self._work.put(room)

    def _prefill_worker(self) -> None:
        while True:
            room = self._work.get()
            if room is None:
                return
            try:
                self._register_room(room)
            except Exception as e:
                self._fail(room, f"tpu_sync registration failed: {type(e).__name__}: {e}")

    def _register_room(self, room: int) -> None:
        with self._lock:
            r = self._prefill_rooms.get(room)
            infos = dict(self.transfer_infos.get(room, {}))
        if r is None or r.total is None:
            return
        if room not in self.request_status or self.check_status(room) == KVPoll.Failed:
            return
        all_pages = np.full(r.total, -1, dtype=np.int64)
        for start, idx in r.chunks:
            if start + len(idx) > r.total:
                raise RuntimeError(f"room {room}: a chunk ends at page {start + len(idx)} of {r.total}")
            all_pages[start:start + len(idx)] = idx
        if (all_pages < 0).any():
            raise RuntimeError(f"room {room}: {int((all_pages < 0).sum())} of {r.total} pages were never sent")
        for ev in r.events:
            sync = getattr(ev, "synchronize", None)
            if sync is not None:
                sync()
        pages = [int(p) for p in all_pages]
        num_tokens = len(pages) * self.dev.page_size
        src = placement_of(self.layout(), pages)
        real = [i for i in infos.values() if not i.is_dummy]
        pullers = 0
        for info in real:
            with self._lock:
                peer = self._decode_peers.get((info.endpoint, info.dst_port))
            if peer is None or peer.mismatch:
                raise RuntimeError(peer.mismatch if peer else "decode rank not registered")
            if len(info.pages) != len(pages):
                raise RuntimeError(f"prefill has {len(pages)} pages for the request, decode rank {info.tp_rank} "
                                   f"announced {len(info.pages)}")
            dst = placement_of(layout_of(peer.geometry, peer.tp_size, int(peer.geometry["num_pages"])),
                               [int(p) for p in info.pages])
            if self.attn_tp_rank in pull_pairs(src, dst, num_tokens).get(info.tp_rank, []):
                pullers += 1
        rid = request_id_of(room)
        if pullers:
            kv = {self.attn_tp_rank: self._views}
            try:
                self.endpoint.register(rid, src, num_tokens, kv, expected_releases=pullers)
            except Exception as e:
                if self.endpoint.registration_state(rid) == "active":
                    # A stale registration of an earlier request with this room: replace it.
                    self.endpoint.unregister(rid)
                    self.endpoint.register(rid, src, num_tokens, kv, expected_releases=pullers)
                else:
                    raise e
            with self._lock:
                r.registered = True
            self._count(registrations=1, registered_bytes=num_tokens * self.dev.row_bytes * len(self._views))
        aux = self._read_aux(r.aux_index)
        frames = [READY_TAG, str(room).encode("ascii"), str(self.attn_tp_rank).encode("ascii"),
                  self.endpoint_address.encode("ascii"), b"1" if pullers else b"0",
                  json.dumps(dict(placement=src, num_tokens=num_tokens)).encode(), aux[0],
                  json.dumps(aux[1]).encode(), str(zlib.crc32(aux[0])).encode("ascii")]
        for info in infos.values():
            self._send_multipart_locked(f"tcp://{info.endpoint}:{info.dst_port}", frames)
            self._count(ready_sent=1)
        self.update_status(room, KVPoll.Success)

    def _read_aux(self, aux_index: Optional[int]) -> Tuple[bytes, List[int]]:
        """The request's metadata row: every aux buffer's item ``aux_index``, concatenated, and
        the item lengths."""
        import ctypes

        if aux_index is None:
            return b"", []
        lens = [int(n) for n in self.kv_args.aux_item_lens]
        parts = [ctypes.string_at(int(p) + n * int(aux_index), n) for p, n in zip(self.kv_args.aux_data_ptrs, lens)]
        return b"".join(parts), lens

    def forget_prefill_room(self, room: int) -> None:
        with self._lock:
            self._prefill_rooms.pop(room, None)

    # ---- decode side ----------------------------------------------------------------------------

    def expect(self, room: int, pages: Any, aux_index: Optional[int], expected: int) -> None:
        """Records a room's destination before its metadata goes out (decode)."""
        with self._lock:
            self._decode_rooms[room] = _DecodeRoom(pages=np.asarray(pages, dtype=np.int64).copy(),
                                                   aux_index=-1 if aux_index is None else int(aux_index),
                                                   expected=int(expected))

    def _decode_control_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while True:
            try:
                msg = recv()
                if msg is None:
                    continue
                self._attached.wait()
                if msg[0] == READY_TAG:
                    self._on_ready(msg)
                    continue
                if self.handle_abort_ack_message(msg):
                    continue
                parsed = self.parse_kv_status_message(msg)
                if parsed is None:
                    continue
                room, status, prefill_rank, reason = parsed
                self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=prefill_rank,
                                          failure_reason=reason)
            except Exception as e:
                log.error("tpu_sync.sglang P/D: control message failed: %s", e)

    def _on_ready(self, msg: List[bytes]) -> None:
        room, rank = int(msg[1]), int(msg[2])
        body = json.loads(msg[5])
        ready = dict(address=msg[3].decode("ascii"), registered=msg[4] == b"1", placement=body["placement"],
                     num_tokens=int(body["num_tokens"]), aux=bytes(msg[6]), aux_lens=json.loads(msg[7]),
                     crc=int(msg[8]))
        bad = None
        with self._lock:
            r = self._decode_rooms.get(room)
            if r is None or r.closed:
                return
            if not isinstance(ready["aux_lens"], list):
                bad = f"READY from prefill rank {rank} without a list of metadata lengths"
            elif not 0 <= rank < MAX_RANKS or (rank not in r.ready and len(r.ready) >= r.expected):
                bad = (f"READY from prefill rank {rank}, but {r.expected} ranks are expected and "
                       f"{sorted(r.ready)} answered")
            else:
                r.ready[rank] = ready
            start = bad is None and len(r.ready) == r.expected and r.transfer is None
        if bad is not None:
            self._fail(room, bad)
            return
        if not start:
            return
        try:
            self._start_pull(room, r)
        except Exception as e:
            self._fail(room, f"tpu_sync pull could not start: {type(e).__name__}: {e}")

    def _start_pull(self, room: int, r: _DecodeRoom) -> None:
        status = self.request_status.get(room)
        if status is None or status == KVPoll.Failed:
            return
        readies = list(r.ready.values())
        first = readies[0]
        for other in readies[1:]:
            if other["placement"]["block_ids"] != first["placement"]["block_ids"] or \
                    other["num_tokens"] != first["num_tokens"]:
                raise RuntimeError("prefill ranks disagree on the request's pages")
        src = first["placement"]
        num_tokens = first["num_tokens"]
        pages = [int(p) for p in r.pages]
        if len(pages) * self.dev.page_size != num_tokens:
            raise RuntimeError(f"decode announced {len(pages)} pages, prefill sent {num_tokens} tokens "
                               f"of {self.dev.page_size}-token pages")
        dst = placement_of(self.layout(), pages)
        me = int(self.kv_args.engine_rank)
        sources = pull_pairs(src, dst, num_tokens).get(me, [])
        peers = {}
        for s in sources:
            rd = r.ready.get(s)
            if rd is None or not rd["registered"]:
                raise RuntimeError(f"prefill rank {s} holds KV heads of decode rank {me} but did not register them")
            peers[s] = rd["address"]
        aux = next((x for x in readies if x["aux"]), None)
        if aux is not None and zlib.crc32(aux["aux"]) != aux["crc"]:
            raise RuntimeError("the request's metadata row failed its CRC-32")
        if not peers:
            raise RuntimeError(f"no prefill rank holds KV heads of decode rank {me}")
        t = self.endpoint.pull(request_id_of(room), peers, src, dst, num_tokens, {me: self._views})
        with self._lock:
            r.transfer = t
            closed = r.closed
        if closed:
            self._stop(t)
            return
        self.update_status(room, KVPoll.Transferring)
        self._count(pulls=1)
        t.add_done_callback(lambda tr, room=room, aux=aux: self._pull_done(room, tr, aux))

    def _pull_done(self, room: int, t: Any, aux: Optional[Dict[str, Any]]) -> None:
        err = t.error
        if err is not None:
            self._count(pull_failures=1)
            self._fail(room, f"tpu_sync pull failed: {type(err).__name__}: {err}")
            return
        with self._lock:
            r = self._decode_rooms.get(room)
            if r is None or r.closed:
                return
        try:
            if aux is not None:
                self._write_aux(r.aux_index, aux["aux"], aux["aux_lens"])
        except Exception as e:
            self._fail(room, f"writing the request's metadata row failed: {e}")
            return
        self._count(pulls_done=1, pull_bytes=int(t.wait(0)["device_bytes"]) if t.done else 0)
        self.update_status(room, KVPoll.Success)

    def _write_aux(self, aux_index: int, data: bytes, lens: List[int]) -> None:
        import ctypes

        mine = [int(n) for n in self.kv_args.aux_item_lens]
        self.check_peer_aux_buffer_count("prefill", len(lens))
        totals = getattr(self.kv_args, "aux_data_lens", None)
        totals = [int(n) for n in totals] if totals is not None else None
        view = memoryview(data)
        for i, dst, at, n in aux_copies(data, lens, mine, totals, aux_index):
            src = (ctypes.c_char * n).from_buffer_copy(view[at:at + n])
            ctypes.memmove(int(self.kv_args.aux_data_ptrs[i]) + dst, src, n)

    @staticmethod
    def _stop(t: Any) -> None:
        if t is None:
            return
        try:
            if not t.done:
                t.cancel()
            t.wait()
        except Exception:
            pass

    def close_room(self, room: int) -> None:
        """Decode: stops the room's pull (cancelled and waited for) before SGLang reuses its
        pages, and forgets the room."""
        with self._lock:
            r = self._decode_rooms.get(room)
            if r is not None:
                r.closed = True
        if r is not None:
            self._stop(r.transfer)
            with self._lock:
                if self._decode_rooms.get(room) is r:
                    del self._decode_rooms[room]

    def stop_failed_pull(self, room: int) -> None:
        """Decode: a failed room's pull must not write any more."""
        with self._lock:
            r = self._decode_rooms.get(room)
            t = None if r is None else r.transfer
        if t is not None and not t.done:
            self._stop(t)


class TpuSyncKVSender(CommonKVSender):
    """Prefill side of one request (see the module docs)."""

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_prefill_room(self.bootstrap_room)


class TpuSyncKVReceiver(CommonKVReceiver):
    """Decode side of one request (see the module docs)."""

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE,
                      device_kv_indices: Any = None) -> None:
        mgr: TpuSyncKVManager = self.kv_mgr
        if destination != KVTransferDestination.DEVICE or decode_prefix_len or state_indices:
            mgr.record_failure(self.bootstrap_room, "tpu_sync P/D backend: only whole-request device KV "
                               "destinations are handled (no host destination, decode prefix or state pools)")
            mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        infos = getattr(self, "bootstrap_infos", None)
        if infos:
            mgr.expect(self.bootstrap_room, kv_indices, aux_index, expected=len(infos))
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, destination,
                              device_kv_indices)

    def poll(self) -> KVPoll:
        status = super().poll()
        if status == KVPoll.Failed:
            self.kv_mgr.stop_failed_pull(self.bootstrap_room)
        return status

    def abort(self) -> None:
        self.kv_mgr.stop_failed_pull(self.bootstrap_room)
        super().abort()

    def failure_exception(self) -> None:
        self.kv_mgr.close_room(self.bootstrap_room)
        super().failure_exception()

    def clear(self) -> None:
        self.kv_mgr.close_room(self.bootstrap_room)
        super().clear()


class TpuSyncKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's common HTTP bootstrap server (rank table, health), run by the prefill engine."""


__all__ = ["BACKEND", "TpuSyncKVBootstrapServer", "TpuSyncKVManager", "TpuSyncKVReceiver", "TpuSyncKVSender",
           "layout_of", "placement_of", "pull_pairs", "request_id_of"]
