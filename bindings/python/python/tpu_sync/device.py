"""Asynchronous batched raw copies between device buffers and host memory, and DMA pacing."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple, Union

from . import _check as ck
from ._lib import AsyncOp, check, json_out
from ._native import ffi, lib
from .arrays import view
from .client import Buffer
from .errors import InvalidArgumentError

#: One copy: (buffer, byte offset in the buffer, host array) or (buffer, offset, host array,
#: bytes); without a byte count the whole host array is copied.
CopySpec = Union[Tuple[Buffer, int, Any], Tuple[Buffer, int, Any, int]]


class Copy(AsyncOp):
    """A submitted batch of raw copies (see :func:`d2h`, :func:`h2d`): :attr:`done`,
    :meth:`wait`, :meth:`cancel`, :meth:`add_done_callback`, :attr:`error`.

    ``wait`` returns ``{"bytes", "ops", "chunks", "elapsed_s"}``. The batch keeps its buffers
    and host arrays alive; closing (or garbage-collecting) an unfinished batch cancels it and
    blocks until the copies in flight complete, so host memory is never written afterwards.
    """

    _free = lib.tpu_sync_copy_free
    _poll = lib.tpu_sync_copy_poll
    _wait = lib.tpu_sync_copy_wait
    _cancel = lib.tpu_sync_copy_cancel
    _set_callback = lib.tpu_sync_copy_set_callback
    _stats_type = "tpu_sync_copy_stats"

    def _stats_dict(self, s) -> Dict[str, Any]:
        return {"bytes": int(s.bytes), "ops": int(s.ops), "chunks": int(s.chunks),
                "elapsed_s": int(s.elapsed_ns) / 1e9}

    @property
    def bytes_done(self) -> int:
        """Bytes of chunks completed so far."""
        d, n = ffi.new("bool *"), ffi.new("uint64_t *")
        check(lib.tpu_sync_copy_poll(self._handle(), d, n))
        return int(n[0])


def _submit(direction: int, copies: Iterable[CopySpec], max_outstanding_chunks: int) -> Copy:
    specs = ck.items("copies", copies)
    outstanding = ck.usize("max_outstanding_chunks", max_outstanding_chunks)
    ops = ffi.new("tpu_sync_copy_op[]", max(1, len(specs)))
    keep = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, (tuple, list)) or len(spec) not in (3, 4):
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT,
                                       f"copy {i}: expected (buffer, offset, host[, nbytes])")
        buf, host = spec[0], spec[2]
        offset = ck.u64(f"copy {i} offset", spec[1])
        if not isinstance(buf, Buffer):
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"copy {i}: {type(buf).__name__} is not a Buffer")
        v = view(host, writable=(direction == lib.TPU_SYNC_D2H))
        if v.on_device:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"copy {i}: host side is device memory")
        n = v.nbytes if len(spec) == 3 else ck.usize(f"copy {i} nbytes", spec[3])
        if n > v.nbytes:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT,
                                       f"copy {i}: {n} bytes but the host array has {v.nbytes}")
        ops[i].buffer = buf._handle()
        ops[i].offset = offset
        ops[i].len = n
        ops[i].host = ffi.cast("void *", v.ptr)
        keep.append((buf, v.keepalive))
    out = ffi.new("tpu_sync_copy **")
    check(lib.tpu_sync_copy_submit(direction, ops, len(specs), outstanding, out))
    return Copy(out[0], keepalive=keep)


def d2h(copies: Iterable[CopySpec], max_outstanding_chunks: int = 0) -> Copy:
    """Device to host: submits ``PJRT_Buffer_CopyRawToHost`` of every copy through the process's
    DMA pacer and returns at once. Host arrays must be writable and not touched until the batch
    is done. ``max_outstanding_chunks`` limits this batch's chunks in flight (0: only the pacer's
    budget).

    Raises (nothing issued): InvalidArgumentError for ranges outside a buffer or overlapping host
    destinations.
    """
    return _submit(lib.TPU_SYNC_D2H, copies, max_outstanding_chunks)


def h2d(copies: Iterable[CopySpec], max_outstanding_chunks: int = 0) -> Copy:
    """Host to device, in place into the existing buffers (the client's probed path). Host
    arrays must not change until the batch is done; no computation may use the destination
    ranges meanwhile.

    Raises: InvalidArgumentError (ranges, overlapping destinations, buffers of different
    plugins), UnsupportedError (the plugin has no in-place H2D path).
    """
    return _submit(lib.TPU_SYNC_H2D, copies, max_outstanding_chunks)


def pacing() -> Dict[str, int]:
    """The process-wide DMA pacing (TPU Sync's ``get_dma_pacing``): ``chunk_bytes``,
    ``max_inflight_bytes`` and the counters ``bytes``, ``chunks``, ``batches``,
    ``failed_batches``, ``inflight_bytes``, ``peak_inflight_bytes``."""
    return json_out(lib.tpu_sync_pacing_stats)


def set_pacing(chunk_bytes: Optional[int] = None, max_inflight_bytes: Optional[int] = None) -> None:
    """Sets the process-wide DMA pacing (TPU Sync's ``set_dma_pacing``): copies split into chunks
    of at most ``chunk_bytes`` (0: unsplit), at most ``max_inflight_bytes`` in flight (0:
    unlimited). None keeps the current value. Applies to chunks issued from now on."""
    c = ck.optional(ck.u64, "chunk_bytes", chunk_bytes)
    m = ck.optional(ck.u64, "max_inflight_bytes", max_inflight_bytes)
    cur = pacing()
    c = cur["chunk_bytes"] if c is None else c
    m = cur["max_inflight_bytes"] if m is None else m
    check(lib.tpu_sync_pacing_set(c, m))


def pause_pacing() -> None:
    """Stops issuing new copy chunks process-wide (batches queue up in order; chunks in flight
    complete; cancellations still work) until :func:`resume_pacing`."""
    check(lib.tpu_sync_pacing_pause(True))


def resume_pacing() -> None:
    """Resumes issuing after :func:`pause_pacing`."""
    check(lib.tpu_sync_pacing_pause(False))


__all__ = ["Copy", "CopySpec", "d2h", "h2d", "pacing", "pause_pacing", "resume_pacing", "set_pacing"]
