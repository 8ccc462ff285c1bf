"""Prometheus metrics of tpu-sync in this process (``tpu_sync::metrics`` in the library).

* :func:`metrics` returns the Prometheus text exposition (format 0.0.4) of every ``tpu_sync_*``
  metric (bytes and durations of device copies and network transfers, failures by error kind,
  checksum failures, peers, leases, staged bytes, host-tier hits, misses, occupancy, evictions,
  spills, restarts, pacing in flight), for an engine that serves its own ``/metrics``;
* :func:`serve_metrics` starts the library's own HTTP endpoint (``GET /metrics``), as the
  environment variable ``TPU_SYNC_METRICS_ADDR`` does at the first use of the library;
* :func:`set_metrics_enabled` switches recording off and on (to measure its cost).

The names, labels and units are listed in ``docs/observability.md``.
"""

from __future__ import annotations

from . import _check as ck
from ._lib import check, ffi, lib

#: ``Content-Type`` of :func:`metrics`' text.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _text(fn, *args) -> str:
    need = ffi.new("size_t *")
    status = fn(*args, ffi.NULL, 0, need)
    if status not in (lib.TPU_SYNC_OK, lib.TPU_SYNC_BUFFER_TOO_SMALL):
        check(status)
    while True:
        # Slack: a metric may gain a series between the two calls.
        n = need[0] + 4096
        buf = ffi.new("char[]", n)
        status = fn(*args, buf, n, need)
        if status == lib.TPU_SYNC_BUFFER_TOO_SMALL:
            continue
        check(status)
        return ffi.string(buf).decode()


def metrics() -> str:
    """This process's tpu-sync metrics in the Prometheus text format 0.0.4 (:data:`CONTENT_TYPE`).
    Parse it with ``prometheus_client.parser.text_string_to_metric_families``."""
    return _text(lib.tpu_sync_metrics_text)


def serve_metrics(addr: str = "127.0.0.1:0", rank: int = 0) -> str:
    """Starts this process's metrics endpoint on ``addr`` (``PORT``, ``:PORT``, ``HOST:PORT``; a
    bare port binds 127.0.0.1; port 0 picks a free one) with ``rank`` added to the port, or finds
    the one already running; returns the address served (``"IP:PORT"``). It lives until the
    process exits.

    Raises:
        InvalidArgumentError: a malformed address, or a port past 65535.
        IoError: the address cannot be bound (e.g. in use).
    """
    return _text(lib.tpu_sync_metrics_serve, ck.cstr("addr", addr), ck.u32("rank", rank))


def set_metrics_enabled(on: bool) -> None:
    """Switches metrics recording on (default) or off for the whole process."""
    check(lib.tpu_sync_metrics_set_enabled(1 if ck.flag("on", on) else 0))
