"""Reading pointer, size, shape and dtype from host or device arrays without importing torch or
numpy (they are used only if the caller passes their objects)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from . import _check as ck
from ._native import ffi, lib
from .errors import HostMemoryError, InvalidArgumentError, UnsupportedError

#: Names used by tpu_sync for element types, and their native ``tpu_sync_dtype`` values.
DTYPES = {
    "u8": lib.TPU_SYNC_DTYPE_U8,
    "bf16": lib.TPU_SYNC_DTYPE_BF16,
    "f16": lib.TPU_SYNC_DTYPE_F16,
    "f32": lib.TPU_SYNC_DTYPE_F32,
    "f8e4m3fn": lib.TPU_SYNC_DTYPE_F8E4M3FN,
    "s8": lib.TPU_SYNC_DTYPE_S8,
    "s32": lib.TPU_SYNC_DTYPE_S32,
}

#: Bytes per element of each of :data:`DTYPES`.
ITEMSIZE = {"u8": 1, "bf16": 2, "f16": 2, "f32": 4, "f8e4m3fn": 1, "s8": 1, "s32": 4}

_ALIASES = {
    "uint8": "u8",
    "int8": "s8",
    "int32": "s32",
    "float16": "f16",
    "half": "f16",
    "float32": "f32",
    "float": "f32",
    "bfloat16": "bf16",
    "float8_e4m3fn": "f8e4m3fn",
}


def dtype_name(d: Any) -> str:
    """Normalises a dtype given as a tpu_sync name, a numpy dtype or a torch dtype."""
    try:
        s = str(d).replace("torch.", "")
    except Exception:  # an object whose str() raises
        raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, "unsupported dtype") from None
    s = _ALIASES.get(s, s)
    if s not in DTYPES:
        raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"unsupported dtype {d!r}")
    return s


def _known_dtype(d: Any) -> Optional[str]:
    """The tpu_sync name of an array's own dtype, or None when it has none (raw bytes are still
    usable: copies and stores only need the address and size; a device buffer needs ``dtype=``)."""
    try:
        return dtype_name(d)
    except InvalidArgumentError:
        return None


def resolve_dtype(v: "ArrayView", override: Any, obj: Any) -> str:
    """``override`` (any dtype spelling) if given, else the array's own dtype; an array whose
    dtype tpu_sync lacks needs the override."""
    if override is not None:
        return dtype_name(override)
    if v.dtype is None:
        raise InvalidArgumentError(
            lib.TPU_SYNC_INVALID_ARGUMENT,
            f"unsupported dtype {getattr(obj, 'dtype', '?')!r}: pass dtype= (e.g. dtype='bf16' for "
            "bf16 data held in a uint16 array)")
    return v.dtype


@dataclass
class ArrayView:
    """Where an array's bytes are.

    Attributes:
        ptr: address of the first byte (host address, or device address when ``on_device``).
        nbytes: size in bytes.
        shape: dimensions.
        dtype: tpu_sync dtype name (``"bf16"``, ``"f32"``, ...), or None when the array's dtype
            has none (e.g. ``uint16``; see :func:`resolve_dtype`).
        on_device: True for accelerator tensors (the pointer is a device pointer).
        keepalive: the object (or cffi buffer) that must stay alive while ``ptr`` is used.
    """

    ptr: int
    nbytes: int
    shape: Tuple[int, ...]
    dtype: Optional[str]
    on_device: bool
    keepalive: Any


def view(obj: Any, writable: bool = False) -> ArrayView:
    """Describes a contiguous torch tensor, numpy array, or buffer-protocol object
    (``bytes``, ``bytearray``, ``memoryview``; dtype ``u8``)."""
    mod = type(obj).__module__ or ""
    if mod.startswith("torch") and hasattr(obj, "data_ptr"):
        if not obj.is_contiguous():
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, "tensor is not contiguous")
        return ArrayView(
            ptr=int(obj.data_ptr()),
            nbytes=int(obj.numel()) * int(obj.element_size()),
            shape=tuple(int(s) for s in obj.shape),
            dtype=_known_dtype(obj.dtype),
            on_device=obj.device.type != "cpu",
            keepalive=obj,
        )
    if mod.startswith("numpy") and hasattr(obj, "__array_interface__"):
        if not obj.flags["C_CONTIGUOUS"]:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, "array is not C-contiguous")
        if writable and not obj.flags["WRITEABLE"]:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, "array is read-only")
        return ArrayView(
            ptr=int(obj.__array_interface__["data"][0]),
            nbytes=int(obj.nbytes),
            shape=tuple(int(s) for s in obj.shape),
            dtype=_known_dtype(obj.dtype),
            on_device=False,
            keepalive=obj,
        )
    try:
        buf = ffi.from_buffer(obj, require_writable=writable)
    except (TypeError, BufferError, ValueError) as e:
        raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"cannot use {type(obj).__name__} as an array: {e}")
    n = len(buf)
    return ArrayView(int(ffi.cast("uintptr_t", buf)), n, (n,), "u8", False, buf)


def aligned_array(shape: Any, dtype: Any = "uint8", align: int = 64) -> Any:
    """A zero-filled numpy array whose data starts on an ``align``-byte boundary (views need 64).
    Needs numpy. ``shape`` is an int or a tuple; ``dtype`` anything numpy accepts."""
    try:
        import numpy as np  # imported only when asked for
    except ImportError:
        raise UnsupportedError(lib.TPU_SYNC_UNSUPPORTED, "aligned_array needs numpy") from None
    try:
        dt = np.dtype(dtype)
    except Exception as e:  # numpy raises TypeError or ValueError for what it cannot parse
        raise ck.fail(f"dtype {ck._short(dtype)} is not a numpy dtype: {e}") from None
    if dt.itemsize == 0 or dt.hasobject:
        raise ck.fail(f"dtype {dt} has no fixed-size elements")
    if isinstance(shape, bool) or not isinstance(shape, (list, tuple)):
        shape = (ck.integer("shape", shape, 0, ck.I64_MAX),)
    else:
        shape = tuple(ck.integer(f"shape[{i}]", d, 0, ck.I64_MAX) for i, d in enumerate(shape))
    align = ck.integer("align", align, 1, 1 << 30)
    if align & (align - 1):
        raise ck.fail(f"align = {align} is not a power of two")
    n = dt.itemsize
    for d in shape:
        n *= d
    if n > 1 << 40:
        raise ck.fail(f"an array of {n} bytes is too large")
    try:
        raw = np.zeros(n + align, dtype=np.uint8)
    except MemoryError:
        raise HostMemoryError(lib.TPU_SYNC_HOST_MEMORY, f"cannot allocate {n} bytes") from None
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dt).reshape(shape)
