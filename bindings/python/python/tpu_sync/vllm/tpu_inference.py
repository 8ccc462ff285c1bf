"""tpu_sync's connector under a name tpu-inference accepts.

tpu-inference 0.32's platform refuses every ``kv_connector`` but ``TPUConnector``,
``TPUConnectorHMA``, ``TPUOffloadConnector`` and ``RaidenOffloadConnector``
(``tpu_inference/platforms/tpu_platform.py``, ``check_and_update_config``), and vLLM's connector
factory takes ``kv_connector_module_path`` before its own registry. So tpu-inference runs
tpu_sync's connector with::

    --kv-transfer-config '{"kv_connector": "TPUConnector",
                           "kv_connector_module_path": "tpu_sync.vllm.tpu_inference",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

tpu-inference never calls ``register_kv_caches``; its model runner calls ``register_runner``
(``tpu_inference/runner/tpu_runner.py``), which this connector handles
(:meth:`tpu_sync.vllm.worker.WorkerSide.register_runner`; docs/tpu.md).
"""

from .connector import TpuSyncConnector


class TPUConnector(TpuSyncConnector):
    """:class:`tpu_sync.vllm.connector.TpuSyncConnector`, named as tpu-inference's platform
    requires (see the module's docs). Same settings, same behaviour."""


__all__ = ["TPUConnector"]
