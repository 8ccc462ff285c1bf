"""Hooks that add the ``tpu_sync`` P/D transfer backend to SGLang (internal; light to import: the
backend itself, :mod:`tpu_sync.sglang.pd`, is imported when SGLang first asks for its classes).
"""

from __future__ import annotations

from typing import Any

#: Value of ``--disaggregation-transfer-backend`` and of the added ``TransferBackend`` member.
BACKEND = "tpu_sync"

_CLASSES = {"manager": "TpuSyncKVManager", "sender": "TpuSyncKVSender", "receiver": "TpuSyncKVReceiver",
            "bootstrap_server": "TpuSyncKVBootstrapServer"}


def _get_kv_class_hook(original, transfer_backend, class_type):
    if getattr(transfer_backend, "value", transfer_backend) == BACKEND:
        name = _CLASSES.get(getattr(class_type, "value", class_type))
        if name is not None:
            from . import pd

            return getattr(pd, name)
    return original(transfer_backend, class_type)


def _init_kv_manager_hook(original, self, *args: Any, **kwargs: Any):
    mgr = original(self, *args, **kwargs)
    if getattr(type(mgr), "__module__", "") == "tpu_sync.sglang.pd":
        mgr.attach(self)
    return mgr


def install_hooks() -> None:
    """Adds ``tpu_sync`` to SGLang's transfer backends through its plugin mechanism (no SGLang file
    is edited):

    * ``TransferBackend`` (``sglang.srt.disaggregation.utils``): class ``REPLACE`` with an enum
      of the same members plus ``TPU_SYNC = "tpu_sync"`` (the registry rebinds the name in
      every module that imported it);
    * ``get_kv_class``: ``AROUND``, returns :mod:`tpu_sync.sglang.pd`'s classes for ``TPU_SYNC``
      and defers to SGLang for every other backend;
    * ``PrefillBootstrapQueue._init_kv_manager`` and ``DecodePreallocQueue._init_kv_manager``:
      ``AROUND``, hands the device KV pool to :meth:`tpu_sync.sglang.pd.TpuSyncKVManager.attach`
      (SGLang's ``KVArgs`` carry raw pointers without dtype or head size);
    * the ``--disaggregation-transfer-backend`` choices (``add_disagg_transfer_backend_choices``).
    """
    import enum

    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils as du
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    members = {m.name: m.value for m in du.TransferBackend}
    if BACKEND not in members.values():
        members["TPU_SYNC"] = BACKEND
        replaced = enum.Enum("TransferBackend", members, module=du.__name__, qualname="TransferBackend")
        HookRegistry.register("sglang.srt.disaggregation.utils.TransferBackend", replaced, HookType.REPLACE)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class_hook, HookType.AROUND)
    for target in ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
                   "sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager"):
        HookRegistry.register(target, _init_kv_manager_hook, HookType.AROUND)


__all__ = ["BACKEND", "install_hooks"]
