"""PJRT clients and device buffers: created here, adopted from a framework, or zero-copy views
of existing memory."""

from __future__ import annotations

import json
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _check as ck
from ._lib import Handle, check, json_out, out_string
from ._native import ffi, lib
from .arrays import DTYPES, resolve_dtype, view
from .errors import InvalidArgumentError, UnsupportedError


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
        self._ptr = None
        path = ffi.NULL if plugin is None else ck.path("plugin", plugin)
        n = 0 if cpu_devices is None else ck.integer("cpu_devices", cpu_devices, 0, 1024)
        out = ffi.new("tpu_sync_client **")
        check(lib.tpu_sync_client_new(path, n, out))
        super().__init__(out[0])

    @classmethod
    def adopt(cls, api_ptr: int, client_ptr: int) -> "Client":
        """Adopts a PJRT client created by the caller (e.g. a framework's own client).

        Args:
            api_ptr: address of the ``const PJRT_Api*`` table the client was created through
                (``GetPjrtApi()``); must stay valid for the life of the process.
            client_ptr: address of the live ``PJRT_Client*``. It is never destroyed here: keep
                it alive until this object and everything made from it are closed.

        Raises:
            PluginLoadError: the table is too small or of another major version.
            PjrtError: the client does not answer.
        """
        api = ck.integer("api_ptr", api_ptr, 0, ck.U64_MAX)
        cl = ck.integer("client_ptr", client_ptr, 0, ck.U64_MAX)
        out = ffi.new("tpu_sync_client **")
        check(lib.tpu_sync_client_adopt(ffi.cast("void *", api), ffi.cast("void *", cl), out))
        obj = cls.__new__(cls)
        Handle.__init__(obj, out[0])
        return obj

    def _pjrt(self) -> Tuple[int, int]:
        api, client = ffi.new("void **"), ffi.new("void **")
        check(lib.tpu_sync_client_pjrt(self._handle(), ffi.cast("const void **", api), client))
        return int(ffi.cast("uintptr_t", api[0])), int(ffi.cast("uintptr_t", client[0]))

    @property
    def pjrt_api(self) -> int:
        """Address of the client's ``const PJRT_Api*`` (borrowed: valid while the client lives)."""
        return self._pjrt()[0]

    @property
    def pjrt_client(self) -> int:
        """Address of the client's ``PJRT_Client*`` (borrowed: never destroy it)."""
        return self._pjrt()[1]

    @property
    def info(self) -> Dict[str, Any]:
        """Platform, API version, devices with memory kinds, D2H/H2D paths, DMA map support."""
        return json.loads(out_string(lib.tpu_sync_client_info, self._handle()))

    def _platform(self) -> str:
        """The PJRT platform name (``"cpu"``, ``"cuda"``, ``"tpu"``), read once."""
        p = getattr(self, "_platform_name", None)
        if p is None:
            p = str(self.info.get("platform", ""))
            self._platform_name = p
        return p

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
        device = ck.usize("device", device)
        v = view(data)
        if v.on_device:
            raise InvalidArgumentError(lib.TPU_SYNC_INVALID_ARGUMENT, "buffer_from_host needs host memory")
        dims = _dims(shape, v.shape)
        dt = resolve_dtype(v, dtype, data)
        out = ffi.new("tpu_sync_buffer **")
        c_dims = ffi.new("int64_t[]", dims or [0])
        check(lib.tpu_sync_buffer_from_host(self._handle(), device, ffi.cast("void *", v.ptr), v.nbytes,
                                            c_dims, len(dims), DTYPES[dt], out))
        return Buffer(out[0])

    def view(self, array: Any, device: int = 0, shape: Optional[Sequence[int]] = None,
             dtype: Optional[str] = None, memory: Optional[str] = None) -> "Buffer":
        """A PJRT buffer over ``array``'s memory **without copying**
        (``PJRT_Client_CreateViewOfDeviceBuffer``).

        ``array`` is a numpy array or torch CPU tensor on the XLA CPU plugin, or an accelerator
        tensor (through its ``data_ptr()``) on that accelerator's plugin; contiguous and 64-byte
        aligned (torch's CPU allocator aligns to 64; for numpy see :func:`tpu_sync.aligned_array`).
        Shape and dtype are read from the object unless given. ``memory`` names the device's
        memory space (e.g. ``"device"``, ``"pinned_host"``; default: the device's default).

        Reads and writes through the buffer and through ``array`` alias each other. The buffer
        keeps ``array`` alive; after :meth:`Buffer.close` it is kept until the plugin has let go
        of the memory (:attr:`Buffer.released`).

        Raises:
            InvalidArgumentError: misaligned or non-contiguous memory, shape larger than the
                array, unknown device or memory kind, or a plugin that copied instead of aliasing.
            UnsupportedError: an accelerator tensor on the CPU plugin's client.
            UnsupportedError, PjrtError: the plugin cannot make views (libtpu).
        """
        _collect_released_views()
        device = ck.usize("device", device)
        v = view(array, writable=True)
        if v.on_device and self._platform() == "cpu":
            # A device address (CUDA, torch_tpu) viewed as host memory would read and write
            # arbitrary bytes: refuse. The framework's own copies reach such tensors
            # (tpu_sync.torch_kv, tpu_sync.jax_kv).
            raise UnsupportedError(lib.TPU_SYNC_UNSUPPORTED, f"a {type(array).__name__} on device "
                                   f"{getattr(array, 'device', '?')} cannot be viewed by the CPU plugin's client "
                                   "(its data pointer is not host memory); copy it through the framework "
                                   "(tpu_sync.torch_kv.TorchKv with backend framework-copy)")
        dims = _dims(shape, v.shape)
        dt = resolve_dtype(v, dtype, array)
        out = ffi.new("tpu_sync_buffer **")
        rel = ffi.new("tpu_sync_release **")
        c_dims = ffi.new("int64_t[]", dims or [0])
        kind = ffi.NULL if memory is None else ck.cstr("memory", memory)
        check(lib.tpu_sync_client_view(self._handle(), device, ffi.cast("void *", v.ptr), v.nbytes, c_dims,
                                       len(dims), DTYPES[dt], kind, out, rel))
        b = Buffer(out[0])
        b._release = _Release(rel[0])
        b._keep = v.keepalive
        return b

    def adopt_buffer(self, pjrt_buffer: int) -> "Buffer":
        """Wraps a caller-owned ``PJRT_Buffer*`` (address) of this client. It is never destroyed
        here; keep it alive until the returned buffer is closed and its copies completed.

        Raises:
            InvalidArgumentError: a buffer of another client, or an unsupported element type.
        """
        ptr = ck.integer("pjrt_buffer", pjrt_buffer, 0, ck.U64_MAX)
        out = ffi.new("tpu_sync_buffer **")
        check(lib.tpu_sync_buffer_adopt(self._handle(), ffi.cast("void *", ptr), out))
        return Buffer(out[0])


def _dims(shape: Optional[Sequence[int]], own: Sequence[int]) -> List[int]:
    """``shape`` (each dimension >= 0, at most 16 of them) or the array's own dims."""
    if shape is None:
        return [int(d) for d in own]
    dims = [ck.i64(f"shape[{i}]", d, lo=0) for i, d in enumerate(ck.items("shape", shape))]
    if len(dims) > 16:
        raise ck.fail(f"shape has {len(dims)} dimensions (at most 16)")
    return dims


class _Release(Handle):
    """Tells when the plugin let go of a view's memory (internal)."""

    _free = lib.tpu_sync_release_free

    def wait(self, timeout_s: float) -> bool:
        ms = ck.seconds_ms("timeout", timeout_s)
        status = lib.tpu_sync_release_wait(self._handle(), max(ms, 0))
        if status == lib.TPU_SYNC_PENDING:
            return False
        check(status)
        return True


# Views whose Buffer was closed before the plugin released their memory: (release, keepalive).
_pending_views: List[Tuple[_Release, Any]] = []
_pending_lock = threading.Lock()


def _collect_released_views() -> int:
    """Drops the keepalives of closed views whose memory the plugin has released; returns how
    many views are still pending."""
    with _pending_lock:
        still = []
        for rel, keep in _pending_views:
            if rel.wait(0):
                rel.close()
            else:
                still.append((rel, keep))
        _pending_views[:] = still
        return len(still)


class Buffer(Handle):
    """A PJRT device buffer: created from host data, adopted, or a zero-copy view. Raw copies
    address bytes ``0 .. size``. Thread-safe."""

    _free = lib.tpu_sync_buffer_free
    _release: Optional[_Release] = None
    _keep: Any = None

    def close(self) -> None:
        """Frees the native handle (idempotent). A view's array stays referenced until the plugin
        has released its memory."""
        was_open = self._ptr is not None
        super().close()
        if was_open and self._release is not None and not self._release.closed:
            with _pending_lock:
                _pending_views.append((self._release, self._keep))
            self._keep = None
            _collect_released_views()

    @property
    def info(self) -> Dict[str, Any]:
        """``dims``, ``dtype``, ``on_device_size``, ``logical_size``, ``physical_layout``,
        ``device``, ``owned``, ``view``, ``platform``."""
        return json_out(lib.tpu_sync_buffer_info, self._handle())

    @property
    def physical_layout(self) -> Optional[str]:
        """The plugin's serialization of the buffer's memory layout (e.g. ``{2,1,0}``), or None
        when the plugin offers none. Raw bytes of two buffers are interchangeable only when dtype,
        shape and this layout are equal."""
        return self.info["physical_layout"]

    @property
    def shape(self) -> Tuple[int, ...]:
        """Logical dimensions."""
        return tuple(self.info["dims"])

    @property
    def dtype(self) -> str:
        """Element type name (``bf16``, ``f32``, ...)."""
        return self.info["dtype"]

    @property
    def device(self) -> int:
        """Index of the device the buffer lives on."""
        return int(self.info["device"])

    @property
    def pjrt_buffer(self) -> int:
        """Address of the ``PJRT_Buffer*`` (borrowed: valid while this buffer lives)."""
        out = ffi.new("void **")
        check(lib.tpu_sync_buffer_pjrt(self._handle(), out))
        return int(ffi.cast("uintptr_t", out[0]))

    @property
    def released(self) -> bool:
        """For a view: whether the plugin has let go of the array's memory (only after
        :meth:`close`, asynchronously). Always True for buffers that are not views."""
        if self._release is None:
            return True
        return self._release.closed or self._release.wait(0)

    def wait_released(self, timeout: float = 5.0) -> bool:
        """Waits up to ``timeout`` seconds for :attr:`released`; returns it."""
        timeout = ck.number("timeout", timeout, lo=0.0)
        if self._release is None or self._release.closed:
            return True
        ok = self._release.wait(timeout)
        if ok:
            _collect_released_views()
        return ok

    @property
    def size(self) -> int:
        """On-device size in bytes."""
        n = ffi.new("uint64_t *")
        check(lib.tpu_sync_buffer_size(self._handle(), n))
        return int(n[0])

    def read(self, offset: int = 0, size: Optional[int] = None, out: Any = None) -> Any:
        """D2H: copies ``size`` bytes at ``offset`` into ``out`` (a writable array) or into new
        ``bytes`` when ``out`` is None. Blocks (the GIL is released during the copy)."""
        offset = ck.u64("offset", offset)
        size = ck.optional(ck.usize, "size", size)
        if out is None:
            total = self.size
            if offset > total or (size is not None and size > total - offset):
                raise ck.fail(f"bytes {offset}..{offset + (size or 0)} are outside the {total}-byte buffer")
            n = total - offset if size is None else size
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
        offset = ck.u64("offset", offset)
        v = view(data)
        check(lib.tpu_sync_buffer_write(self._handle(), offset, ffi.cast("void *", v.ptr), v.nbytes))
