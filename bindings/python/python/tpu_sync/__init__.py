"""tpu_sync: zero-copy KV-cache transfer for LLM serving (Python bindings of libtpu_sync).

Classes:
    :class:`Client` (PJRT client), :class:`Buffer` (device buffer), :class:`Plan` (reshard plan).
Helpers for layouts and placements are in :mod:`tpu_sync.plan`; exceptions in
:mod:`tpu_sync.errors` (all derive from :class:`TpuSyncError` and carry ``status`` and ``message``).

Importing this package needs only ``cffi``; numpy and torch objects are accepted when passed.
"""

from ._lib import ABI_VERSION, __version__, last_error, live_handles
from .client import Buffer, Client
from .errors import TpuSyncError
from .plan import Plan, Span, layout, model, placement, preset

__all__ = [
    "ABI_VERSION",
    "__version__",
    "Buffer",
    "Client",
    "Plan",
    "Span",
    "TpuSyncError",
    "last_error",
    "layout",
    "live_handles",
    "model",
    "placement",
    "preset",
]
