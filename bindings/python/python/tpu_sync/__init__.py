"""tpu_sync: zero-copy KV-cache transfer for LLM serving (Python bindings of libtpu_sync).

Classes:
    :class:`Client` (PJRT client: created, or adopted from a framework), :class:`Buffer` (device
    buffer: copied in, adopted, or a zero-copy :meth:`Client.view`), :class:`Copy` (an
    asynchronous batch of device copies, :func:`d2h` / :func:`h2d`), :class:`Store` (the host KV
    tier) with :class:`Lease`, :class:`PutResult`, :class:`GetResult`, :class:`Endpoint` (the
    network data plane: register, pull, push) and its :class:`Transfer`, :class:`Plan` (reshard
    plan). Prometheus metrics: :func:`metrics` (text), :func:`serve_metrics` (HTTP endpoint).
Helpers for layouts and placements are in :mod:`tpu_sync.plan`; exceptions in
:mod:`tpu_sync.errors` (all derive from :class:`TpuSyncError` and carry ``status`` and ``message``).

Importing this package needs only ``cffi``; numpy and torch objects are accepted when passed.
"""

from . import cluster, errors
from ._lib import ABI_VERSION, __version__, last_error, live_handles
from .arrays import aligned_array
from .client import Buffer, Client
from .endpoint import Endpoint, Transfer
from .device import Copy, d2h, h2d, pacing, pause_pacing, resume_pacing, set_pacing
from .errors import TpuSyncError
from .observability import metrics, serve_metrics, set_metrics_enabled
from .plan import (HYBRID_PRESETS, PRESET_NAMES, PRESETS, Plan, Span, hybrid_model, layout, model,
                   placement, preset)
from .store import GetResult, Lease, PutResult, Store, list_segments, remove_segment

__all__ = [
    "ABI_VERSION",
    "__version__",
    "Buffer",
    "HYBRID_PRESETS",
    "PRESET_NAMES",
    "PRESETS",
    "Client",
    "Copy",
    "Endpoint",
    "GetResult",
    "Lease",
    "Plan",
    "PutResult",
    "Span",
    "Store",
    "TpuSyncError",
    "Transfer",
    "aligned_array",
    "d2h",
    "errors",
    "h2d",
    "last_error",
    "layout",
    "hybrid_model",
    "list_segments",
    "live_handles",
    "metrics",
    "model",
    "pacing",
    "pause_pacing",
    "placement",
    "preset",
    "remove_segment",
    "resume_pacing",
    "serve_metrics",
    "set_metrics_enabled",
    "set_pacing",
]
