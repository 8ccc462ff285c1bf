"""The network data plane: an :class:`Endpoint` serves registered requests and pulls or pushes
KV blocks between serving instances, resharded in transit; each pull or push is a
:class:`Transfer`."""

from __future__ import annotations

import json
import warnings
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from . import _check as ck
from ._lib import AsyncOp, Handle, check, json_out, out_string
from ._native import ffi, lib
from .client import Buffer, Client
from .errors import InvalidArgumentError

#: Names of ``tpu_sync_source_state`` values (:meth:`Endpoint.registration_state`).
SOURCE_STATES = {0: "active", 1: "released", 2: "expired", 3: "peer_lost", 4: "unregistered", 5: "shutdown",
                 6: "unknown", 7: "rejected"}

#: Largest request id (ids must survive JSON as doubles).
MAX_REQUEST_ID = (1 << 53) - 1

Peers = Union[str, Mapping[int, str]]
Kv = Mapping[int, Sequence[Buffer]]


class Transfer(AsyncOp):
    """A pull, push or expected push: :attr:`done`, :meth:`wait`, :meth:`cancel`,
    :meth:`add_done_callback`, :attr:`error`, :attr:`layers_complete`.

    ``wait`` returns ``{"bytes", "spans", "pairs", "stripes", "device_bytes", "elapsed_s"}``
    (``bytes``: payload moved over the network by this side; ``device_bytes``: copied between
    the KV buffers and staging, H2D for pulls and expected pushes, D2H for pushes) plus the
    :attr:`report` keys. A failed transfer raises its typed error (``PeerClosedError``,
    ``TimeoutError``, ``ChecksumError``, ``RemoteError``, ``UnknownRequestError``,
    ``CancelledError``, ...) and is never reported as done successfully. Closing an unfinished
    transfer cancels it and waits for it to end.
    """

    _free = lib.tpu_sync_transfer_free
    _poll = lib.tpu_sync_transfer_poll
    _wait = lib.tpu_sync_transfer_wait
    _cancel = lib.tpu_sync_transfer_cancel
    _set_callback = lib.tpu_sync_transfer_set_callback
    _stats_type = "tpu_sync_transfer_stats"

    def _stats_dict(self, s) -> Dict[str, Any]:
        d = {"bytes": int(s.bytes), "spans": int(s.spans), "pairs": int(s.pairs), "stripes": int(s.stripes),
             "device_bytes": int(s.device_bytes), "elapsed_s": int(s.elapsed_ns) / 1e9}
        for k, v in self.report.items():
            d.setdefault(k, v)
        return d

    @property
    def report(self) -> Dict[str, Any]:
        """What the completed transfer did: ``staged_bytes`` (pinned staging), ``device_bytes``,
        ``device_ops``, ``device_s``, ``net_bytes``, ``spans``, ``pairs``, ``stripes``, ``net_s``,
        ``elapsed_s`` and ``dma_map`` (``"mapped"``, ``"skipped: <reason>"`` on plugins without
        DMA mapping such as the XLA CPU plugin, or ``"disabled"``).

        Raises: PendingError while it runs; its error if it failed."""
        return json_out(lib.tpu_sync_transfer_report, self._handle())

    @property
    def layers_complete(self) -> int:
        """Leading layers received and verified so far (receiving transfers)."""
        d, n = ffi.new("bool *"), ffi.new("uint32_t *")
        check(lib.tpu_sync_transfer_poll(self._handle(), d, n))
        return int(n[0])

    @property
    def layers_written(self) -> int:
        """Leading layers written into the destination buffers so far (H2D): layer by layer for
        :meth:`Endpoint.pull` with ``layerwise=True``, all at the end otherwise; pushes write
        none. A layer counted here holds its final bytes."""
        w = ffi.new("uint32_t *")
        check(lib.tpu_sync_transfer_layers(self._handle(), ffi.NULL, w))
        return int(w[0])

    def wait_layers(self, layers: int, timeout: Optional[float] = None) -> bool:
        """Blocks until the first ``layers`` layers are written into the destination buffers
        (or the transfer completed), at most ``timeout`` seconds (None: no limit; 0: do not
        block). Returns True once they are, False when the time passed first (the transfer
        continues).

        Raises: the transfer's typed error when it failed first (layers written before the
        failure hold their final bytes); InvalidArgumentError inside a completion callback."""
        n = ck.u32("layers", layers)
        ms = -1 if timeout is None else min(int(ck.number("timeout", timeout, lo=0.0) * 1000), ck.I64_MAX)
        st = lib.tpu_sync_transfer_wait_layers(self._handle(), n, ms)
        if st == lib.TPU_SYNC_PENDING:
            return False
        check(st)
        return True


def _peers(p: Peers, name: str = "peers") -> bytes:
    """``"ADDR"``, or ``{rank: "ADDR"}``, as the native peer-map string."""
    if isinstance(p, str):
        return ck.cstr(name, p)
    if not isinstance(p, Mapping):
        raise ck.fail(f"{name} must be an address string or a {{rank: address}} dict, got {type(p).__name__}")
    if not p:
        raise ck.fail(f"empty peer map ({name})")
    parts = []
    for r, a in p.items():
        r = ck.u32(f"{name} rank", r)
        a = ck.text(f"{name}[{r}]", a)
        if "," in a or "=" in a:
            raise ck.fail(f"{name}[{r}] = {a!r} is not an address")
        parts.append(f"{r}={a}")
    return ck.cstr(name, ",".join(parts))


def _placement(p: Any, name: str = "placement") -> bytes:
    return ck.json_text(name, p)


def _check_id(request_id: Any, name: str = "request_id") -> int:
    rid = ck.integer(name, request_id, 0, ck.U64_MAX)
    if not 1 <= rid <= MAX_REQUEST_ID:
        raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"request id {rid} must be in 1..2^53-1")
    return rid


def _kv(kv: Kv):
    """(ranks array, rank-major buffer handles array, number of ranks, layers, keepalive)."""
    if not isinstance(kv, Mapping):
        raise ck.fail(f"kv must be a {{rank: [layer buffers]}} dict, got {type(kv).__name__}")
    items = sorted((ck.u32("kv rank", r), ck.items(f"kv[{r!r}]", bufs)) for r, bufs in kv.items())
    if not items:
        raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, "kv names no rank")
    layers = len(items[0][1])
    for r, bufs in items:
        if len(bufs) != layers:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT,
                                       f"rank {r} has {len(bufs)} layer buffers, rank {items[0][0]} has {layers}")
        for b in bufs:
            if not isinstance(b, Buffer):
                raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"rank {r}: {type(b).__name__} is not a Buffer")
    ranks = ffi.new("uint32_t[]", [r for r, _ in items])
    handles = ffi.new("tpu_sync_buffer *[]", [b._handle() for _, bufs in items for b in bufs] or [ffi.NULL])
    keep = [b for _, bufs in items for b in bufs]
    return ranks, ffi.cast("const tpu_sync_buffer *const *", handles), len(items), layers, (handles, keep)


class Endpoint(Handle):
    """One process's presence on the network: a listener that serves registered requests and
    accepts pushes (when ``listen`` is set) and a client side that pulls and pushes.

    Args:
        listen: ``"IP:PORT"`` to listen on (port 0: any free port; see :attr:`address`); None for
            a client-only endpoint.
        transport: ``"tcp"`` (plain TCP: no authentication, trusted networks only), ``"tls"``
            (TLS 1.3 over TCP), ``"quic"`` (both need ``tls`` or ``psk``) or ``"shm"`` (peers on
            this host: the receiver copies the sender's staged bytes once, out of its memory;
            plain TCP to other hosts; no authentication).
        tls: ``{"cert": path, "key": path, "ca": path}`` (optionally ``"server_name"``): mutual
            authentication by certificates signed by the CA.
        psk: a pre-shared key (bytes) both sides know, instead of certificates.
        name: endpoint name, unique per live process (peers recognise restarts by it).
        timeout: seconds allowed to connect, to handshake, and for any read or write to progress.
        client: accepted for symmetry with the other classes; the endpoint itself needs no PJRT
            client (the buffers passed to each call carry theirs).
        heartbeat_interval, heartbeat_timeout: seconds between heartbeats, and of silence after
            which a peer is declared dead (its transfers fail, its leases end).
        lease_s: how long a registration is kept without a live consumer (endpoint-wide).
        count_releases_by_rank: what :meth:`register`'s ``expected_releases`` counts on this
            (producer) endpoint. False (default): consumer endpoints, one per delivered
            release. True: consumer TP ranks; a delivered release counts the destination ranks
            this endpoint served that consumer completely, and a reject ends the registration,
            so consumers with one endpoint per rank and consumers with one endpoint for all
            ranks (a JAX runner) are counted alike.
        lane_idle_timeout: seconds after which a data lane this endpoint serves that carries no
            request is closed (default 120); as a client it reuses a pooled lane for half of it,
            so give peers the same value.
        chunk_bytes, streams_per_pair, max_lanes_per_peer: network tuning (see the Rust docs).
        quic_connections_per_peer: QUIC only, connections opened to each peer (>= 1; default 2).
        hash_encrypted_frames: TLS and QUIC only: also checksum (xxh3-64) every data frame, as
            plain TCP always does (default None: off, since TLS 1.3 and QUIC authenticate every
            byte with their AEAD already).
        max_inbound_lanes: inbound sockets/streams served at once (default 4096); a connection
            beyond it is closed at once and counted in ``stats()["lanes_refused"]``.
        staging_budget_bytes: this endpoint's own budget of pinned staging bytes (registrations,
            pushes and the destination staging of pulls). Default None: the process-wide budget,
            a quarter of the memory the process may use capped by ``RLIMIT_MEMLOCK`` (or
            ``$TPU_SYNC_STAGING_BUDGET_BYTES``). A call past it raises
            ``StagingExhaustedError`` at once; nothing already staged is touched.
        staging_wait: seconds a call waits for budget before ``StagingExhaustedError`` (default
            None: it fails at once).
        dma_map: DMA-map staging with the buffers' PJRT client where the plugin supports it
            (default True; the XLA CPU plugin does not: see ``stats()["dma_skipped"]``).
        wait_for_registration: seconds a pull waits for a producer that does not know the
            request yet (default None: it fails with ``UnknownRequestError``); per call with
            :meth:`pull`'s argument of the same name.
        staging_pool_bytes: keep up to this many bytes of ended operations' staging arenas
            (pre-faulted, locked, DMA-mapped) for reuse by later ones (default None: 256 MiB;
            0 turns the pool off). Idle arenas count in ``stats()["staging_budget"]["used_bytes"]``
            (see ``stats()["staging_pool"]``) and are freed when the budget needs the room.

    Raises:
        InvalidArgumentError (options), IOError (address in use, unreadable credential files).
    """

    _free = lib.tpu_sync_endpoint_free

    def __init__(self, *, listen: Optional[str] = "127.0.0.1:0", transport: str = "tcp",
                 tls: Optional[Dict[str, str]] = None, psk: Optional[bytes] = None, name: Optional[str] = None,
                 timeout: float = 30.0, client: Optional[Client] = None,
                 heartbeat_interval: Optional[float] = None, heartbeat_timeout: Optional[float] = None,
                 lease_s: Optional[float] = None, chunk_bytes: Optional[int] = None,
                 streams_per_pair: Optional[int] = None, max_lanes_per_peer: Optional[int] = None,
                 max_inbound_lanes: Optional[int] = None, staging_budget_bytes: Optional[int] = None,
                 staging_wait: Optional[float] = None, dma_map: Optional[bool] = None,
                 wait_for_registration: Optional[float] = None,
                 staging_pool_bytes: Optional[int] = None,
                 quic_connections_per_peer: Optional[int] = None,
                 lane_idle_timeout: Optional[float] = None,
                 count_releases_by_rank: Optional[bool] = None,
                 hash_encrypted_frames: Optional[bool] = None) -> None:
        self._ptr = None
        cfg: Dict[str, Any] = {"transport": ck.text("transport", transport),
                               "timeout_s": ck.number("timeout", timeout, positive=True)}
        if listen is not None:
            cfg["listen"] = ck.text("listen", listen)
        if tls is not None:
            if not isinstance(tls, Mapping):
                raise ck.fail(f"tls must be a dict of paths, got {type(tls).__name__}")
            cfg["tls"] = {ck.text("tls key", k): ck.path(f"tls[{k!r}]", v).decode() for k, v in tls.items()}
        if psk is not None:
            if not isinstance(psk, (bytes, bytearray, memoryview)):
                raise ck.fail(f"psk must be bytes, got {type(psk).__name__}")
            cfg["psk_hex"] = bytes(psk).hex()
        if client is not None:
            ck.instance("client", client, Client)
        if count_releases_by_rank is not None:
            cfg["count_releases_by_rank"] = ck.flag("count_releases_by_rank", count_releases_by_rank)
        for k, v in dict(heartbeat_interval_s=heartbeat_interval, heartbeat_timeout_s=heartbeat_timeout,
                         lease_ttl_s=lease_s, staging_wait_s=staging_wait,
                         wait_for_registration_s=wait_for_registration,
                         lane_idle_timeout_s=lane_idle_timeout).items():
            if v is not None:
                cfg[k] = ck.number(k, v, positive=True)
        for k, v in dict(chunk_bytes=chunk_bytes, staging_budget_bytes=staging_budget_bytes,
                         staging_pool_bytes=staging_pool_bytes).items():
            if v is not None:
                cfg[k] = ck.u64(k, v)
        for k, v in dict(streams_per_pair=streams_per_pair, max_lanes_per_peer=max_lanes_per_peer,
                         max_inbound_lanes=max_inbound_lanes,
                         quic_connections_per_peer=quic_connections_per_peer).items():
            if v is not None:
                cfg[k] = ck.u32(k, v)
        if name is not None:
            cfg["name"] = ck.text("name", name)
        if dma_map is not None:
            cfg["dma_map"] = ck.flag("dma_map", dma_map)
        if hash_encrypted_frames is not None:
            cfg["hash_encrypted_frames"] = ck.flag("hash_encrypted_frames", hash_encrypted_frames)
        out = ffi.new("tpu_sync_endpoint **")
        check(lib.tpu_sync_endpoint_new(ck.json_text("endpoint configuration", cfg), out))
        super().__init__(out[0])
        self._timeout = cfg["timeout_s"]
        self._lease_s = lease_s
        self._client = client

    @property
    def address(self) -> str:
        """The listening address ``"IP:PORT"`` (the real port), or ``""`` for a client-only
        endpoint."""
        return out_string(lib.tpu_sync_endpoint_address, self._handle())

    def add_peer(self, name: str, address: str) -> None:
        """Names a peer so that peer maps may use the name; re-adding a name with a new address (a
        restarted peer) makes the next transfer connect there."""
        check(lib.tpu_sync_endpoint_add_peer(self._handle(), ck.cstr("name", name), ck.cstr("address", address)))

    def register(self, request_id: int, placement: Any, num_tokens: int, kv: Kv, lease_s: Optional[float] = None,
                 expected_releases: int = 1) -> None:
        """Producer side of a pull: copies (D2H) the request's blocks of the given ranks'
        per-layer buffers into pinned staging, and serves them until ``expected_releases``
        consumers released the request, or the lease passes without a live consumer. The device
        blocks may be reused as soon as this returns.

        Args:
            request_id: ``1 .. 2^53-1``.
            placement: where the request's blocks are (``tpu_sync.placement(...)`` dict).
            num_tokens: tokens of the request.
            kv: global rank -> that rank's KV buffers, one per layer, for the ranks hosted here.
            lease_s: not supported per registration (the lease is endpoint-wide: pass ``lease_s``
                to :class:`Endpoint`); a different value only warns.
            expected_releases: consumers that will pull it.

        Raises (nothing staged, other registrations untouched): InvalidArgumentError (ids,
        ranks, a duplicate id, unknown keys in ``placement``), MismatchError (a buffer's element
        type, dims, on-device size or physical layout disagrees with the layout: the message
        names rank, layer and both), StagingExhaustedError (the staging budget is used up),
        LayoutError, BlockRangeError.
        """
        if lease_s is not None:
            lease_s = ck.number("lease_s", lease_s, positive=True)
        if lease_s is not None and lease_s != self._lease_s:
            warnings.warn("Endpoint.register(lease_s=...) is not supported per registration; the endpoint's "
                          "lease_s applies", RuntimeWarning, stacklevel=2)
        rid = _check_id(request_id)
        place = _placement(placement)
        tokens = ck.u32("num_tokens", num_tokens)
        releases = ck.u32("expected_releases", expected_releases)
        ranks, bufs, n, layers, keep = _kv(kv)
        check(lib.tpu_sync_endpoint_register(self._handle(), rid, place, tokens, ranks, n, bufs, layers, releases))
        del keep

    def register_layers(self, request_id: int, placement: Any, num_tokens: int, kv: Kv, layers_ready: int = 0,
                        expected_releases: int = 1) -> None:
        """:meth:`register` of a request whose later layers are not computed yet (layer-wise
        P/D): reserves the staging of every layer but copies (D2H) only layers
        ``0 .. layers_ready``; consumers may pull at once and receive layer ``l`` once
        :meth:`publish_layers` staged it. The registration keeps references to ``kv``'s buffers
        until every layer is published; the device blocks of unpublished layers must not be
        reused before they are.

        Raises: as :meth:`register`."""
        rid = _check_id(request_id)
        place = _placement(placement)
        tokens = ck.u32("num_tokens", num_tokens)
        releases = ck.u32("expected_releases", expected_releases)
        ready = ck.u32("layers_ready", layers_ready)
        ranks, bufs, n, layers, keep = _kv(kv)
        check(lib.tpu_sync_endpoint_register_layers(self._handle(), rid, place, tokens, ranks, n, bufs, layers,
                                                    releases, ready))
        del keep

    def publish_layers(self, request_id: int, layers: int) -> int:
        """Stages (D2H, blocking) and publishes layers up to ``layers`` (exclusive) of a request
        registered with :meth:`register_layers`; its pullers receive them next. Monotone (a
        smaller value does nothing); the device blocks of those layers may be reused afterwards.
        Returns the number of leading layers published (every layer for a request registered
        whole).

        Raises: UnknownRequestError (not registered here, or ended), device copy errors
        (:meth:`unregister` it then, so that its pullers fail instead of waiting)."""
        rid = _check_id(request_id)
        out = ffi.new("uint32_t *")
        check(lib.tpu_sync_endpoint_publish_layers(self._handle(), rid, ck.u32("layers", layers), out))
        return int(out[0])

    def unregister(self, request_id: int) -> None:
        """Withdraws a registration (pulls in progress fail). No error if it already ended."""
        check(lib.tpu_sync_endpoint_unregister(self._handle(), ck.u64("request_id", request_id), ffi.NULL))

    def refuse(self, request_id: int, reason: str = "") -> bool:
        """Producer side: this endpoint will not serve ``request_id`` (its registration failed,
        or the request was given up). A registration of it is withdrawn as by
        :meth:`unregister`; then, for the endpoint's ``lease_s`` or until the id is registered
        again, a consumer's :meth:`pull` or :meth:`describe` of it fails at once with
        ``CancelledError`` carrying ``reason`` (at most 1 KiB of it is kept: a longer one is cut
        at a character boundary and ends in ``...``; an empty one reads "no reason given"),
        instead of waiting for a registration until its ``wait_for_registration`` runs out. At
        most 4,096 refusals are kept (past that the one expiring first is forgotten). Counted
        in :meth:`stats` as ``refusals``. Returns whether a registration was withdrawn (always
        False on an endpoint that does not listen: it serves nothing). Does not block on the
        network.

        Raises: InvalidArgumentError (id out of range)."""
        rid = _check_id(request_id)
        existed = ffi.new("bool *")
        check(lib.tpu_sync_endpoint_refuse(self._handle(), rid, ck.cstr("reason", reason), existed))
        return bool(existed[0])

    def registration_state(self, request_id: int) -> str:
        """``"active"``, or how the registration ended: ``"released"`` (every consumer pulled it
        completely), ``"rejected"`` (the consumers said they will not pull it:
        :meth:`reject`), ``"expired"``, ``"peer_lost"``, ``"unregistered"``, ``"shutdown"``;
        ``"unknown"`` for an id never registered here."""
        s = ffi.new("uint32_t *")
        check(lib.tpu_sync_endpoint_source_state(self._handle(), ck.u64("request_id", request_id), s))
        return SOURCE_STATES.get(int(s[0]), "unknown")

    def reject(self, request_id: int, peers: Peers, reason: str = "") -> None:
        """Consumer side: tells the producers in ``peers`` (as for :meth:`pull`) that this
        consumer will not pull ``request_id`` (the decode side refused or aborted it before its
        pull). Each producer frees its staging of the request at once (once no consumer
        remains) and reports it ``"rejected"`` with ``reason``, instead of keeping it for its
        lease. Cancel this side's pulls of the request first. Blocks until the producers
        answered.

        Raises: InvalidArgumentError, connection errors (``PeerClosedError``,
        ``TimeoutError``, ...), the producer's errors with their type."""
        rid = _check_id(request_id)
        p = _peers(peers)
        r = ck.cstr("reason", reason)
        check(lib.tpu_sync_endpoint_reject(self._handle(), rid, p, r))

    def describe(self, request_id: int, address: str) -> Tuple[Dict[str, Any], int]:
        """Consumer side: asks the producer endpoint at ``address`` (``host:port`` or a peer
        name) how it registered ``request_id``; returns ``(placement, num_tokens)``, the
        ``src_placement`` and token count to :meth:`pull` it with. For a consumer that learns of
        a request before its producer allocated its blocks (a router that sends the prompt to
        both at once). The producer counts this endpoint as a live consumer of the request from
        then on. Blocks for one network round trip (at most the endpoint's ``timeout``).

        Raises: UnknownRequestError (not registered there, yet or any more: ask again later to
        wait for the registration), CancelledError (the producer refused it: :meth:`refuse`;
        asking again will not help), InvalidArgumentError, connection errors."""
        rid = _check_id(request_id)
        addr = ck.cstr("address", address)
        need = ffi.new("size_t *")
        size = 1 << 20  # one round trip for any realistic placement; asked again if larger
        for _ in range(2):
            buf = ffi.new("char[]", size)
            status = lib.tpu_sync_endpoint_describe(self._handle(), rid, addr, buf, size, need)
            if status == lib.TPU_SYNC_BUFFER_TOO_SMALL:
                size = need[0] + 1
                continue
            check(status)
            d = json.loads(ffi.string(buf).decode())
            return d["placement"], int(d["num_tokens"])
        check(status)
        raise AssertionError("unreachable")

    def pull(self, request_id: int, peers: Peers, src_placement: Any, dst_placement: Any, num_tokens: int,
             kv: Kv, wait_for_registration: Optional[float] = None, layerwise: bool = False) -> Transfer:
        """Consumer side: pulls the request from the producers and writes it in place into ``kv``
        (H2D), resharding from ``src_placement`` to ``dst_placement``; then tells the producers
        to release it. Asynchronous: returns a :class:`Transfer`. ``peers`` is one address for
        every producer rank, or ``{source rank: address}``. No computation may use the
        destination blocks until the transfer is done.

        ``wait_for_registration`` (seconds; default: the endpoint's setting): how long a producer
        that does not know the request yet may take to register it (a decode request that
        reaches the producer before its registration then waits and succeeds instead of failing
        with ``UnknownRequestError``); 0: no wait.

        ``layerwise``: write each layer into ``kv`` as soon as it arrived from every producer rank
        (:attr:`Transfer.layers_written`, :meth:`Transfer.wait_layers`) instead of every layer at
        the end; the model may then read layer ``l`` while later layers arrive.

        After a failed or cancelled pull the producer keeps the request (a retry, e.g. to the
        right address, succeeds) until its lease passes or :meth:`reject`.

        Raises (before anything is sent): InvalidArgumentError, LayoutError, BlockRangeError,
        MismatchError (the layouts, or a buffer and its layout, disagree), UnsupportedError (no
        in-place H2D path), StagingExhaustedError.
        """
        rid = _check_id(request_id)
        p = _peers(peers)
        src, dst = _placement(src_placement, "src_placement"), _placement(dst_placement, "dst_placement")
        tokens = ck.u32("num_tokens", num_tokens)
        wait = None
        if wait_for_registration is not None:
            wait = min(int(ck.number("wait_for_registration", wait_for_registration, lo=0.0) * 1000), ck.I64_MAX)
        ranks, bufs, n, layers, keep = _kv(kv)
        out = ffi.new("tpu_sync_transfer **")
        if ck.flag("layerwise", layerwise):
            check(lib.tpu_sync_endpoint_pull_layers(self._handle(), rid, p, src, dst, tokens, ranks, n, bufs, layers,
                                                    -1 if wait is None else wait, out))
        elif wait is None:
            check(lib.tpu_sync_endpoint_pull(self._handle(), rid, p, src, dst, tokens, ranks, n, bufs, layers, out))
        else:
            check(lib.tpu_sync_endpoint_pull_wait(self._handle(), rid, p, src, dst, tokens, ranks, n, bufs, layers,
                                                  wait, out))
        return Transfer(out[0], keepalive=keep)

    def push(self, request_id: int, targets: Peers, src_placement: Any, dst_placement: Any, num_tokens: int,
             kv: Kv) -> Transfer:
        """Producer-initiated: copies (D2H) the request's blocks of ``kv`` (this side's ranks of
        ``src_placement``) into staging and sends each destination rank exactly its spans; the
        destination endpoints must :meth:`expect_push` it. ``targets``: one address for every
        destination rank, or ``{destination rank: address}``. The device blocks may be reused as
        soon as this returns."""
        rid = _check_id(request_id)
        t = _peers(targets, "targets")
        src, dst = _placement(src_placement, "src_placement"), _placement(dst_placement, "dst_placement")
        tokens = ck.u32("num_tokens", num_tokens)
        ranks, bufs, n, layers, keep = _kv(kv)
        out = ffi.new("tpu_sync_transfer **")
        check(lib.tpu_sync_endpoint_push(self._handle(), rid, t, src, dst, tokens, ranks, n, bufs, layers, out))
        return Transfer(out[0], keepalive=keep)

    def expect_push(self, request_id: int, src_placement: Any, dst_placement: Any, num_tokens: int,
                    kv: Kv) -> Transfer:
        """Consumer side of a push: accepts the request's pushes into staging and writes them in
        place into ``kv`` (H2D). The transfer completes when every sender finished and every byte
        verified and landed."""
        rid = _check_id(request_id)
        src, dst = _placement(src_placement, "src_placement"), _placement(dst_placement, "dst_placement")
        tokens = ck.u32("num_tokens", num_tokens)
        ranks, bufs, n, layers, keep = _kv(kv)
        out = ffi.new("tpu_sync_transfer **")
        check(lib.tpu_sync_endpoint_expect_push(self._handle(), rid, src, dst, tokens, ranks, n, bufs, layers, out))
        return Transfer(out[0], keepalive=keep)

    def stats(self) -> Dict[str, Any]:
        """Counters: gauges ``peers``, ``sessions``, ``lanes_open``, ``source_registrations``,
        ``sink_registrations``, ``leases``, ``staged_bytes``, ``transfers_in_flight``; totals
        ``lanes_opened``, ``bytes_sent``, ``bytes_received``, ``bytes_received_unhashed`` (of
        those, bytes an encrypted lane's AEAD authenticated without an xxh3 check: option
        ``hash_encrypted_frames``), ``transfers_completed``,
        ``transfers_failed``, ``checksum_failures``, ``peers_lost``, ``handshake_failures``,
        ``lanes_refused``; the pipeline's ``offers_live``, ``offers``, ``pulls``, ``pushes``,
        ``expected_pushes``, ``refused`` (calls refused before any byte moved), ``refusals``
        (requests this producer refused: :meth:`refuse`), ``rejects_sent``, ``dma_mapped``,
        ``dma_skipped`` (staging the plugin could not DMA-map, e.g. on the XLA CPU plugin),
        ``dma_last``; ``staging_budget`` (``limit_bytes``,
        ``used_bytes``, ``peak_bytes``, ``reservations``, ``refused``, ``waited``);
        ``staging_pool`` (gauges ``cap_bytes``, ``idle_bytes``, ``idle_arenas``, totals ``hits``,
        ``misses``, ``returned``, ``released``: reused staging arenas, whose idle bytes are part
        of the budget's ``used_bytes``); ``plan_cache`` (``capacity``, ``entries``, ``hits``,
        ``misses``); and ``address``, ``transport``, ``name``."""
        return json_out(lib.tpu_sync_endpoint_stats, self._handle())

    def close(self, drain: bool = True) -> None:
        """Shuts the endpoint down and frees it (idempotent): stops accepting, lets in-flight
        transfers finish for up to ``timeout`` seconds when ``drain`` (else cancels them at once),
        ends every registration and closes every connection."""
        drain = ck.flag("drain", drain)
        if self._ptr is None:
            return
        try:
            check(lib.tpu_sync_endpoint_shutdown(self._ptr, int(self._timeout * 1000) if drain else 0))
        finally:
            super().close()

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            Handle.close(self)  # no drain from a finaliser: free cancels at once
        except Exception:
            pass


__all__ = ["Endpoint", "MAX_REQUEST_ID", "SOURCE_STATES", "Transfer"]
