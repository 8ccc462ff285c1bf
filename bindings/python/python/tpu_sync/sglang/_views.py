"""One tpu_sync PJRT client per process and zero-copy views of SGLang's tensors (internal).

SGLang's device KV pools and host KV pools are torch tensors. tpu_sync's device layer and host
tier take :class:`tpu_sync.Buffer` objects; :func:`view_of` wraps a tensor's memory in one
without copying (``PJRT_Client_CreateViewOfDeviceBuffer``, :meth:`tpu_sync.Client.view`), as the
vLLM connector does. A view covers the whole tensor as raw bytes (dtype ``u8``), so any layout
and any KV dtype (bf16, fp8, ...) is addressed by byte offsets. Views are cached by address and
size: SGLang allocates its pools once per process, so each tensor is viewed once.

Thread-safety: the functions here take a lock; the returned objects are thread-safe.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Tuple

_lock = threading.Lock()
_client: Any = None
_views: Dict[Tuple[int, int], Tuple[Any, Any]] = {}


def shared_client() -> Any:
    """The process's :class:`tpu_sync.Client` (created on first use; the plugin is
    ``$TPU_SYNC_PJRT_PLUGIN`` or the one ``make plugin`` installed). ``TPU_SYNC_SGLANG_CPU_DEVICES``
    sets the XLA CPU plugin's device count (default 1)."""
    global _client
    with _lock:
        if _client is None:
            import tpu_sync

            n = int(os.environ.get("TPU_SYNC_SGLANG_CPU_DEVICES", "1"))
            _client = tpu_sync.Client(cpu_devices=n)
        return _client


def flat_bytes(t: Any) -> Any:
    """``t``'s storage as a flat ``uint8`` tensor (no copy).

    Raises:
        ValueError: ``t`` is not contiguous (a strided pool cannot be addressed by one view).
    """
    import torch

    if not t.is_contiguous():
        raise ValueError(f"tpu_sync.sglang: tensor of shape {tuple(t.shape)} and strides {t.stride()} "
                         "is not contiguous; it cannot be viewed as one buffer")
    return t.reshape(-1).view(torch.uint8)


def view_of(t: Any) -> Any:
    """A cached zero-copy :class:`tpu_sync.Buffer` over the bytes of tensor ``t`` (shape
    ``[nbytes]``, dtype ``u8``). The buffer keeps ``t``'s storage alive.

    Raises:
        ValueError: not contiguous. tpu_sync errors from :meth:`tpu_sync.Client.view` (memory
        not 64-byte aligned, a plugin that cannot make views).
    """
    flat = flat_bytes(t)
    key = (int(flat.data_ptr()), int(flat.numel()))
    with _lock:
        hit = _views.get(key)
        if hit is not None:
            return hit[0]
    client = shared_client()
    buf = client.view(flat)
    with _lock:
        _views.setdefault(key, (buf, flat))
        return _views[key][0]


def byte_offset(t: Any, base: Any) -> int:
    """Byte offset of tensor ``t``'s first element inside the storage of ``base``."""
    return int(t.data_ptr()) - int(base.data_ptr())
