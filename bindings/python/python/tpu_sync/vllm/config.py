"""Settings of :class:`~tpu_sync.vllm.connector.TpuSyncConnector`, read from vLLM's
``kv_transfer_config`` (``kv_role``) and ``kv_connector_extra_config`` (a flat dict; unknown keys
are an error so a typo does not silently fall back to a default).

``kv_connector_extra_config`` keys
-----------------------------------

P/D (prefill/decode disaggregation; on by default for ``kv_producer`` and ``kv_consumer``):

``pd`` (bool)
    Enable P/D transfers. Default: True unless ``kv_role`` is ``kv_both``.
``listen`` (str, ``"host:port"``)
    Address the worker's tpu_sync endpoint listens on; default ``"127.0.0.1:0"`` (any free port).
    The producer advertises ``advertise_host`` (default: the listen host) with the bound port in
    the ``kv_transfer_params`` it returns.
``advertise_host`` (str)
    Host name or address consumers dial.
``transport`` (str)
    ``"tcp"`` (default), ``"tls"``, ``"quic"`` or ``"shm"`` (as :class:`tpu_sync.Endpoint`).
``tls`` (dict)
    ``{"cert": path, "key": path, "ca": path}`` for TLS/QUIC.
``psk`` (str)
    Pre-shared key (hex) authenticating peers.
``lease_s`` (float)
    Producer: how long a finished request's KV stays staged without a live consumer. Default 120.
``decode_tp_size`` (int)
    Producer: TP size of the decode instances that pull (each decode rank is one puller; a
    registration ends once all of them released it). Default 1; a prefill request's
    ``kv_transfer_params["decode_tp_size"]`` overrides it.
``pull_timeout_s`` (float)
    Consumer: a pull that has not completed after this many seconds fails the request
    (``kv_load_failure_policy`` then decides: ``"fail"`` ends it with an error, ``"recompute"``
    prefills it locally). Default 30.
``idle_wait_ms`` (float)
    Consumer: in an engine step that computed nothing (every request is waiting for its KV),
    the worker waits up to this long for a pull to complete before handing the step back to
    vLLM, which would otherwise run empty steps back to back at 100% of a core while the KV
    arrives (measured: 4.0 s of CPU in 4.0 s of waiting), taking that core from the engines'
    own compute on a shared host. A completing pull ends the wait at once, so it adds no
    latency to the pull; a new request reaching an otherwise idle engine may wait this long.
    0: no wait. Default 10.
``heartbeat_timeout_s`` (float)
    A peer whose control lane stays silent this long is declared dead and its transfers fail.
    Default 30 (the library's own default is 5): an engine's forward pass can keep every core
    busy (vLLM's CPU backend binds OpenMP threads to all of them) and starve the endpoint's
    threads for seconds, which must not end transfers; a peer process that exits or is killed
    closes its sockets and is detected at once regardless. Heartbeats go out every
    ``min(1, heartbeat_timeout_s / 5)`` seconds.
``pd_transport`` (str, ``"module:callable"``)
    Replaces the tpu_sync endpoint (extension point; see :mod:`tpu_sync.vllm.backends`).
``staging_budget_bytes`` (int)
    The endpoint's own budget of pinned staging bytes (a producer's registered requests and a
    consumer's pulls in flight). A registration past it fails at once (the consumer's pull then
    fails and the request is recomputed or failed per ``kv_load_failure_policy``); nothing
    already staged is lost. Default: the process-wide budget, a quarter of the memory the
    process may use capped by ``RLIMIT_MEMLOCK`` (``$TPU_SYNC_STAGING_BUDGET_BYTES``), shared
    with the host tier.
``staging_wait_s`` (float)
    How long a registration waits for budget before it fails. Default: it fails at once.

``early_register`` (bool)
    Producer: register a ``do_remote_decode`` request in the step that completes its prefill
    (staged right after that step's forward, as layer-wise producers do layer by layer) rather
    than one engine step after it finished, so a consumer's pull, which starts once the producer
    answered, finds it staged. Default True. (A request that then computes more tokens than it
    was registered with is withdrawn and registered whole when it finishes.)
``layerwise`` (bool)
    Layer-wise P/D and host-tier loads. Producer: a request whose prefill completes in a step
    is registered before that step's forward and each layer is staged and published as vLLM
    saves it (``save_kv_layer``), so consumers pull layer ``l`` while layer ``l + 1`` is
    computed. Consumer: a P/D request is admitted at once as a synchronous load (all prompt
    tokens but the last), pulled with per-layer H2D, and ``wait_for_layer_load`` waits for each
    layer; a dead or slow producer makes the forward wait up to ``pull_timeout_s``, after
    which the blocks are reported as load errors (``kv_load_failure_policy``). Offload: host-tier
    hits load on a background thread into a host bounce buffer (checksums verified), then layer
    by layer into the KV tensors; ``wait_for_layer_load`` waits for each layer. Default: False
    (whole requests: the producer registers one step after the request finished, the
    consumer's pull is asynchronous and the request waits for all of it, host-tier loads are
    synchronous in ``start_load_kv``). Producer and consumer may differ in this setting.

Host-DRAM offload (on by default for ``kv_both``):

``offload`` (bool)
    Enable the host KV tier. Default: True for ``kv_both``.
``host_capacity_bytes`` (int)
    Bytes of host DRAM for offloaded blocks. Default 1 GiB.
``shm_name`` (str)
    Keep the tier in ``/dev/shm/<name>`` so a restarted engine re-attaches it warm.
``disk_dir`` (str), ``disk_capacity_bytes`` (int)
    Spill DRAM victims to files in this directory.
``async_saves`` (bool)
    Save to the host tier off the step (default True): ``wait_for_save`` queues the D2H of the
    blocks the step filled and returns; a background thread copies them into the tier. The
    blocks stay allocated until their saves are done: a finished request's blocks are freed
    once the workers report its saves complete (``request_finished`` returns True, as vLLM's
    offloading connector does), a preempted request's saves are waited for before the next
    forward (``handle_preemptions``), and a lookup of a block still being saved waits for it.
    False: saves run inside ``wait_for_save``.
``max_pending_save_blocks`` (int)
    Back-pressure of ``async_saves``: saves that would take the queued blocks past this many are
    dropped (counted as ``saves_dropped``, a future miss), so a slow tier never stalls the
    engine nor holds its blocks. Default 2048.
``jax_backend`` (str)
    With a JAX model runner (tpu-inference: the caches come through ``register_runner``), how
    its arrays are read and written (:mod:`tpu_sync.jax_kv`): ``auto`` (default: ``pjrt-view``
    where the shards are in host memory, else ``framework-copy``), ``pjrt-view`` or
    ``framework-copy``.
``torch_backend`` (str)
    How the KV tensors of ``register_kv_caches`` are read and written (:mod:`tpu_sync.torch_kv`):
    ``auto`` (default: ``pjrt-view``, in place, for contiguous CPU tensors; ``framework-copy``,
    torch's own copies through host mirrors, for accelerator tensors such as vLLM-TorchTPU's
    and for strided per-layer views of a block-major bundle),
    ``pjrt-view`` or ``framework-copy``.
``torch_copy_api`` (str)
    The copies of ``torch_backend`` ``framework-copy``: ``auto`` (default: torch_tpu's
    ``batch_transfer`` for tensors on a ``tpu`` device, else ``torch``), ``torch``
    (``Tensor.copy_``) or ``batch_transfer``.
``verify_checksums`` (bool)
    Check each block's checksum when loading it (default True). A mismatch makes the connector
    report the blocks as failed loads, so vLLM recomputes them (set
    ``kv_load_failure_policy="recompute"``).
``namespace`` (str)
    Extra text mixed into the tier's key namespace (default: none; the namespace always includes
    the model, block format, block size and geometry).
``host_tier`` (str, ``"module:callable"``)
    Replaces :class:`tpu_sync.Store` (extension point; see :mod:`tpu_sync.vllm.backends`).
``kv_events`` (dict)
    Publish the host tier's KV events in vLLM's format (``BlockStored``/``BlockRemoved``/
    ``AllBlocksCleared`` over ZMQ, with vLLM's block hashes, media ``CPU``/``STORAGE``) for KV-aware
    routers: the keys of :class:`tpu_sync.Store`'s ``kv_events`` (``endpoint``,
    ``replay_endpoint``, ``topic``, ...; ``block_size`` defaults to the engine's). TP rank 0
    publishes. Default: off.

Observability:

``metrics_addr`` (str)
    Serve the library's ``tpu_sync_*`` Prometheus metrics of each worker on this address, the
    worker's TP rank added to the port (``"127.0.0.1:9400"``: rank 0 on 9400, rank 1 on 9401; see
    ``docs/observability.md``). Default: off (``TPU_SYNC_METRICS_ADDR`` does the same). The
    connector's own counters reach ``vllm serve``'s ``/metrics`` through vLLM's connector-stats
    hooks either way (:mod:`tpu_sync.vllm.stats`).

This module imports neither vLLM nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

#: Default bytes of host DRAM of the offload tier.
DEFAULT_HOST_CAPACITY = 1 << 30
#: Default seconds a producer keeps a finished request's KV for pullers.
DEFAULT_LEASE_S = 120.0
#: Default seconds a consumer waits for a pull.
DEFAULT_PULL_TIMEOUT_S = 30.0
#: Default cap on blocks queued for asynchronous host-tier saves.
DEFAULT_MAX_PENDING_SAVE_BLOCKS = 2048
#: Engines' peer silence limit (see ``heartbeat_timeout_s`` above).
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
#: Consumer: longest wait for a pull in an engine step that computed nothing (``idle_wait_ms``).
DEFAULT_IDLE_WAIT_MS = 10.0

ROLES = ("kv_producer", "kv_consumer", "kv_both")

_KEYS = {
    "pd": bool,
    "listen": str,
    "advertise_host": str,
    "transport": str,
    "tls": dict,
    "psk": str,
    "lease_s": (int, float),
    "decode_tp_size": int,
    "pull_timeout_s": (int, float),
    "heartbeat_timeout_s": (int, float),
    "idle_wait_ms": (int, float),
    "pd_transport": str,
    "staging_budget_bytes": int,
    "staging_wait_s": (int, float),
    "offload": bool,
    "host_capacity_bytes": (int, float),
    "shm_name": str,
    "disk_dir": str,
    "disk_capacity_bytes": (int, float),
    "verify_checksums": bool,
    "async_saves": bool,
    "max_pending_save_blocks": int,
    "namespace": str,
    "host_tier": str,
    "cluster": dict,  # a prefix cache shared across instances: see tpu_sync.vllm.cluster_tier
    "kv_events": dict,
    "metrics_addr": str,
    "layerwise": bool,
    "early_register": bool,
    "jax_backend": str,
    "torch_backend": str,
    "torch_copy_api": str,
}


class ConfigError(ValueError):
    """``kv_connector_extra_config`` or ``kv_role`` is invalid."""


@dataclass(frozen=True)
class ConnectorConfig:
    """Parsed settings (see the module docstring for the meaning of each field)."""

    role: str
    pd: bool
    offload: bool
    listen: str = "127.0.0.1:0"
    advertise_host: Optional[str] = None
    transport: str = "tcp"
    tls: Optional[Dict[str, str]] = None
    psk: Optional[bytes] = None
    lease_s: float = DEFAULT_LEASE_S
    decode_tp_size: int = 1
    pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    idle_wait_ms: float = DEFAULT_IDLE_WAIT_MS
    pd_transport: Optional[str] = None
    staging_budget_bytes: Optional[int] = None
    staging_wait_s: Optional[float] = None
    host_capacity_bytes: int = DEFAULT_HOST_CAPACITY
    shm_name: Optional[str] = None
    disk_dir: Optional[str] = None
    disk_capacity_bytes: Optional[int] = None
    verify_checksums: bool = True
    async_saves: bool = True
    max_pending_save_blocks: int = DEFAULT_MAX_PENDING_SAVE_BLOCKS
    namespace: str = ""
    host_tier: Optional[str] = None
    kv_events: Optional[Dict[str, Any]] = None
    metrics_addr: Optional[str] = None
    layerwise: bool = False
    early_register: bool = True
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        """Serves finished requests' KV to decode instances."""
        return self.pd and self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Pulls prefilled KV from prefill instances."""
        return self.pd and self.role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, role: Optional[str], extra: Optional[Mapping[str, Any]]) -> "ConnectorConfig":
        """Parses ``kv_role`` and ``kv_connector_extra_config``.

        Raises:
            ConfigError: unknown role or key, wrong type, or a value out of range.
        """
        if role not in ROLES:
            raise ConfigError(f"kv_role must be one of {', '.join(ROLES)}; got {role!r}")
        extra = dict(extra or {})
        for k, v in extra.items():
            if k not in _KEYS:
                raise ConfigError(
                    f"unknown kv_connector_extra_config key {k!r} for TpuSyncConnector "
                    f"(known: {', '.join(sorted(_KEYS))})"
                )
            want = _KEYS[k]
            # bool is an int subclass: keep numbers and flags apart
            if (want is bool) != isinstance(v, bool) or not isinstance(v, want):
                raise ConfigError(f"kv_connector_extra_config[{k!r}] must be {_tname(want)}, got {v!r}")
        for k, allowed in (("jax_backend", ("auto", "pjrt-view", "framework-copy")),
                           ("torch_backend", ("auto", "pjrt-view", "framework-copy")),
                           ("torch_copy_api", ("auto", "torch", "batch_transfer"))):
            if k in extra and extra[k] not in allowed:
                raise ConfigError(f"kv_connector_extra_config[{k!r}] must be one of {', '.join(allowed)}; "
                                  f"got {extra[k]!r}")
        pd = extra.get("pd", role != "kv_both")
        offload = extra.get("offload", role == "kv_both")
        psk = extra.get("psk")
        if psk is not None:
            try:
                psk_b = bytes.fromhex(psk)
            except ValueError:
                raise ConfigError("kv_connector_extra_config['psk'] must be hex") from None
        else:
            psk_b = None
        cfg = cls(
            role=role,
            pd=pd,
            offload=offload,
            listen=extra.get("listen", "127.0.0.1:0"),
            advertise_host=extra.get("advertise_host"),
            transport=extra.get("transport", "tcp"),
            tls=extra.get("tls"),
            psk=psk_b,
            lease_s=float(extra.get("lease_s", DEFAULT_LEASE_S)),
            decode_tp_size=int(extra.get("decode_tp_size", 1)),
            pull_timeout_s=float(extra.get("pull_timeout_s", DEFAULT_PULL_TIMEOUT_S)),
            heartbeat_timeout_s=float(extra.get("heartbeat_timeout_s", DEFAULT_HEARTBEAT_TIMEOUT_S)),
            idle_wait_ms=float(extra.get("idle_wait_ms", DEFAULT_IDLE_WAIT_MS)),
            pd_transport=extra.get("pd_transport"),
            staging_budget_bytes=extra.get("staging_budget_bytes"),
            staging_wait_s=(float(extra["staging_wait_s"]) if "staging_wait_s" in extra else None),
            host_capacity_bytes=int(extra.get("host_capacity_bytes", DEFAULT_HOST_CAPACITY)),
            shm_name=extra.get("shm_name"),
            disk_dir=extra.get("disk_dir"),
            disk_capacity_bytes=(int(extra["disk_capacity_bytes"]) if "disk_capacity_bytes" in extra else None),
            verify_checksums=extra.get("verify_checksums", True),
            async_saves=extra.get("async_saves", True),
            max_pending_save_blocks=int(extra.get("max_pending_save_blocks", DEFAULT_MAX_PENDING_SAVE_BLOCKS)),
            namespace=extra.get("namespace", ""),
            host_tier=extra.get("host_tier"),
            kv_events=extra.get("kv_events"),
            metrics_addr=extra.get("metrics_addr"),
            layerwise=extra.get("layerwise", False),
            early_register=extra.get("early_register", True),
            extra=extra,
        )
        if cfg.lease_s <= 0 or cfg.pull_timeout_s <= 0 or not cfg.heartbeat_timeout_s > 0:
            raise ConfigError("lease_s, pull_timeout_s and heartbeat_timeout_s must be > 0")
        if not 0 <= cfg.idle_wait_ms <= 1000:
            raise ConfigError("idle_wait_ms must be in 0..1000")
        if cfg.max_pending_save_blocks < 1:
            raise ConfigError("max_pending_save_blocks must be >= 1")
        if cfg.decode_tp_size < 1:
            raise ConfigError("decode_tp_size must be >= 1")
        if cfg.staging_budget_bytes is not None and not 0 < cfg.staging_budget_bytes < 2**64:
            raise ConfigError("staging_budget_bytes must be in 1..2^64-1")
        if cfg.staging_wait_s is not None and not cfg.staging_wait_s > 0:
            raise ConfigError("staging_wait_s must be > 0")
        if cfg.offload and cfg.host_capacity_bytes <= 0:
            raise ConfigError("host_capacity_bytes must be > 0 when offload is on")
        if ":" not in cfg.listen:
            raise ConfigError(f"listen must be host:port, got {cfg.listen!r}")
        if not (cfg.pd or cfg.offload):
            raise ConfigError("both pd and offload are off: TpuSyncConnector would do nothing")
        return cfg


def _tname(t: Any) -> str:
    if isinstance(t, tuple):
        return " or ".join(x.__name__ for x in t)
    return t.__name__
