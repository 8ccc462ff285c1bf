"""Exceptions raised by tpu_sync. Every one carries the native status code and message."""

from __future__ import annotations

import builtins


class TpuSyncError(Exception):
    """Base class of all tpu_sync errors.

    Attributes:
        status: the native ``tpu_sync_status`` value (int).
        message: the native library's message.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"{STATUS_NAMES.get(self.status, self.status)}: {self.message}"


class InvalidArgumentError(TpuSyncError, ValueError):
    """An argument is invalid (size, index, alignment, value, JSON)."""


class NullPointerError(TpuSyncError, ValueError):
    """A required pointer was NULL (a bug in the bindings or a closed object)."""


class InvalidHandleError(TpuSyncError):
    """A handle is closed, freed or of the wrong type."""


class PluginLoadError(TpuSyncError, OSError):
    """The PJRT plugin could not be loaded."""


class PjrtError(TpuSyncError, RuntimeError):
    """A PJRT call failed."""


class UnsupportedError(TpuSyncError, NotImplementedError):
    """The plugin lacks what the operation needs."""


class LayoutError(TpuSyncError, ValueError):
    """A KV or parallel layout is inconsistent."""


class BlockRangeError(TpuSyncError, IndexError):
    """A block id is out of range, or a block list is malformed."""


class MismatchError(TpuSyncError, ValueError):
    """The two sides of a transfer disagree (layouts, plan, protocol)."""


class ProtocolError(TpuSyncError):
    """A peer violated the wire protocol."""


class ChecksumError(TpuSyncError):
    """A checksum did not match: the data was not used."""


class RemoteError(TpuSyncError):
    """The remote peer reported an error."""


class PeerClosedError(TpuSyncError, ConnectionError):
    """The peer closed the connection or died."""


class TimeoutError(TpuSyncError, builtins.TimeoutError):  # noqa: A001 - intentional subclass
    """A deadline passed."""


class UnknownRequestError(TpuSyncError, KeyError):
    """The request id is not registered."""


class HostMemoryError(TpuSyncError, MemoryError):
    """Host memory could not be allocated or mapped."""


class IOError(TpuSyncError, OSError):  # noqa: A001 - intentional subclass
    """An operating-system I/O error."""


class CancelledError(TpuSyncError):
    """The operation was cancelled."""


class BufferTooSmallError(TpuSyncError):
    """An output buffer was too small (handled inside the bindings)."""


class PendingError(TpuSyncError, builtins.TimeoutError):
    """An asynchronous operation has not completed yet: a wait ran out of time (the operation
    itself goes on; wait again, or cancel it). Distinct from :class:`TimeoutError`, which means
    the operation itself failed with a deadline."""


class StagingExhaustedError(TpuSyncError, MemoryError):
    """Staging memory would exceed its byte budget: the request was refused at once, and nothing
    already staged was touched."""


class InternalError(TpuSyncError, RuntimeError):
    """A panic was caught inside the native library (a bug; please report the message)."""


_BY_STATUS = {
    1: InvalidArgumentError,
    2: NullPointerError,
    3: InvalidHandleError,
    4: PluginLoadError,
    5: PjrtError,
    6: UnsupportedError,
    7: LayoutError,
    8: BlockRangeError,
    9: MismatchError,
    10: ProtocolError,
    11: ChecksumError,
    12: RemoteError,
    13: PeerClosedError,
    14: TimeoutError,
    15: UnknownRequestError,
    16: HostMemoryError,
    17: IOError,
    18: CancelledError,
    19: BufferTooSmallError,
    20: PendingError,
    21: StagingExhaustedError,
    100: InternalError,
}

STATUS_NAMES = {
    0: "TPU_SYNC_OK",
    1: "TPU_SYNC_INVALID_ARGUMENT",
    2: "TPU_SYNC_NULL_POINTER",
    3: "TPU_SYNC_INVALID_HANDLE",
    4: "TPU_SYNC_PLUGIN_LOAD",
    5: "TPU_SYNC_PJRT",
    6: "TPU_SYNC_UNSUPPORTED",
    7: "TPU_SYNC_LAYOUT",
    8: "TPU_SYNC_BLOCK_RANGE",
    9: "TPU_SYNC_MISMATCH",
    10: "TPU_SYNC_PROTOCOL",
    11: "TPU_SYNC_CHECKSUM",
    12: "TPU_SYNC_REMOTE",
    13: "TPU_SYNC_PEER_CLOSED",
    14: "TPU_SYNC_TIMEOUT",
    15: "TPU_SYNC_UNKNOWN_REQUEST",
    16: "TPU_SYNC_HOST_MEMORY",
    17: "TPU_SYNC_IO",
    18: "TPU_SYNC_CANCELLED",
    19: "TPU_SYNC_BUFFER_TOO_SMALL",
    20: "TPU_SYNC_PENDING",
    21: "TPU_SYNC_STAGING_EXHAUSTED",
    100: "TPU_SYNC_PANIC",
}


def from_status(status: int, message: str) -> TpuSyncError:
    """The exception for a native status code."""
    return _BY_STATUS.get(status, TpuSyncError)(status, message)
