"""SGLang integration of tpu_sync (SGLang 0.5.23): the HiCache I/O backend and the HiCache storage
backend (L3). See ``docs/sglang.md`` (which also says what is not done yet: the unified-cache
linker and the P/D transfer backend).

* :class:`TpuSyncStorage` (``tpu_sync.sglang.storage``): ``--hicache-storage-backend dynamic``
  with ``{"backend_name": "tpu_sync", "module_path": "tpu_sync.sglang.storage",
  "class_name": "TpuSyncStorage"}``.
* The I/O backend (``tpu_sync.sglang.io``): ``TPU_SYNC_HICACHE_IO=1``.
* :func:`register` is the ``sglang.srt.plugins`` entry point (``tpu_sync``); SGLang's
  ``load_plugins`` runs it in every process. It installs the hooks of the settings above and is a
  no-op without SGLang. Importing this package needs neither SGLang nor torch.
"""

from __future__ import annotations

import logging
from typing import Any

_log = logging.getLogger("tpu_sync.sglang")

__all__ = ["TpuSyncStorage", "register"]


def register() -> None:
    """``sglang.srt.plugins`` entry point: installs the I/O backend hooks when
    ``TPU_SYNC_HICACHE_IO=1``. Idempotent; never raises (a plugin must not break engine start-up;
    failures are logged)."""
    try:
        import sglang  # noqa: F401
    except Exception:
        return
    global _registered
    if _registered:
        return
    _registered = True
    for name, fn in (("io", _install_io),):
        try:
            fn()
        except Exception as e:  # pragma: no cover - logged, engine goes on without it
            _log.warning("tpu_sync.sglang: installing the %s hooks failed: %s", name, e)


_registered = False


def _install_io() -> None:
    from . import io

    io.install_hooks()


def __getattr__(name: str) -> Any:
    if name == "TpuSyncStorage":
        from .storage import TpuSyncStorage

        return TpuSyncStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
