"""vLLM V1 KV connector backed by tpu_sync: disaggregated prefill/decode and host-DRAM offload.

Use it by module path (no vLLM patch)::

    LLM(model, kv_transfer_config={
        "kv_connector": "TpuSyncConnector",
        "kv_connector_module_path": "tpu_sync.vllm",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
        "kv_connector_extra_config": {...},      # see tpu_sync.vllm.config
    })

or by name alone (``"kv_connector": "TpuSyncConnector"``): installing the package registers the
name through the ``vllm.general_plugins`` entry point (:func:`register`).

Roles: ``kv_producer`` is the prefill instance of a P/D pair (keeps a finished request's blocks
and serves them), ``kv_consumer`` the decode instance (pulls them asynchronously), ``kv_both``
offloads blocks to a host KV tier (a :class:`tpu_sync.Store`, optionally in ``/dev/shm`` for warm
restarts) and loads them back on later requests with the same prefix.

Importing this module needs neither vLLM nor torch; :data:`TpuSyncConnector` is imported from
:mod:`tpu_sync.vllm.connector` (which needs vLLM) on first access.
"""

from __future__ import annotations

import logging
from typing import Any

#: The name the connector is registered under in vLLM's ``KVConnectorFactory``.
CONNECTOR_NAME = "TpuSyncConnector"

_log = logging.getLogger(__name__)

__all__ = ["CONNECTOR_NAME", "TpuSyncConnector", "register"]


def register() -> None:
    """``vllm.general_plugins`` entry point: registers :data:`CONNECTOR_NAME` with vLLM's
    ``KVConnectorFactory`` (lazily: the connector module is imported only when an engine selects
    it). Idempotent (vLLM loads general plugins in every process, possibly more than once); does
    nothing when vLLM is not installed. Never raises."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # vLLM absent or broken: nothing to register with
        return
    try:
        registry = getattr(KVConnectorFactory, "_registry", {})
        if CONNECTOR_NAME not in registry:
            KVConnectorFactory.register_connector(CONNECTOR_NAME, "tpu_sync.vllm.connector", CONNECTOR_NAME)
    except Exception as e:  # a plugin must not break engine start-up
        _log.warning("tpu_sync: could not register %s with vLLM: %s", CONNECTOR_NAME, e)


def __getattr__(name: str) -> Any:
    if name == CONNECTOR_NAME:
        from .connector import TpuSyncConnector

        return TpuSyncConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
