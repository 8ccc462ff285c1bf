"""A prefix cache shared across instances: the cluster prefix directory on etcd and the remote tier.

Every instance publishes which blocks its host tier (:class:`tpu_sync.Store`) holds into etcd
(:meth:`Directory.publish`, under a lease: a dead instance's entries vanish after the TTL), serves
them to others (:class:`RemoteServer`), and before recomputing a prompt asks the directory who
holds its prefix (:meth:`Directory.lookup`) and fetches it (:func:`fetch`)::

    d = Directory(endpoints=["http://etcd-0:2379"])
    creds = {"psk_file": "/etc/tpu-sync/fleet.psk"}  # or {"tls": {"cert", "key", "ca"}}
    srv = RemoteServer(store, "0.0.0.0:7800", remote=creds)
    pub = d.publish(store, host_id="node-3", addr="10.0.0.3:7800")
    for cand in d.lookup(namespace, keys):          # longest prefix first; a hint
        n = fetch(cand["addr"], namespace, keys[:cand["blocks"]], outs, remote=creds)
        if n:
            break

The remote tier authenticates with the endpoints' credentials (``remote``: mutual TLS or a
pre-shared key, TLS 1.3 both ways): a server serves only clients that hold them, and a client
takes bytes only from a server that proves them. Without credentials it is plain TCP, and a
server refuses a non-loopback address unless ``remote={"insecure": True}``.

The directory is a hint: a fetch may deliver fewer blocks than the lookup said (evicted since),
never wrong bytes (each block's length and xxh3-64 are checked on arrival). Errors are the
exceptions of :mod:`tpu_sync.errors`.

:func:`load` is the device path: the present prefix of a prompt whose KV another instance (of
another layout, one store per rank) holds goes straight into this instance's device blocks,
resharded as a P/D pull is.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

from ._lib import Handle, check, json_out, out_string
from ._native import ffi, lib
from .arrays import view
from .errors import InvalidArgumentError
from .store import Store, _keys
from . import _check as ck

__all__ = ["Directory", "Member", "Publisher", "REMOTE_OPTIONS", "RemoteServer", "SETTINGS", "fetch", "load",
           "settings"]


class Publisher(Handle):
    """One store published into the directory (see :meth:`Directory.publish`). Closing it revokes
    its lease: its entries disappear at once."""

    _free = lib.tpu_sync_publisher_free

    def sync(self, timeout: float = 10.0) -> None:
        """Waits until every change made to the store before the call is published.

        Raises: TimeoutError (tpu_sync.errors) when not done within ``timeout`` seconds."""
        check(lib.tpu_sync_publisher_sync(self._handle(), int(timeout * 1000)))

    def stats(self) -> Dict[str, int]:
        """Counters: published, unpublished, txns, leases, republishes, errors, mirrored,
        live_entries, pending, skipped_by_stride, lease_id."""
        return json_out(lib.tpu_sync_publisher_stats, self._handle())


class Directory(Handle):
    """A connection to the cluster prefix directory in etcd.

    Args:
        endpoints: etcd client URLs (``http://host:2379``, ``https://...`` or ``host:port``).
        prefix: key prefix of this fleet (default ``/tpu-sync/v1``).
        lease_ttl: seconds after which a dead instance's entries vanish (default 10).
        user, password: etcd authentication.
        tls_ca_file, tls_cert_file, tls_key_file, tls_domain: TLS to etcd.
        **options: ``batch_interval_ms``, ``max_txn_ops``, ``max_ops_per_sec``,
            ``publish_stride``, ``request_timeout_ms``, ``connect_timeout_ms``.

    Raises: InvalidArgumentError for a bad configuration."""

    _free = lib.tpu_sync_directory_free

    def __init__(self, endpoints: Sequence[str], *, prefix: Optional[str] = None,
                 lease_ttl: Optional[float] = None, user: Optional[str] = None,
                 password: Optional[str] = None, tls_ca_file: Optional[str] = None,
                 tls_cert_file: Optional[str] = None, tls_key_file: Optional[str] = None,
                 tls_domain: Optional[str] = None, **options: Any) -> None:
        cfg: Dict[str, Any] = {"endpoints": [str(e) for e in endpoints]}
        if lease_ttl is not None:
            cfg["lease_ttl_ms"] = int(lease_ttl * 1000)
        for k, v in dict(prefix=prefix, user=user, password=password, tls_ca_file=tls_ca_file,
                         tls_cert_file=tls_cert_file, tls_key_file=tls_key_file,
                         tls_domain=tls_domain, **options).items():
            if v is not None:
                cfg[k] = v
        out = ffi.new("tpu_sync_directory **")
        check(lib.tpu_sync_directory_new(json.dumps(cfg).encode(), out))
        super().__init__(out[0])

    def lookup(self, namespace: str, keys: Sequence[bytes]) -> List[Dict[str, Any]]:
        """Per host, the longest leading prefix of ``keys`` (of the store namespace
        ``namespace``) it holds: ``[{"id", "addr", "meta", "blocks"}]``, longest first.

        Raises: PeerClosedError / TimeoutError when etcd is unreachable."""
        arr, n = _keys(keys)
        return json_out(lib.tpu_sync_directory_lookup, self._handle(), str(namespace).encode(), arr, n)

    def publish(self, store: Store, *, host_id: str, addr: str, meta: Optional[str] = None) -> Publisher:
        """Starts publishing ``store``'s blocks as ``host_id``, fetchable at ``addr``."""
        out = ffi.new("tpu_sync_publisher **")
        m = ffi.NULL if meta is None else str(meta).encode()
        check(lib.tpu_sync_directory_publish(self._handle(), store._handle(), str(host_id).encode(),
                                             str(addr).encode(), m, out))
        p = Publisher(out[0])
        p._store = store  # keep the store alive as long as its publisher
        return p


#: Keys of the remote tier's options (``remote`` of :class:`RemoteServer`, :func:`fetch`,
#: :func:`load`; the C library's ``tpu_sync_remote_serve_with``): credentials ``tls`` (a dict
#: ``cert``, ``key``, ``ca``, optional ``server_name``: PEM files, mutual TLS against that CA),
#: ``psk_hex`` or ``psk_file`` (a pre-shared key of at least 16 bytes; 32 random bytes
#: recommended), at most one of the three; ``insecure`` (bool: a server without credentials may
#: listen beyond loopback); ``timeout_s``, ``connect_timeout_s``, ``io_timeout_s`` (seconds);
#: ``workers``, ``max_queued`` (the server's connection caps).
REMOTE_OPTIONS = frozenset({"tls", "psk_hex", "psk_file", "insecure", "timeout_s", "connect_timeout_s",
                            "io_timeout_s", "workers", "max_queued"})


def _remote(remote: Optional[Dict[str, Any]], where: str = "remote") -> Dict[str, Any]:
    if remote is None:
        return {}
    if not isinstance(remote, dict):
        raise ck.fail(f"{where} must be a dict, got {type(remote).__name__}")
    unknown = set(remote) - REMOTE_OPTIONS
    if unknown:
        raise ck.fail(f"unknown {where} options {sorted(unknown)}; known: {sorted(REMOTE_OPTIONS)}")
    return dict(remote)


class RemoteServer(Handle):
    """Serves ``store``'s blocks to other instances on TCP ``listen`` (``host:port``; port 0 picks
    one, see :attr:`addr`) from a fixed pool of threads. ``remote``: the options of
    :data:`REMOTE_OPTIONS`; with credentials only clients that hold the same ones are served
    (TLS 1.3, mutual). Without credentials: plain TCP, for trusted networks, and a non-loopback
    ``listen`` raises InvalidArgumentError unless ``remote["insecure"]`` is true.

    Raises: InvalidArgumentError, IoError (the address cannot be bound)."""

    _free = lib.tpu_sync_remote_server_free

    def __init__(self, store: Store, listen: str, *, remote: Optional[Dict[str, Any]] = None) -> None:
        out = ffi.new("tpu_sync_remote_server **")
        opts = json.dumps(_remote(remote)).encode()
        check(lib.tpu_sync_remote_serve_with(store._handle(), str(listen).encode(), opts, out))
        super().__init__(out[0])
        self._store = store

    @property
    def addr(self) -> str:
        """The ``ip:port`` it listens on."""
        return out_string(lib.tpu_sync_remote_server_addr, self._handle())


def fetch(addr: str, namespace: str, keys: Sequence[bytes], outs: Sequence[Any],
          timeout: float = 10.0, *, remote: Optional[Dict[str, Any]] = None) -> int:
    """Fetches the leading blocks of ``keys`` from the remote server at ``addr`` into writable host
    arrays (``outs[i]`` exactly as long as block ``keys[i]``). Returns how many leading blocks
    arrived byte-exact (a smaller count is a miss, not an error). ``remote``: credentials (and
    options) of :data:`REMOTE_OPTIONS`; with them the server must prove the same ones before a
    byte is read from it. ``timeout`` (seconds) is each read's and write's deadline.

    Raises: MismatchError (another namespace), PeerClosedError / TimeoutError (server gone or
    stalled), ProtocolError (also: a server without this fleet's credentials), ChecksumError,
    InvalidArgumentError."""
    arr, n = _keys(keys)
    outs = list(outs)
    if len(outs) != n:
        raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"{n} keys but {len(outs)} destinations")
    views = [view(o, writable=True) for o in outs]
    if any(v.on_device for v in views):
        raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, "fetch needs host arrays")
    ptrs = ffi.new("void *[]", [ffi.cast("void *", v.ptr) for v in views] or [ffi.NULL])
    lens = ffi.new("uint64_t[]", [v.nbytes for v in views] or [0])
    got = ffi.new("size_t *")
    opts = _remote(remote)
    opts.setdefault("timeout_s", float(timeout))
    check(lib.tpu_sync_remote_fetch_with(str(addr).encode(), str(namespace).encode(), arr, ptrs, lens, n,
                                         json.dumps(opts).encode(), got))
    return int(got[0])


def load(src_layout: Dict[str, Any], sources: Sequence[Dict[str, Any]], dst_placement: Any,
         num_tokens: int, kv: Any, *, timeout: float = 10.0,
         staging_budget_bytes: Optional[int] = None,
         remote: Optional[Dict[str, Any]] = None) -> Dict[str, int]:
    """Loads the present prefix of a prompt from other instances' host tiers into this side's
    device buffers, resharded from the producer's layout ``src_layout`` (``tpu_sync.layout``) to
    ``dst_placement``'s (other TP split, block size, block order; any PCP on the producer, whose
    PCP ranks of a TP column are asked in turn; PCP 1 on the consumer). Blocks.

    ``sources``: one per rank of the producer's replica, in local rank order (``pcp * tp_size +
    tp``): ``{"addr": remote server "host:port", "namespace": that rank's store namespace,
    "keys": [16-byte keys]}``, key ``i`` holding the rank's request block ``i`` (a PCP rank
    holds only some of them). ``kv``: ``{rank: [layer buffers]}`` as for
    :meth:`tpu_sync.Endpoint.pull`. ``remote``: the fetches' credentials (:data:`REMOTE_OPTIONS`).

    Returns ``{"tokens", "dst_blocks", "fetched_bytes", "device_bytes", "staged_bytes", "spans",
    "elapsed_ns"}``: ``tokens`` loaded (the longest prefix every producer rank still holds, in
    whole destination blocks unless it is the whole request; 0 is a miss). On any error the
    destination buffers are untouched.

    Raises: InvalidArgumentError, LayoutError, BlockRangeError, MismatchError, UnsupportedError,
    StagingExhaustedError, PeerClosedError / TimeoutError (a producer gone or stalled),
    ProtocolError, ChecksumError."""
    from .endpoint import _kv, _placement

    srcs = []
    for i, s in enumerate(ck.items("sources", sources)):
        if not isinstance(s, dict):
            raise ck.fail(f"sources[{i}] must be a dict, got {type(s).__name__}")
        keys = []
        for k in ck.items(f"sources[{i}].keys", s.get("keys")):
            if not isinstance(k, (bytes, bytearray)) or len(k) != 16:
                raise ck.fail(f"sources[{i}]: keys must be 16-byte keys")
            keys.append(format(int.from_bytes(bytes(k), "little"), "032x"))
        srcs.append({"addr": ck.text(f"sources[{i}].addr", s.get("addr")),
                     "namespace": ck.text(f"sources[{i}].namespace", s.get("namespace")),
                     "keys": keys})
    req: Dict[str, Any] = {"src_layout": src_layout, "sources": srcs}
    if staging_budget_bytes is not None:
        req["staging_budget_bytes"] = int(staging_budget_bytes)
    if remote:
        req["remote"] = _remote(remote)
    dst = _placement(dst_placement, "dst_placement")
    ranks, bufs, n, layers, keep = _kv(kv)
    st = ffi.new("tpu_sync_remote_load_stats *")
    check(lib.tpu_sync_remote_load(json.dumps(req).encode(), dst, ck.u32("num_tokens", num_tokens),
                                   ranks, n, bufs, layers, int(timeout * 1000), st))
    del keep
    return {f: int(getattr(st, f)) for f in ("tokens", "dst_blocks", "fetched_bytes", "device_bytes",
                                             "staged_bytes", "spans", "elapsed_ns")}


#: The keys of an engine's ``cluster`` settings (the vLLM connector's
#: ``kv_connector_extra_config["cluster"]``, the SGLang storage backend's
#: ``hicache_storage_backend_extra_config["cluster"]``); see :class:`Member`.
SETTINGS = frozenset({"endpoints", "advertise", "listen", "host_id", "prefix", "lease_ttl", "user", "password",
                      "tls_ca_file", "tls_cert_file", "tls_key_file", "tls_domain", "fetch_timeout",
                      "remote_tls", "remote_psk_hex", "remote_psk_file", "insecure"})

_DIRECTORY_SETTINGS = ("prefix", "lease_ttl", "user", "password", "tls_ca_file", "tls_cert_file", "tls_key_file",
                       "tls_domain")


def settings(c: Any, where: str = "cluster") -> Dict[str, Any]:
    """Checks an engine's ``cluster`` settings (a dict of :data:`SETTINGS`; ``None`` or empty:
    no cluster) and returns them as a new dict.

    Raises: InvalidArgumentError for a non-dict, unknown keys, or missing ``endpoints`` /
    ``advertise``."""
    if c is None:
        return {}
    if not isinstance(c, dict):
        raise ck.fail(f"{where} must be a dict, got {type(c).__name__}")
    unknown = set(c) - SETTINGS
    if unknown:
        raise ck.fail(f"unknown {where} settings {sorted(unknown)}; known: {sorted(SETTINGS)}")
    if c and (not c.get("endpoints") or not c.get("advertise")):
        raise ck.fail(f"{where} settings need 'endpoints' and 'advertise'")
    if c and (not isinstance(c["endpoints"], (list, tuple)) or not all(isinstance(e, str) for e in c["endpoints"])):
        raise ck.fail(f"{where}['endpoints'] must be a list of etcd URLs")
    return dict(c)


class Member:
    """One store of an engine in the cluster: served to other instances (:class:`RemoteServer`)
    and published into the directory (:meth:`Directory.publish`), from an engine's ``cluster``
    settings (:func:`settings`):

    ``endpoints`` (list of str, required)
        etcd client URLs.
    ``advertise`` (str, required)
        ``host:port`` other instances fetch this store's blocks from (port 0: the port the
        server picked); the server listens on ``listen`` (default ``0.0.0.0:<advertise port>``
        with credentials or ``insecure``, the ``advertise`` address itself otherwise).
    ``host_id`` (str)
        this store's id in the directory (default ``<advertise host>_<port>-r<rank>``).
    ``prefix``, ``lease_ttl`` (seconds), ``user``, ``password``, ``tls_ca_file``,
    ``tls_cert_file``, ``tls_key_file``, ``tls_domain``
        as :class:`Directory`.
    ``fetch_timeout`` (seconds, default 5)
        deadline of each fetch from a peer (:attr:`timeout`).
    ``remote_tls`` (dict ``cert``, ``key``, ``ca``, optional ``server_name``), ``remote_psk_hex``, ``remote_psk_file``
        the fleet's credentials for the remote tier (at most one; :data:`REMOTE_OPTIONS`):
        this store is served only to members that hold them, and fetches from peers take bytes
        only from members that prove them (:attr:`remote`).
    ``insecure`` (bool, default false)
        without credentials, lets the server listen beyond loopback (plain TCP: anyone who
        reaches the port can read and offer blocks). Without credentials and without it, a
        non-loopback ``listen`` raises InvalidArgumentError.

    ``meta`` is published with the store's record (e.g. a ``StoreSource`` JSON). Not
    thread-safe to close while in use; the handles are.

    Raises: InvalidArgumentError (bad settings), the errors of :class:`Directory` and
    :class:`RemoteServer` (e.g. the listen port in use)."""

    def __init__(self, store: Store, c: Dict[str, Any], *, rank: int = 0, meta: Optional[str] = None) -> None:
        c = settings(c)
        if not c:
            raise ck.fail("cluster settings are empty")
        self.timeout = float(c.get("fetch_timeout", 5.0))
        advertise = str(c["advertise"])
        #: the remote tier's credentials, for :func:`fetch` and :func:`load` from peers
        self.remote: Dict[str, Any] = {k[len("remote_"):]: c[k] for k in ("remote_tls", "remote_psk_hex",
                                                                           "remote_psk_file") if c.get(k)}
        server_opts = dict(self.remote)
        if c.get("insecure"):
            server_opts["insecure"] = True
        # All interfaces only for a server that authenticates its clients (or is told insecure);
        # otherwise the advertised address itself, which must then be loopback.
        port = advertise.rpartition(':')[2]
        open_to_all = bool(self.remote) or bool(c.get("insecure"))
        listen = str(c.get("listen") or (f"0.0.0.0:{port}" if open_to_all else advertise))
        self.directory = Directory(list(c["endpoints"]), **{k: c[k] for k in _DIRECTORY_SETTINGS if k in c})
        try:
            self.server = RemoteServer(store, listen, remote=server_opts)
        except Exception:
            self.directory.close()
            raise
        if advertise.endswith(":0"):
            advertise = f"{advertise.rpartition(':')[0]}:{self.server.addr.rpartition(':')[2]}"
        #: the address published for this store
        self.advertise = advertise
        #: this store's id in the directory
        self.host_id = str(c.get("host_id") or f"{advertise.replace(':', '_')}-r{int(rank)}")
        self.endpoints = list(c["endpoints"])
        try:
            self.publisher = self.directory.publish(store, host_id=self.host_id, addr=advertise, meta=meta)
        except Exception:
            self.server.close()
            self.directory.close()
            raise

    def peers(self, namespace: str, keys: Sequence[bytes], more_than: int = 0) -> List[Dict[str, Any]]:
        """:meth:`Directory.lookup` without this store's own record and hosts holding at most
        ``more_than`` leading blocks."""
        return [c for c in self.directory.lookup(namespace, keys)
                if c["id"] != self.host_id and int(c["blocks"]) > more_than]

    def close(self) -> None:
        """Stops publishing (the entries go at once) and serving; never raises."""
        for h in (self.publisher, self.server, self.directory):
            try:
                h.close()
            except Exception:  # never fail a shutdown
                pass
