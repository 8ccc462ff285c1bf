"""The host KV tier: a prefix-keyed store of KV blocks in pinned host DRAM, optionally kept in
``/dev/shm`` across restarts (warm restart) and backed by a disk tier.

Blocks are addressed by 16-byte keys (``bytes``) of one namespace (model, dtype, layout): build
them from token ids with :meth:`Store.chain_keys` or wrap an engine's own block hashes with
:meth:`Store.engine_key`. Every operation takes a *chain*: keys whose blocks follow each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _check as ck
from ._lib import Handle, check, json_out
from ._native import ffi, lib
from .arrays import view
from .client import Buffer, Client
from .errors import InvalidArgumentError

KEY_BYTES = 16
_SIZE_MAX = int(ffi.cast("size_t", -1))

#: Why a get stopped early (``GetResult.stop``), by native ``tpu_sync_get_stop`` value.
STOP_REASONS = {0: None, 1: "not_ready", 2: "missing", 3: "no_space", 4: "raced", 5: "bad_file"}

#: One piece of a block on a device: (buffer, byte offset, bytes).
DevicePiece = Tuple[Buffer, int, int]


@dataclass(frozen=True)
class PutResult:
    """Result of a put.

    Attributes:
        stored: blocks written by the call.
        present: blocks already present (not written again).
        full_at: first chain position not stored for lack of room (None: all stored or present).
        not_ready: the store was not ready; nothing was stored.
        bytes: bytes written.
    """

    stored: int
    present: int
    full_at: Optional[int]
    not_ready: bool
    bytes: int = 0

    @property
    def complete(self) -> bool:
        """Every block of the chain is now stored or was already present."""
        return self.full_at is None and not self.not_ready


@dataclass(frozen=True)
class GetResult:
    """Result of a get: the leading ``delivered`` blocks are in their destinations, byte-exact.

    Attributes:
        delivered: leading blocks delivered.
        from_dram: of those, read from DRAM.
        from_disk: of those, loaded from disk through DRAM.
        stop: why it stopped early (``"missing"``, ``"not_ready"``, ``"no_space"``, ``"raced"``,
            ``"bad_file"``), None when every block was delivered.
        bytes: bytes delivered.
        retries: copies redone because a block changed under them.
    """

    delivered: int
    from_dram: int
    from_disk: int
    stop: Optional[str]
    bytes: int = 0
    retries: int = 0


def _put_result(r) -> PutResult:
    full = None if int(r.full_at) == _SIZE_MAX else int(r.full_at)
    return PutResult(int(r.stored), int(r.present), full, bool(r.not_ready), int(r.bytes))


def _get_result(r) -> GetResult:
    return GetResult(int(r.delivered), int(r.from_dram), int(r.from_disk), STOP_REASONS.get(int(r.stop), "unknown"),
                     int(r.bytes), int(r.retries))


def _keys(keys: Sequence[bytes]):
    keys = ck.items("keys", keys)
    arr = ffi.new("tpu_sync_key[]", max(1, len(keys)))
    for i, k in enumerate(keys):
        if not isinstance(k, (bytes, bytearray, memoryview)) or len(k) != KEY_BYTES:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"key {i} is not {KEY_BYTES} bytes: {k!r}")
        ffi.memmove(arr[i].bytes, bytes(k), KEY_BYTES)
    return arr, len(keys)


def _parent(parent: Optional[bytes]):
    if parent is None:
        return ffi.NULL
    arr, _ = _keys([parent])
    return arr


def _pieces(blocks: Sequence[Sequence[DevicePiece]]):
    blocks = [ck.items(f"blocks[{i}]", b) for i, b in enumerate(ck.items("blocks", blocks))]
    flat = [p for b in blocks for p in b]
    arr = ffi.new("tpu_sync_device_range[]", max(1, len(flat)))
    per = ffi.new("size_t[]", [len(b) for b in blocks] or [0])
    keep = []
    for i, p in enumerate(flat):
        if not isinstance(p, (tuple, list)) or len(p) != 3 or not isinstance(p[0], Buffer):
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"piece {i} is not (Buffer, offset, length)")
        arr[i].buffer = p[0]._handle()
        arr[i].offset = ck.u64(f"piece {i} offset", p[1])
        arr[i].len = ck.u64(f"piece {i} length", p[2])
        keep.append(p[0])
    return arr, len(flat), per, keep


_PART_ROLES = {"full": 0, "window": 1, "state": 2}


def _groups(groups: Sequence[Dict[str, Any]]):
    groups = ck.items("groups", groups)
    arr = ffi.new("tpu_sync_store_group[]", max(1, len(groups)))
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or g.get("role") not in _PART_ROLES:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT,
                                       f"groups[{i}] must be a dict with role 'full', 'window' or 'state', got {g!r}")
        arr[i].role = _PART_ROLES[g["role"]]
        arr[i].window_tokens = ck.u32(f"groups[{i}] window_tokens", g.get("window_tokens", 0))
        arr[i].part_bytes = ck.u64(f"groups[{i}] part_bytes", g.get("part_bytes", 0))
    return arr, len(groups)


def _group_parts(parts: Sequence[Any]):
    parts = ck.items("parts", parts)
    for i, p in enumerate(parts):
        if not isinstance(p, (tuple, list)) or len(p) != 3:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT,
                                       f"parts[{i}] is not (block, group, [(buffer, offset, length), ...])")
    blocks = ffi.new("size_t[]", [ck.u64(f"parts[{i}] block", p[0]) for i, p in enumerate(parts)] or [0])
    grps = ffi.new("uint32_t[]", [ck.u32(f"parts[{i}] group", p[1]) for i, p in enumerate(parts)] or [0])
    pieces, n_pieces, per, keep = _pieces([p[2] for p in parts])
    return blocks, grps, pieces, n_pieces, per, keep, len(parts)


class Lease(Handle):
    """A pin on the leading present blocks of a chain (never evicted while held). Use as a context
    manager, or :meth:`close` (same as :meth:`Store.unpin`)."""

    _free = lib.tpu_sync_lease_free

    def __init__(self, ptr, keys: Sequence[bytes]) -> None:
        super().__init__(ptr)
        self._keys = list(keys)

    @property
    def count(self) -> int:
        """Number of leading blocks pinned."""
        n = ffi.new("size_t *")
        check(lib.tpu_sync_lease_count(self._handle(), n))
        return int(n[0])

    def __len__(self) -> int:
        return self.count

    @property
    def keys(self) -> List[bytes]:
        """The pinned keys (a prefix of the chain given to :meth:`Store.pin`)."""
        return self._keys[: self.count]


class Store(Handle):
    """The host KV tier (``tpu_sync::store::KvStore``). Thread-safe; every method may run
    concurrently.

    Args:
        namespace: what the blocks belong to (model, dtype, layout, rank); change it whenever
            the raw bytes of a block would mean something else.
        block_bytes: largest block in bytes.
        capacity_bytes: DRAM bytes of block slots.
        shm_name: keep the blocks in ``/dev/shm`` (or ``shm_dir``) under this name: a restarted
            process re-attaches them (warm restart). None: anonymous memory.
        disk_dir, disk_capacity_bytes: the disk tier (both or neither).
        verify_checksums: check each block's checksum on get (a mismatch raises ChecksumError).
        background: prepare memory on a thread; see :attr:`state` and :meth:`wait_ready`.
        client: a client whose plugin DMA-maps the DRAM slots (``PJRT_Client_DmaMap``), if it can.
        shm_dir: directory of named segments (default ``/dev/shm``).
        lock_memory, huge_pages, populate: memory options (default: all on; locking failures are
            reported in :meth:`info`, not raised).
        staging_budget_bytes: the tier's own budget of pinned bytes (its slots are pinned
            memory). Default None: the process-wide budget shared with every endpoint's staging
            (a quarter of the memory the process may use, capped by ``RLIMIT_MEMLOCK``;
            ``$TPU_SYNC_STAGING_BUDGET_BYTES``). A tier larger than what is left raises
            ``StagingExhaustedError``.
        kv_events: publish vLLM-format KV events (``BlockStored``/``BlockRemoved``/
            ``AllBlocksCleared``) over ZMQ: a dict with the keys ``endpoint`` (PUB,
            ``tcp://HOST:PORT``; default ``tcp://127.0.0.1:5557``), ``replay_endpoint``,
            ``buffer_steps``, ``max_queue_size``, ``topic``, ``data_parallel_rank``,
            ``dram_medium`` (``"CPU"``), ``disk_medium`` (``"STORAGE"``), ``int_hashes``,
            ``block_size`` (see ``docs/observability.md``). None (default): off.

    Raises:
        InvalidArgumentError, HostMemoryError, IOError, StagingExhaustedError.
    """

    _free = lib.tpu_sync_store_free

    def __init__(self, *, namespace: str, block_bytes: int, capacity_bytes: int, shm_name: Optional[str] = None,
                 disk_dir: Optional[str] = None, disk_capacity_bytes: Optional[int] = None,
                 verify_checksums: bool = True, background: bool = False, client: Optional[Client] = None,
                 shm_dir: Optional[str] = None, lock_memory: Optional[bool] = None,
                 huge_pages: Optional[bool] = None, populate: Optional[bool] = None,
                 staging_budget_bytes: Optional[int] = None,
                 kv_events: Optional[Dict[str, Any]] = None) -> None:
        self._ptr = None
        cfg: Dict[str, Any] = dict(namespace=ck.text("namespace", namespace),
                                   block_bytes=ck.u64("block_bytes", block_bytes),
                                   capacity_bytes=ck.u64("capacity_bytes", capacity_bytes),
                                   verify_checksums=ck.flag("verify_checksums", verify_checksums),
                                   background=ck.flag("background", background))
        if shm_name is not None:
            cfg["shm_name"] = ck.text("shm_name", shm_name)
        for k, v in dict(shm_dir=shm_dir, disk_dir=disk_dir).items():
            if v is not None:
                cfg[k] = ck.path(k, v).decode()
        if disk_capacity_bytes is not None:
            cfg["disk_capacity_bytes"] = ck.u64("disk_capacity_bytes", disk_capacity_bytes)
        if staging_budget_bytes is not None:
            cfg["staging_budget_bytes"] = ck.u64("staging_budget_bytes", staging_budget_bytes)
        for k, v in dict(lock_memory=lock_memory, huge_pages=huge_pages, populate=populate).items():
            if v is not None:
                cfg[k] = ck.flag(k, v)
        if kv_events is not None:
            if not isinstance(kv_events, dict):
                raise InvalidArgumentError(f"kv_events must be a dict, not {type(kv_events).__name__}")
            cfg["kv_events"] = dict(kv_events)
        if client is not None:
            ck.instance("client", client, Client)
        out = ffi.new("tpu_sync_store **")
        dma = ffi.NULL if client is None else client._handle()
        check(lib.tpu_sync_store_new(ck.json_text("store configuration", cfg), dma, out))
        super().__init__(out[0])
        self._client = client

    # -- state -----------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``"preparing"``, ``"ready"`` or ``"failed: <reason>"``."""
        s = ffi.new("uint32_t *")
        check(lib.tpu_sync_store_state(self._handle(), s))
        if s[0] == lib.TPU_SYNC_STORE_READY:
            return "ready"
        if s[0] == lib.TPU_SYNC_STORE_PREPARING:
            return "preparing"
        from ._lib import last_error

        lib.tpu_sync_store_wait_ready(self._handle(), 0)
        return "failed: " + last_error()

    def wait_ready(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds until the store serves.

        Raises:
            TimeoutError: still preparing. HostMemoryError: preparation failed (with the reason).
        """
        check(lib.tpu_sync_store_wait_ready(self._handle(), ck.seconds_ms("timeout", timeout)))

    def info(self) -> Optional[Dict[str, Any]]:
        """How the store was set up (attach mode, segment, geometry, memory lock, DMA, disk tier,
        restored blocks), or None while not ready."""
        return json_out(lib.tpu_sync_store_info, self._handle())

    def stats(self) -> Dict[str, int]:
        """Counters since open and occupancy: ``dram_blocks``, ``disk_blocks``, ``free_slots``,
        ``lookups``, ``lookup_blocks``, ``lookup_hits``, ``put_blocks``, ``put_present``,
        ``put_full``, ``get_dram``, ``get_disk``, ``evictions``, ``spills``, ``spill_failures``,
        ``races``, ``corrupt_blocks``, ``bad_files``, ``bytes_put``, ``bytes_got``."""
        return json_out(lib.tpu_sync_store_stats, self._handle())

    # -- keys ------------------------------------------------------------------------------------

    def chain_keys(self, tokens: Sequence[int], block_tokens: int, parent: Optional[bytes] = None) -> List[bytes]:
        """Keys of the full blocks of a token sequence cut into blocks of ``block_tokens`` tokens,
        each chained on the one before (the first on ``parent``). ``len(tokens) // block_tokens``
        keys; a partial last block gets none."""
        tokens = [ck.u32(f"tokens[{i}]", t) for i, t in enumerate(ck.items("tokens", tokens))]
        block_tokens = ck.usize("block_tokens", block_tokens)
        toks = ffi.new("uint32_t[]", tokens or [0])
        n_tok = len(tokens)
        cap = n_tok // block_tokens if block_tokens > 0 else 0
        keys = ffi.new("tpu_sync_key[]", max(1, cap))
        n = ffi.new("size_t *")
        check(lib.tpu_sync_store_chain_keys(self._handle(), toks, n_tok, int(block_tokens), _parent(parent), keys,
                                            cap, n))
        raw = ffi.buffer(keys, KEY_BYTES * int(n[0]))[:]
        return [raw[i:i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]

    def engine_key(self, h: Union[int, bytes, str]) -> bytes:
        """Key of an engine's own (already chained) block hash: bytes as given (vLLM's
        ``BlockHash``), a string's UTF-8 bytes (SGLang's page hashes), an int printed in decimal."""
        if isinstance(h, bool):
            raise ck.fail("a block hash must be bytes, str or int, not a bool")
        if isinstance(h, int):
            data = str(h).encode()
        elif isinstance(h, str):
            data = ck.cstr("hash", h)
        elif isinstance(h, (bytes, bytearray, memoryview)):
            data = bytes(h)
        else:
            raise ck.fail(f"a block hash must be bytes, str or int, got {type(h).__name__}")
        key = ffi.new("tpu_sync_key *")
        check(lib.tpu_sync_store_engine_key(self._handle(), data, len(data), key))
        return ffi.buffer(key.bytes, KEY_BYTES)[:]

    # -- operations ------------------------------------------------------------------------------

    def kv_events(self) -> Optional[Dict[str, Any]]:
        """The KV events endpoints bound (``{"endpoint": "tcp://IP:PORT", "replay_endpoint": ...}``),
        or None when the store publishes no events."""
        return json_out(lib.tpu_sync_store_kv_events, self._handle())

    def describe_blocks(self, keys: Sequence[bytes], hashes: Sequence[bytes],
                        token_ids: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Gives blocks ``keys`` the engine hashes ``hashes`` (all of one length, e.g. vLLM's
        ``BlockHash`` bytes) and optionally their token ids (one list per block, all of one length)
        for the store's KV events; call it before storing them. A no-op without ``kv_events``.

        Raises:
            InvalidArgumentError: counts or lengths differ, empty hashes.
        """
        keys = ck.items("keys", keys)
        hashes = ck.items("hashes", hashes)
        for i, h in enumerate(hashes):
            if not isinstance(h, (bytes, bytearray, memoryview)):
                raise ck.fail(f"hash {i} must be bytes, got {type(h).__name__}")
        hashes = [bytes(h) for h in hashes]
        if len(hashes) != len(keys):
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"{len(keys)} keys but {len(hashes)} hashes")
        if not keys:
            return
        hl = len(hashes[0])
        if hl == 0 or any(len(h) != hl for h in hashes):
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, "hashes must be non-empty and of one length")
        tpb = 0
        toks = ffi.NULL
        if token_ids is not None:
            token_ids = [[ck.u32(f"token_ids[{i}]", t) for t in ck.items(f"token_ids[{i}]", ts)]
                         for i, ts in enumerate(ck.items("token_ids", token_ids))]
            if len(token_ids) != len(keys) or len({len(t) for t in token_ids}) != 1:
                raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT,
                                                  "token_ids: one list per key, all of one length")
            tpb = len(token_ids[0])
            toks = ffi.new("uint32_t[]", [t for ts in token_ids for t in ts]) if tpb else ffi.NULL
        ks, n = _keys(keys)
        check(lib.tpu_sync_store_describe_blocks(self._handle(), ks, n, b"".join(hashes), hl, toks, tpb))

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading blocks of the chain present (DRAM or disk); updates their recency."""
        arr, n = _keys(keys)
        hits = ffi.new("size_t *")
        check(lib.tpu_sync_store_lookup(self._handle(), arr, n, hits, ffi.NULL, ffi.NULL))
        return int(hits[0])

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any], parent: Optional[bytes] = None) -> PutResult:
        """Stores a chain of blocks from host arrays (numpy, torch CPU tensors, bytes-like):
        ``blocks[i]`` is the block of ``keys[i]``, copied during the call. ``parent`` is the key
        of the block before ``keys[0]`` (None for a sequence's first block, or unknown).

        Raises: InvalidArgumentError (counts differ, an empty or too large block)."""
        arr, n = _keys(keys)
        blocks = ck.items("blocks", blocks)
        if len(blocks) != n:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"{n} keys but {len(blocks)} blocks")
        views = [view(b) for b in blocks]
        if any(v.on_device for v in views):
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, "device tensors: use put_from_device")
        ptrs = ffi.new("void *[]", [ffi.cast("void *", v.ptr) for v in views] or [ffi.NULL])
        lens = ffi.new("size_t[]", [v.nbytes for v in views] or [0])
        r = ffi.new("tpu_sync_put_result *")
        check(lib.tpu_sync_store_put(self._handle(), _parent(parent), arr, n, ptrs, lens, r))
        return _put_result(r)

    def put_from_device(self, keys: Sequence[bytes], blocks: Sequence[Sequence[DevicePiece]],
                        parent: Optional[bytes] = None) -> PutResult:
        """Stores a chain of blocks from device buffers: block ``i`` is the concatenation of the
        pieces ``blocks[i]`` = ``[(buffer, offset, length), ...]`` (D2H, completed in the call)."""
        arr, n = _keys(keys)
        blocks = ck.items("blocks", blocks)
        pieces, n_pieces, per, keep = _pieces(blocks)
        if len(blocks) != n:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"{n} keys but {len(blocks)} blocks")
        r = ffi.new("tpu_sync_put_result *")
        check(lib.tpu_sync_store_put_from_device(self._handle(), _parent(parent), arr, n, pieces, n_pieces, per, r))
        del keep
        return _put_result(r)

    def get(self, keys: Sequence[bytes], outs: Sequence[Any]) -> GetResult:
        """Copies the leading present blocks of the chain into writable host arrays: ``outs[i]``
        receives block ``keys[i]`` and must be exactly as long as it was stored.

        Raises: InvalidArgumentError (wrong lengths), ChecksumError (a block failed its checksum;
        it and its chain below it are dropped)."""
        arr, n = _keys(keys)
        outs = ck.items("outs", outs)
        if len(outs) != n:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"{n} keys but {len(outs)} destinations")
        views = [view(o, writable=True) for o in outs]
        if any(v.on_device for v in views):
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, "device tensors: use get_to_device")
        ptrs = ffi.new("void *[]", [ffi.cast("void *", v.ptr) for v in views] or [ffi.NULL])
        lens = ffi.new("size_t[]", [v.nbytes for v in views] or [0])
        r = ffi.new("tpu_sync_get_result *")
        check(lib.tpu_sync_store_get(self._handle(), arr, n, ptrs, lens, r))
        return _get_result(r)

    def get_to_device(self, keys: Sequence[bytes], blocks: Sequence[Sequence[DevicePiece]]) -> GetResult:
        """Copies the leading present blocks into existing device blocks in place: block ``i`` goes
        to the pieces ``blocks[i]`` (which must add up to its stored length).

        Raises: as :meth:`get`, plus UnsupportedError (no in-place H2D path)."""
        arr, n = _keys(keys)
        blocks = ck.items("blocks", blocks)
        if len(blocks) != n:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"{n} keys but {len(blocks)} blocks")
        pieces, n_pieces, per, keep = _pieces(blocks)
        r = ffi.new("tpu_sync_get_result *")
        check(lib.tpu_sync_store_get_to_device(self._handle(), arr, n, pieces, n_pieces, per, r))
        del keep
        return _get_result(r)

    def pin(self, keys: Sequence[bytes]) -> Lease:
        """Pins the leading present blocks of the chain (see :class:`Lease`)."""
        arr, n = _keys(keys)
        out = ffi.new("tpu_sync_lease **")
        check(lib.tpu_sync_store_pin(self._handle(), arr, n, out))
        return Lease(out[0], keys)

    # ---- KV cache groups (hybrid models): one part per group per block --------------------

    def lookup_groups(self, groups: Sequence[Dict[str, Any]], block_tokens: int, keys: Sequence[bytes]) -> int:
        """Hybrid models: the longest prefix (in blocks) of the chain ``keys`` that every KV
        cache group can serve (``tpu_sync::store::KvStore::lookup_groups``): the parts of every
        ``"full"`` group for blocks ``0..n``, every ``"window"`` group's parts of the blocks its
        window covers at the end of block ``n - 1``, every ``"state"`` group's part of block
        ``n - 1``. ``groups``: one dict per group, in the model's order, ``{"role": "full" |
        "window" | "state", "part_bytes": bytes of one block's part (the group's block in
        every layer of the group on this rank), "window_tokens": tokens (window only)}``;
        ``block_tokens``: tokens per engine block. 0 while the store is not ready.

        Raises: InvalidArgumentError (bad groups)."""
        g, ng = _groups(groups)
        arr, n = _keys(keys)
        out = ffi.new("size_t *")
        check(lib.tpu_sync_store_lookup_groups(self._handle(), g, ng, ck.u32("block_tokens", block_tokens), arr, n,
                                               out))
        return int(out[0])

    def pin_groups(self, groups: Sequence[Dict[str, Any]], block_tokens: int, keys: Sequence[bytes],
                   blocks: int) -> Optional["Lease"]:
        """Hybrid models: pins every part a hit of ``blocks`` leading blocks of ``keys`` needs
        (see :meth:`lookup_groups`), or returns None (nothing pinned) unless all are present."""
        g, ng = _groups(groups)
        arr, n = _keys(keys)
        out = ffi.new("tpu_sync_lease **")
        check(lib.tpu_sync_store_pin_groups(self._handle(), g, ng, ck.u32("block_tokens", block_tokens), arr, n,
                                            ck.u64("blocks", blocks), out))
        return None if out[0] == ffi.NULL else Lease(out[0], list(keys)[:blocks])

    def put_groups_from_device(self, groups: Sequence[Dict[str, Any]], block_tokens: int, keys: Sequence[bytes],
                               parts: Sequence[Any], parent: Optional[bytes] = None) -> Dict[str, int]:
        """Hybrid models: stores parts of the blocks of the chain ``keys`` from device buffers
        (D2H, completed in the call). ``parts``: ``(block index, group index, [(buffer, offset,
        length), ...])``, the pieces concatenated being exactly the group's ``part_bytes``.
        Every ``"full"`` group's part of every block is required; window and state parts are
        optional. Returns ``stored``, ``present``, ``full_at`` (None: every spine part stored),
        ``missed`` (window or state parts not stored for lack of room), ``not_ready``,
        ``bytes``.

        Raises: InvalidArgumentError (bad groups, a part of the wrong size, block or group, a
        part given twice, a missing full-group part), device errors."""
        g, ng = _groups(groups)
        arr, n = _keys(keys)
        blocks, grps, pieces, n_pieces, per, keep, n_parts = _group_parts(parts)
        r = ffi.new("tpu_sync_put_result *")
        missed = ffi.new("size_t *")
        check(lib.tpu_sync_store_put_groups_from_device(self._handle(), g, ng, ck.u32("block_tokens", block_tokens),
                                                        _parent(parent), arr, n, blocks, grps, n_parts, pieces,
                                                        n_pieces, per, r, missed))
        del keep
        res = _put_result(r)
        return dict(stored=res.stored, present=res.present, full_at=res.full_at, missed=int(missed[0]),
                    not_ready=res.not_ready, bytes=res.bytes)

    def get_groups_to_device(self, groups: Sequence[Dict[str, Any]], block_tokens: int, keys: Sequence[bytes],
                             parts: Sequence[Any]) -> GetResult:
        """Hybrid models: copies parts of the chain ``keys`` into existing device blocks in place,
        in order (``parts`` as for :meth:`put_groups_from_device`); stops at the first part not
        wholly present: ``delivered`` counts the leading parts delivered whole. Pin them first
        (:meth:`pin_groups`) to rule out a concurrent eviction.

        Raises: as :meth:`get_to_device`, and InvalidArgumentError for bad groups or parts."""
        g, ng = _groups(groups)
        arr, n = _keys(keys)
        blocks, grps, pieces, n_pieces, per, keep, n_parts = _group_parts(parts)
        r = ffi.new("tpu_sync_get_result *")
        check(lib.tpu_sync_store_get_groups_to_device(self._handle(), g, ng, ck.u32("block_tokens", block_tokens),
                                                      arr, n, blocks, grps, n_parts, pieces, n_pieces, per, r))
        del keep
        return _get_result(r)

    def unpin(self, lease: Lease) -> None:
        """Releases a lease (same as ``lease.close()``)."""
        ck.instance("lease", lease, Lease).close()

    def remove(self, keys: Sequence[bytes]) -> int:
        """Removes blocks by key, each with its chain below it; returns how many were removed."""
        arr, n = _keys(keys)
        out = ffi.new("size_t *")
        check(lib.tpu_sync_store_remove(self._handle(), arr, n, out))
        return int(out[0])

    def clear(self) -> int:
        """Removes every block not pinned or in flight; returns how many."""
        out = ffi.new("size_t *")
        check(lib.tpu_sync_store_clear(self._handle(), out))
        return int(out[0])

    def flush_to_disk(self) -> int:
        """Writes every DRAM block without a disk copy to the disk tier; returns how many.

        Raises: InvalidArgumentError without a disk tier, IOError."""
        out = ffi.new("size_t *")
        check(lib.tpu_sync_store_flush_to_disk(self._handle(), out))
        return int(out[0])


def list_segments(dir: Optional[str] = None) -> List[Dict[str, Any]]:  # noqa: A002 - mirrors the CLI
    """Named store segments in ``dir`` (default ``/dev/shm``): ``name``, ``path``, ``bytes``,
    ``uid``, ``mode``, ``in_use``, ``namespace``, ``block_bytes``, ``num_slots``,
    ``committed_blocks``."""
    d = ffi.NULL if dir is None else ck.path("dir", dir)
    return json_out(lib.tpu_sync_shm_list, d)


def remove_segment(name: str, force: bool = False, dir: Optional[str] = None) -> None:  # noqa: A002
    """Removes a named segment. Refused (IOError) when in use by a live process or owned by another
    user, unless ``force``."""
    d = ffi.NULL if dir is None else ck.path("dir", dir)
    check(lib.tpu_sync_shm_remove(d, ck.cstr("name", name), ck.flag("force", force)))


__all__ = ["GetResult", "Lease", "PutResult", "Store", "list_segments", "remove_segment"]
