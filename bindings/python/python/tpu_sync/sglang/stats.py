"""Per-process counters of tpu_sync.sglang, published as JSON files for tests and operators.

SGLang runs the storage backend, the I/O backend and the P/D backend in its scheduler
processes, where a test cannot reach Python objects. When ``TPU_SYNC_SGLANG_STATS_DIR`` is set,
:func:`publish` writes ``<dir>/<kind>-<pid>.json`` (atomically: a temporary file renamed) after
each operation; :func:`collect` reads them back. Without the variable nothing is written.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable, Dict, List

_lock = threading.Lock()


def enabled() -> bool:
    """Whether ``TPU_SYNC_SGLANG_STATS_DIR`` is set."""
    return bool(os.environ.get("TPU_SYNC_SGLANG_STATS_DIR"))


def publish(kind: str, snapshot: Callable[[], Dict[str, Any]]) -> None:
    """Writes ``snapshot()`` (JSON-able) to ``<dir>/<kind>-<pid>.json`` when enabled. Never
    raises (counters must not fail a transfer)."""
    d = os.environ.get("TPU_SYNC_SGLANG_STATS_DIR")
    if not d:
        return
    try:
        data = dict(snapshot(), pid=os.getpid(), kind=kind)
        try:
            import tpu_sync

            data["pacing"] = tpu_sync.pacing()
        except Exception:
            pass
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"{kind}-{os.getpid()}.json")
        with _lock:
            tmp = f"{path}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, default=str)
            os.replace(tmp, path)
    except Exception:
        pass


def collect(d: str, kind: str) -> List[Dict[str, Any]]:
    """Every ``<kind>-*.json`` in ``d``, parsed (one per process)."""
    out = []
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return out
    for n in names:
        if n.startswith(kind + "-") and n.endswith(".json"):
            try:
                with open(os.path.join(d, n)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                pass
    return out
