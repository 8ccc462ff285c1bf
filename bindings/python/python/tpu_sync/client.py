"""PJRT clients and device buffers."""

from __future__ import annotations

import json
from typing import Any, Dict, Optional, Sequence

from ._lib import Handle, check, out_string
from ._native import ffi, lib
from .arrays import DTYPES, dtype_name, view
from .errors import InvalidArgumentError


class Client(Handle):
    """A PJRT client created by tpu_sync (loads the plugin, creates the client, probes its copy
    paths). Thread-safe.

    Args:
        plugin: path of the PJRT plugin (.so); default ``$TPU_SYNC_PJRT_PLUGIN``, else the XLA CPU
            plugin installed by ``make plugin``.
        cpu_devices: number of devices to ask the XLA CPU plugin for (ignored by other plugins).

    Raises:
        PluginLoadError, PjrtError.
    """

    _free = lib.tpu_sync_client_free

    def __init__(self, plugin: Optional[str] = None, cpu_devices: Optional[int] = None) -> None:
        out = ffi.new("tpu_sync_client **")
        path = ffi.NULL if plugin is None else str(plugin).encode()
        check(lib.tpu_sync_client_new(path, int(cpu_devices or 0), out))
        super().__init__(out[0])

    @property
    def info(self) -> Dict[str, Any]:
        """Platform, API version, devices with memory kinds, D2H/H2D paths, DMA map support."""
        return json.loads(out_string(lib.tpu_sync_client_info, self._handle()))

    @property
    def device_count(self) -> int:
        """Number of addressable devices."""
        n = ffi.new("size_t *")
        check(lib.tpu_sync_client_device_count(self._handle(), n))
        return int(n[0])

    def buffer_from_host(self, data: Any, device: int = 0, shape: Optional[Sequence[int]] = None,
                         dtype: Optional[str] = None) -> "Buffer":
        """Copies a host array (numpy, torch CPU tensor, bytes-like) into a new device buffer on
        ``device``. Shape and dtype are read from the object unless given."""
        v = view(data)
        if v.on_device:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, "buffer_from_host needs host memory")
        dims = list(shape) if shape is not None else list(v.shape)
        dt = dtype_name(dtype) if dtype is not None else v.dtype
        out = ffi.new("tpu_sync_buffer **")
        c_dims = ffi.new("int64_t[]", dims)
        check(lib.tpu_sync_buffer_from_host(self._handle(), device, ffi.cast("void *", v.ptr), v.nbytes,
                                            c_dims, len(dims), DTYPES[dt], out))
        return Buffer(out[0])


class Buffer(Handle):
    """A PJRT device buffer. Raw copies address bytes ``0 .. size``. Thread-safe."""

    _free = lib.tpu_sync_buffer_free

    @property
    def size(self) -> int:
        """On-device size in bytes."""
        n = ffi.new("uint64_t *")
        check(lib.tpu_sync_buffer_size(self._handle(), n))
        return int(n[0])

    def read(self, offset: int = 0, size: Optional[int] = None, out: Any = None) -> Any:
        """D2H: copies ``size`` bytes at ``offset`` into ``out`` (a writable array) or into new
        ``bytes`` when ``out`` is None. Blocks (the GIL is released during the copy)."""
        if out is None:
            n = self.size - offset if size is None else size
            buf = bytearray(n)
            self.read(offset, n, buf)
            return bytes(buf)
        v = view(out, writable=True)
        n = v.nbytes if size is None else size
        if n > v.nbytes:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, f"{n} bytes do not fit in {v.nbytes}")
        check(lib.tpu_sync_buffer_read(self._handle(), offset, ffi.cast("void *", v.ptr), n))
        return out

    def write(self, offset: int, data: Any) -> None:
        """H2D in place: writes the bytes of ``data`` at ``offset`` of this existing buffer."""
        v = view(data)
        check(lib.tpu_sync_buffer_write(self._handle(), offset, ffi.cast("void *", v.ptr), v.nbytes))
