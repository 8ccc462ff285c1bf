"""What both sides of a transfer must agree on, and tpu_sync layouts of vLLM's KV cache.

vLLM's CPU attention backend (the only per-layer layout this connector accepts, vLLM's
``LBHNC``) hands each layer as a tensor ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` whose ``(block, head)`` interior is packed by the attention kernel: fp32 ("vec"
ISA) stores K transposed then V, AMX bf16 uses VNNI tiles (``docs/plugins-and-engines.md``,
"vLLM CPU backend: block interior"). Blocks are therefore opaque: they move whole (or as head
slices when TP differs), and two engines exchange them only when their :class:`KvGeometry`
matches, including the :attr:`KvGeometry.block_format` tag naming the platform, kernel and cache
dtype.

:func:`kv_geometry` needs vLLM; the rest of this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import platform
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

#: tpu_sync dtype names (``tpu_sync::layout::DType``) of torch KV cache dtypes.
TORCH_TO_TPU_SYNC_DTYPE = {
    "torch.float32": "f32",
    "torch.bfloat16": "bf16",
    "torch.float16": "f16",
    "torch.float8_e4m3fn": "fp8",
}

#: Version of the ``kv_transfer_params`` this connector produces and accepts.
PARAMS_VERSION = 1

_log = logging.getLogger("tpu_sync.vllm")

#: ``arch_prctl`` code asking for permission to use a dynamically enabled XSAVE feature
#: (Linux ``arch/x86/include/uapi/asm/prctl.h``), and the AMX tile data feature number
#: (``XFEATURE_XTILEDATA``, ``arch/x86/include/asm/fpu/types.h``); ``arch_prctl`` is system
#: call 158 on x86-64.
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL_X86_64 = 158


def uses_amx(block_format: str) -> bool:
    """Whether blocks of this format are written by vLLM's AMX attention kernel
    (``vllm-cpu/amx/...``, the bf16 kernel vLLM picks on CPUs with AMX)."""
    return "/amx/" in str(block_format)


def request_amx_tiles() -> bool:
    """Asks Linux for permission to use AMX tiles in this process
    (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``). vLLM's AMX bf16 attention
    kernel executes AMX instructions without asking; the permission usually comes from a
    prefill's matmul by luck, but a P/D consumer's first forward is a decode step, which dies
    with SIGILL without it. Returns whether the permission is granted; on a CPU or kernel
    without AMX (or not x86-64 Linux) it does nothing and returns False. Never raises."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        r = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL_X86_64), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                         ctypes.c_ulong(XFEATURE_XTILEDATA))
    except Exception as e:  # no libc syscall(): nothing to ask
        _log.debug("tpu_sync: AMX permission not requested: %s", e)
        return False
    if r != 0:
        err = ctypes.get_errno()
        _log.info("tpu_sync: AMX tile permission not granted (%s): this CPU or kernel has no AMX",
                  errno.errorcode.get(err, err))
        return False
    _log.info("tpu_sync: AMX tile permission granted for vLLM's AMX attention kernel")
    return True


@dataclass(frozen=True)
class KvGeometry:
    """One engine's KV cache as seen by one rank.

    Attributes:
        model: model name or path (informational; not compared).
        num_layers: attention layers holding KV (= per-layer tensors).
        num_kv_heads: KV heads of the whole model.
        heads_per_rank: KV heads in each rank's tensors (``num_kv_heads / tp``, at least 1).
        head_dim: elements per head (K and V each).
        dtype: tpu_sync dtype name of the cache (``f32``, ``bf16``, ``f16``, ``fp8``).
        block_size: tokens per block.
        tp: tensor-parallel size.
        block_format: what packs a block's bytes, e.g. ``vllm-cpu/vec/float32``
            (platform, attention kernel, cache dtype).
        use_mla: an MLA model (one latent plane).
    """

    model: str
    num_layers: int
    num_kv_heads: int
    heads_per_rank: int
    head_dim: int
    dtype: str
    block_size: int
    tp: int
    block_format: str
    use_mla: bool = False

    @property
    def kv_planes(self) -> int:
        """2 (K and V), or 1 for MLA."""
        return 1 if self.use_mla else 2

    @property
    def elem_bytes(self) -> int:
        """Bytes per element."""
        return {"f32": 4, "bf16": 2, "f16": 2, "fp8": 1}[self.dtype]

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer on one rank."""
        return self.heads_per_rank * self.block_size * self.kv_planes * self.head_dim * self.elem_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of every layer on one rank (one host-tier entry)."""
        return self.num_layers * self.layer_block_bytes

    def to_dict(self) -> Dict[str, Any]:
        """Plain dict (JSON-able), as sent in ``kv_transfer_params``."""
        return asdict(self)

    def mismatch(self, other: Dict[str, Any]) -> Optional[str]:
        """Why KV blocks of a peer with geometry ``other`` (a :meth:`to_dict`) cannot be used
        here, or None when they can. Compares everything that fixes a block's bytes (layers,
        heads, head_dim, dtype, block size, MLA, block format); TP may differ (resharded)."""
        keys = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "use_mla", "block_format")
        mine = self.to_dict()
        diff = [f"{k}: local {mine[k]!r}, remote {other.get(k)!r}" for k in keys if other.get(k) != mine[k]]
        return "; ".join(diff) if diff else None

    def namespace(self, extra: str = "") -> str:
        """Host-tier namespace: blocks of engines whose namespaces differ never share keys."""
        return (
            f"vllm/{self.model}/{self.block_format}/bs{self.block_size}/L{self.num_layers}"
            f"/H{self.num_kv_heads}/D{self.head_dim}/tp{self.tp}" + (f"/{extra}" if extra else "")
        )

    def tpu_sync_layout(self, num_blocks: int) -> Dict[str, Any]:
        """The ``tpu_sync`` layout (``ParallelLayout`` JSON) of this engine: order ``lbhnc``
        with the block format tag, ``num_blocks`` blocks per rank."""
        return dict(
            model=dict(
                name=self.model,
                num_layers=self.num_layers,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                kv_planes=self.kv_planes,
                dtype=self.dtype,
            ),
            spec=dict(tp=self.tp, pcp=1, dp=1, block_size=self.block_size, order="lbhnc"),
            num_blocks=int(num_blocks),
            block_format=self.block_format,
        )


def placement(layout: Dict[str, Any], block_ids: Sequence[int]) -> Dict[str, Any]:
    """``tpu_sync`` placement of a request whose blocks have the same ids on every TP rank (as
    in vLLM, where all TP workers share one block table)."""
    tp = int(layout["spec"]["tp"])
    ids = [int(b) for b in block_ids]
    return dict(layout=layout, dp_rank=0, block_ids=[list(ids) for _ in range(tp)])


def pullers_of_rank(src: Dict[str, Any], rank: int, num_tokens: int, decode_tp: int) -> int:
    """How many ranks of a decode instance with TP ``decode_tp`` (same model and block format)
    pull from producer rank ``rank`` of placement ``src``: the registration's expected releases.
    Uses the native planner (:class:`tpu_sync.Plan`)."""
    import tpu_sync

    layout = src["layout"]
    nb = -(-int(num_tokens) // int(layout["spec"]["block_size"]))
    dst_layout = dict(layout, spec=dict(layout["spec"], tp=int(decode_tp)), num_blocks=max(nb, 1))
    plan = tpu_sync.Plan(src, placement(dst_layout, list(range(nb))), int(num_tokens))
    try:
        return max(1, len({s.dst_rank for s in plan.spans() if s.src_rank == rank}))
    finally:
        plan.close()


def prompt_digest(token_ids: Sequence[int]) -> str:
    """Digest of the prompt tokens whose KV a producer hands over; the consumer refuses KV whose
    digest differs from its own prompt's (a proxy that re-tokenised differently)."""
    h = hashlib.sha256()
    for t in token_ids:
        h.update(int(t).to_bytes(4, "little", signed=False))
    return h.hexdigest()[:32]


def cpu_block_format(dtype: Any, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The block format tag of vLLM's CPU attention backend: ``vllm-cpu/<isa>/<cache dtype>``
    where ``<isa>`` is what the backend's ``_get_attn_isa`` picks for these settings (``vec``,
    ``vec16``, ``amx``, ``neon``, ...). Needs vLLM."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
    except Exception as e:  # unknown kernel: still a tag, never equal to a known one
        isa = f"unknown({type(e).__name__})"
    return f"vllm-cpu/{isa}/{str(dtype).replace('torch.', '')}"


def kv_geometry(vllm_config: Any) -> KvGeometry:
    """The KV geometry of a vLLM engine from its ``VllmConfig`` (needs vLLM and torch).

    Raises:
        ValueError: a KV cache dtype tpu_sync cannot describe.
    """
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    import torch
    from vllm.platforms import current_platform

    cache_dtype = cc.cache_dtype
    if cache_dtype in (None, "auto"):
        torch_dtype = mc.dtype
    else:
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

        torch_dtype = STR_DTYPE_TO_TORCH_DTYPE.get(cache_dtype)
    name = str(torch_dtype)
    if name not in TORCH_TO_TPU_SYNC_DTYPE:
        raise ValueError(f"TpuSyncConnector: KV cache dtype {cache_dtype!r} ({name}) is not supported")
    tp = int(pc.tensor_parallel_size)
    heads_per_rank = int(mc.get_num_kv_heads(pc))
    head_dim = int(mc.get_head_size())
    block_size = int(cc.block_size)
    device = getattr(current_platform, "device_type", "") or "unknown"
    if device == "cpu":
        fmt = cpu_block_format(torch_dtype, block_size, head_dim, cache_dtype or "auto")
    else:
        fmt = f"vllm-{device}/default/{name.replace('torch.', '')}"
    total_heads = int(mc.get_total_num_kv_heads())
    del torch
    return KvGeometry(
        model=str(mc.model),
        num_layers=int(mc.get_num_layers(pc)),
        num_kv_heads=total_heads,
        heads_per_rank=heads_per_rank,
        head_dim=head_dim,
        dtype=TORCH_TO_TPU_SYNC_DTYPE[name],
        block_size=block_size,
        tp=tp,
        block_format=fmt,
        use_mla=bool(getattr(mc, "use_mla", False)),
    )


def peers_from_params(params: Dict[str, Any]) -> Dict[int, str]:
    """The producer's endpoint address per TP rank, from ``kv_transfer_params``."""
    return {int(k): str(v) for k, v in (params.get("remote_addresses") or {}).items()}


def check_params(params: Dict[str, Any]) -> Optional[str]:
    """Why ``kv_transfer_params`` of a producer are unusable, or None."""
    need = ("remote_request_id", "remote_addresses", "remote_block_ids", "remote_num_tokens", "remote_geometry",
            "remote_num_blocks")
    missing = [k for k in need if params.get(k) in (None, "", [], {})]
    if missing:
        return f"kv_transfer_params lack {', '.join(missing)}"
    if params.get("tpu_sync_version") != PARAMS_VERSION:
        return f"kv_transfer_params version {params.get('tpu_sync_version')!r} (expected {PARAMS_VERSION})"
    try:
        rid = int(params["remote_request_id"])
        n = int(params["remote_num_tokens"])
        ids: List[int] = [int(b) for b in params["remote_block_ids"]]
    except (TypeError, ValueError):
        return "kv_transfer_params hold non-integer ids"
    if not 1 <= rid < 2**53 or n <= 0:
        return f"bad remote_request_id {rid} or remote_num_tokens {n}"
    bs = int(params["remote_geometry"].get("block_size") or 0)
    if bs <= 0 or len(ids) != -(-n // bs):
        return f"{len(ids)} remote blocks for {n} tokens at block size {bs}"
    return None
