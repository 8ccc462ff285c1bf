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
import threading
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

#: tpu_sync dtype names (``tpu_sync::layout::DType``) of torch KV cache dtypes.
TORCH_TO_TPU_SYNC_DTYPE = {
    "torch.float32": "f32",
    "torch.bfloat16": "bf16",
    "torch.float16": "f16",
    "torch.float8_e4m3fn": "fp8",
}

#: The KV cache dtype strings of vLLM-TorchTPU (``--kv-cache-dtype``) and the torch dtypes its
#: caches have (vllm-torchtpu 0.29.0 ``TPU_STR_DTYPE_TO_TORCH_DTYPE``,
#: ``layers/adapter/attention.py``), as torch dtype names; those tpu_sync cannot describe
#: (``fp8_e5m2``, ``fp8_ds_mla``, ``int8``) are refused where the geometry is made.
TPU_CACHE_DTYPES = {
    "half": "torch.float16",
    "bfloat16": "torch.bfloat16",
    "float": "torch.float32",
    "float32": "torch.float32",
    "float16": "torch.float16",
    "fp8": "torch.float8_e4m3fn",
    "fp8_e4m3": "torch.float8_e4m3fn",
    "fp8_e5m2": "torch.float8_e5m2",
    "fp8_ds_mla": "torch.uint8",
    "int8": "torch.int8",
    "uint8": "torch.uint8",
}

#: ``tpu_sync`` block orders of the TPU backends' ragged paged attention v3 caches
#: (``docs/tpu.md``).
RPA3_ORDERS = ("rpa3", "rpa3hd64")

#: ``kv_order`` of vLLM-TorchTPU's batched ragged paged attention cache in its
#: ``SEQ_ALONG_LANE`` layout (``--attention-backend CUSTOM`` with ``VLLM_KV_CACHE_LAYOUT=HND``):
#: per layer ``[num_blocks, 2 * H, D' / P, P, block_size]``, tokens along the lanes
#: (:meth:`KvGeometry.layer_shape`).
SAL_ORDER = "rpa-sal"

#: ``kv_order`` (and tpu_sync block order) of the TPU engines' dense MLA latent cache: per layer
#: ``[num_blocks, block_size / K, K, D']`` (tpu-inference: ``K = MLA_KV_PACKING_SIZE``, read by
#: ``tpu_sync.jax_kv``; vLLM-TorchTPU: ``K = 32 / bits``, :meth:`KvGeometry.torch_mla_shape`),
#: tpu_sync's ``rpamla`` ``[num_blocks, block_size, D']`` (the same bytes), replicated over TP
#: (docs/tpu.md).
MLA_ORDER = "rpamla"

#: vLLM-TorchTPU's sparse MLA caches (DeepSeek-V3.2 style, ``use_sparse`` MLA layers and their
#: DSA indexer), as :attr:`KvGeometry.mla_parts` names them: ``(name, real bytes per token,
#: bytes per token row)``. Sources (vllm-torchtpu 0.29.0): ``PallasMLAttentionBackend.
#: get_sparse_kv_cache_specs`` (``layers/adapter/attention.py``) gives each sparse layer a
#: ``nope`` cache of ``head_size - 64`` fp8 lanes (512) and a ``rope`` cache of 64 lanes, each
#: padded to 128 bytes (``kernels/mla/kv_cache_utils.py`` ``get_kv_cache_shape``); the kernel
#: stores the rope key in bf16 (``layers/core/attention_interface.py`` asserts ``rope_dim * 2 ==
#: TILE_LANE_BYTES``), so its 128 bytes are all real. The indexer's K cache
#: (``VllmTPUDeepseekV32IndexerBackend``, ``kernels/deepseek_v4/streamindex_topk/
#: streamindex_topk.py`` ``get_kv_cache_shape``, ``HEAD_ALONG_SUBLANE``) holds a 129-byte record
#: per token (128 fp8 key bytes, then one e8m0 scale byte: ``convert_cache_to_seq_along_lane``
#: reads ``[:128]`` and ``[128]``) in a 256-byte row.
SPARSE_MLA_CACHES = (("nope", 512, 512), ("rope", 128, 128), ("indexer", 129, 256))

#: The indexer's K cache in its other layout, ``SEQ_ALONG_LANE`` (``(N, 33, 4, block_size)``
#: uint8: byte ``j`` of every token's 132-byte record, 128 key bytes, the scale byte and 3 bytes
#: of padding, is row ``j`` of the block, the tokens along the lanes; vllm-torchtpu 0.29.0
#: ``streamindex_topk.py`` ``get_kv_cache_shape`` and ``convert_cache_to_seq_along_lane``): no
#: token is contiguous, so tpu-sync moves its blocks whole, as opaque regions of ``block_size *
#: 132`` bytes (both sides need the same block size; this block format tag).
SAL_INDEXER_LANES = 132
SAL_INDEXER_FORMAT = "vllm-tpu/dsa-indexer-seq-along-lane/uint8"

#: Layouts of the sparse MLA ``nope`` and ``rope`` caches (``TPU_SPARSE_MLA_NOPE_LAYOUT`` /
#: ``TPU_SPARSE_MLA_ROPE_LAYOUT``, default ``sparsecore``; vllm-torchtpu 0.29.0 ``envs.py``) and
#: the torch dtype of each (``kernels/mla/kv_cache_utils.py`` ``_LAYOUT_DTYPES``): a token's row
#: holds the same bytes in another order in each, so both sides must use the same.
SPARSE_MLA_LAYOUTS = {"sparsecore": "torch.uint32", "tensorcore": "torch.uint8"}

#: Sublanes of a TPU vector register (8 on every TPU generation vLLM-TorchTPU runs on:
#: ``pltpu.get_tpu_info_for_chip(...).num_sublanes``). The ``SEQ_ALONG_LANE`` cache rounds
#: head_dim up to ``SAL_SUBLANES * P`` (``get_kv_cache_shape`` in
#: ``vllm_torchtpu/kernels/experimental/batched_rpa/wrapper.py``, vllm-torchtpu-core 0.29.0).
SAL_SUBLANES = 8

#: vLLM's null block (``BlockPool.null_block``, the pool's first block, id 0): stands for the
#: blocks a sliding-window group no longer holds; never a request's own KV.
from .._check import NULL_BLOCK_ID  # noqa: E402  (one definition, shared with the adapters)

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
        kv_order: the per-layer tensor layout (``tpu_sync`` block order): ``lbhnc`` for vLLM's
            CPU backend (``[num_blocks, heads_per_rank, block_size, 2 * head_dim]``, opaque
            blocks tagged by :attr:`block_format`), ``rpa3`` or ``rpa3hd64`` for the TPU
            backends' ragged paged attention v3 caches (``[num_blocks, block_size, R, P, D']``,
            :meth:`layer_shape`; vllm-torchtpu 0.29 ``PallasAttentionBackend.get_kv_cache_shape``
            in ``vllm_torchtpu/layers/adapter/attention.py``, which picks the head_dim-64 kernel
            when ``head_size == 64``), or ``rpa-sal`` (:data:`SAL_ORDER`) for its batched kernel's
            ``SEQ_ALONG_LANE`` cache ``[num_blocks, 2 * H, D' / P, P, block_size]``, moved as
            opaque ``(block, head)`` regions (tpu_sync order ``lbhnc``: :meth:`tpu_sync_layout`).
        groups: None for a model whose layers are one full-attention KV cache group (every
            uniform model: all layers share one block table, exactly as before groups existed).
            Otherwise vLLM's KV cache groups (``KVCacheConfig.kv_cache_groups``, one block table
            each), in vLLM's group order, as JSON-able dicts (see :func:`kv_groups`):
            ``{"kind": "attention", "layers": [cache layers], "sliding_window": tokens or None}``,
            or for a Mamba / linear-attention state group (vLLM ``MambaSpec``, one state slot
            per request: the group's one block) ``{"kind": "state", "layers": [...], "state":
            tpu_sync state kind (:func:`mamba_state_group`), "slot_bytes": slot stride}``.
            Cache layers number the per-layer KV tensors in model layer order (the order
            :meth:`tpu_sync.vllm.worker.WorkerSide.register_kv_caches` sorts them in).
        mla_parts: None, or for vLLM-TorchTPU's sparse MLA (``kv_order`` ``rpamla``, fp8) the
            token-major caches of every vLLM block, each ``{"name": "nope" | "rope" |
            "indexer", "lanes": bytes per token row, "bytes": real bytes per token (the rest of
            the row is padding, never moved), "layout": "sparsecore" | "tensorcore" |
            "head_along_sublane", "layers": [cache layers]}``. A sparse layer registers a
            ``[nope, rope]`` list (two cache layers, nope first), an indexer its K cache (one);
            cache layers number them in vLLM layer order. All of them share vLLM's one block
            table (one KV cache group of several page sizes, ``UniformTypeKVCacheSpecs``), so
            block ids stay one list; only the bytes per block differ (:meth:`layer_bytes`).
            :data:`SPARSE_MLA_CACHES`; built by :func:`sparse_mla_parts`.
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
    groups: Optional[Tuple[Dict[str, Any], ...]] = None
    kv_order: str = "lbhnc"
    mla_parts: Optional[Tuple[Dict[str, Any], ...]] = None

    @property
    def num_groups(self) -> int:
        """KV cache groups (1 for a uniform model)."""
        return len(self.groups) if self.groups else 1

    def is_state_group(self, group: int) -> bool:
        """Whether ``group`` is a Mamba / linear-attention state group (one slot per request)."""
        return bool(self.groups) and self.groups[group].get("kind") == "state"

    @property
    def vllm_groups(self) -> int:
        """KV cache groups of vLLM's ``KVCacheConfig`` (sparse MLA: its three; 1 uniform)."""
        return len(self.mla_parts) if self.mla_parts else self.num_groups

    @property
    def has_state(self) -> bool:
        """Whether some group is a state group. Such a model's P/D hands off the state taken
        after the prompt less its last token (docs/vllm.md, "Hybrid models")."""
        return any(self.is_state_group(g) for g in range(self.num_groups))

    def group_of_layer(self) -> List[int]:
        """The group index of every cache layer (all 0 for a uniform model)."""
        out = [0] * self.num_layers
        for g, grp in enumerate(self.groups or ()):
            for layer in grp["layers"]:
                out[int(layer)] = g
        return out

    def held_blocks(self, group: int, num_tokens: int, first_token: int = 0,
                    next_token: Optional[int] = None) -> Tuple[int, int]:
        """``(first, end)``: the request blocks of ``group`` that hold KV a request of
        ``num_tokens`` tokens still needs, as ``tpu_sync::layout::HybridLayout::held_blocks``
        computes them: every block for full attention; for a sliding window ``w`` only the blocks
        of tokens ``[num_tokens + 1 - w, num_tokens)`` (vLLM's
        ``SlidingWindowManager.get_num_skipped_tokens``: the blocks before them are vLLM's null
        block). A state group holds one slot per request (vLLM's ``MambaSpec`` group with
        ``mamba_cache_mode="none"`` gives a request one block, its state slot): ``(0, 1)``.
        ``first_token`` (a local prefix hit, block-aligned): only the blocks from
        ``first_token // block_size`` on (``HybridPlacement::listed_blocks``: the blocks a
        destination with that ``first_token`` lists); a state group's slot whatever it is.
        ``next_token``: the first token the side computes after the transfer (None:
        ``num_tokens``), whose window ``[next_token + 1 - w, ...)`` it needs
        (``HybridPlacement::next_token``)."""
        if self.is_state_group(group):
            return 0, 1
        nb = -(-int(num_tokens) // self.block_size)
        w = (self.groups[group].get("sliding_window") if self.groups else None)
        nxt = int(num_tokens) if next_token is None else min(int(next_token), int(num_tokens))
        start = max(0, nxt + 1 - int(w)) if w else 0
        return min(max(start, int(first_token)) // self.block_size, nb), nb

    def group_held_ids(self, block_ids: Sequence[Sequence[int]], num_tokens: int,
                       first_token: int = 0, next_token: Optional[int] = None) -> List[List[int]]:
        """The held block ids of every group (:meth:`held_blocks`, from ``first_token`` on, for
        a side computing from ``next_token``) from vLLM's block ids of a request (one list per
        group, as ``KVCacheBlocks.get_block_ids()`` returns them).

        Raises:
            ValueError: a group count other than :attr:`num_groups`, a group with fewer blocks
                than ``num_tokens`` needs, or vLLM's null block (id 0) among the held blocks.
        """
        if len(block_ids) != self.num_groups:
            raise ValueError(f"TpuSyncConnector: {len(block_ids)} lists of block ids for {self.num_groups} KV "
                             f"cache groups")
        out = []
        for g, ids in enumerate(block_ids):
            first, end = self.held_blocks(g, num_tokens, first_token, next_token)
            if len(ids) < end:
                raise ValueError(f"TpuSyncConnector: KV cache group {g} has {len(ids)} blocks, {num_tokens} "
                                 f"tokens need {end}")
            held = [int(b) for b in ids[first:end]]
            if any(b == NULL_BLOCK_ID for b in held):
                raise ValueError(f"TpuSyncConnector: KV cache group {g}: vLLM's null block among the blocks "
                                 f"{first}..{end} that hold the last tokens of {num_tokens}: {held}")
            out.append(held)
        return out

    @property
    def kv_planes(self) -> int:
        """2 (K and V), or 1 for MLA."""
        return 1 if self.use_mla else 2

    @property
    def elem_bytes(self) -> int:
        """Bytes per element."""
        return {"f32": 4, "bf16": 2, "f16": 2, "fp8": 1}[self.dtype]

    @property
    def is_rpa3(self) -> bool:
        """Whether the tensors are a TPU backend's ragged paged attention v3 caches."""
        return self.kv_order in RPA3_ORDERS

    @property
    def packing(self) -> int:
        """Elements packed into one 32-bit word of an RPA v3 cache (``P = 32 / bits``: fp32 1,
        bf16 and f16 2, fp8 4; ``get_dtype_packing`` of the TPU backends)."""
        return 4 // self.elem_bytes

    @property
    def is_sal(self) -> bool:
        """Whether the tensors are vLLM-TorchTPU's batched ragged paged attention caches in the
        ``SEQ_ALONG_LANE`` layout (:data:`SAL_ORDER`)."""
        return self.kv_order == SAL_ORDER

    @property
    def sal_head_dim(self) -> int:
        """``D'`` of the ``SEQ_ALONG_LANE`` cache: head_dim rounded up to ``8 * P`` elements
        (:data:`SAL_SUBLANES` sublanes of ``P`` packed elements)."""
        a = SAL_SUBLANES * self.packing
        return -(-self.head_dim // a) * a

    def layer_shape(self) -> Tuple[int, ...]:
        """The shape of one block of one layer on one rank (the tensor's shape without its
        ``num_blocks`` axis): ``(heads_per_rank, block_size, planes * head_dim)`` for ``lbhnc``;
        ``(block_size, R, P, D')`` for ``rpa3`` with ``R = align(2 * heads, P) / P`` and
        ``D' = align(head_dim, 128)``; ``(block_size, align(heads, P) / P, P, 128)`` for
        ``rpa3hd64``; ``(block_size, D')`` for ``rpamla`` (tpu-inference's MLA cache as tpu_sync
        views it, ``D' = align(head_dim, 128)``); ``(2 * heads, D' / P, P, block_size)`` for
        ``rpa-sal`` with
        ``D' = align(head_dim, 8 * P)`` (:attr:`sal_head_dim`): row ``2 * h + plane`` (K before V
        of each head), then the head dimension packed ``P`` to a word, then the tokens. Source:
        vllm-torchtpu-core 0.29.0 ``get_kv_cache_shape`` (``kernels/experimental/batched_rpa/
        wrapper.py``, ``SEQ_ALONG_LANE``) and its ``merge_kv``."""
        h, p = self.heads_per_rank, self.packing
        if self.kv_order == "rpa3":
            return (self.block_size, -(-2 * h // p), p, -(-self.head_dim // 128) * 128)
        if self.kv_order == "rpa3hd64":
            return (self.block_size, -(-h // p), p, 128)
        if self.is_sal:
            return (2 * h, self.sal_head_dim // p, p, self.block_size)
        if self.kv_order == MLA_ORDER:
            return (self.block_size, self.mla_lanes)
        return (h, self.block_size, self.kv_planes * self.head_dim)

    @property
    def mla_lanes(self) -> int:
        """``D'`` of an MLA latent cache (``rpamla``): the latent and rope of a token
        (:attr:`head_dim`, e.g. 576 = 512 + 64) padded to 128 lanes."""
        return -(-self.head_dim // 128) * 128

    def torch_mla_shape(self) -> Tuple[int, ...]:
        """One block of one layer of vLLM-TorchTPU's dense MLA cache as its tensor has it:
        ``(block_size / P, P, D')``, ``P`` tokens packed to a row (:attr:`packing`: 32 / bits),
        ``D'`` = :attr:`mla_lanes`; the same bytes as :meth:`layer_shape`'s ``(block_size, D')``
        when ``P`` divides the block size. Source: vllm-torchtpu 0.29.0
        ``PallasMLAttentionBackend.get_kv_cache_shape`` (``layers/adapter/attention.py``), which
        calls ``kernels/mla/v2/kernel.py`` ``get_kv_cache_shape(num_blocks, block_size, head_size,
        kv_packing=get_dtype_packing(dtype))``: ``(num_blocks, align(block_size, P) / P, P,
        align(head_size, 128))``; ``runner/kv_cache_manager.py`` allocates one such tensor per
        MLA layer, replicated on every TP rank."""
        p = self.packing
        return (-(-self.block_size // p), p, self.mla_lanes)

    def view_shape(self, num_blocks: int) -> Optional[Tuple[int, ...]]:
        """The shape tpu_sync sees one layer's buffer in, where it differs from the tensor's
        (same bytes): ``[num_blocks, H, block_size, 2 * D']`` for ``rpa-sal``, the LBHNC shape
        of its opaque ``(block, head)`` regions (:meth:`tpu_sync_layout`); ``[num_blocks,
        block_size, D']`` for ``rpamla`` (the engines' packed ``[num_blocks, block_size / K, K,
        D']`` token-major); None otherwise."""
        if self.is_sal:
            return (int(num_blocks), self.heads_per_rank, self.block_size, 2 * self.sal_head_dim)
        if self.kv_order == MLA_ORDER:
            return (int(num_blocks),) + self.layer_shape()
        return None

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer on one rank (padding of an RPA v3 cache included).

        Raises:
            ValueError: sparse MLA caches (:attr:`mla_parts`), whose layers differ: use
            :meth:`layer_bytes`."""
        if self.mla_parts:
            raise ValueError("TpuSyncConnector: the sparse MLA caches' layers have blocks of different sizes "
                             "(KvGeometry.layer_bytes)")
        n = 1
        for d in self.layer_shape():
            n *= d
        return n * self.elem_bytes

    def layer_bytes(self) -> List[int]:
        """Bytes of one block of each cache layer on one rank, in cache layer order: all
        :attr:`layer_block_bytes`, or for sparse MLA caches ``block_size * lanes`` of each
        layer's part."""
        if not self.mla_parts:
            return [self.layer_block_bytes] * self.num_layers
        out = [0] * self.num_layers
        for part in self.mla_parts:
            for layer in part["layers"]:
                out[int(layer)] = self.block_size * int(part["lanes"])
        return out

    def part_of_layer(self) -> List[Dict[str, Any]]:
        """The :attr:`mla_parts` entry of every cache layer (sparse MLA caches only)."""
        out: List[Dict[str, Any]] = [{}] * self.num_layers
        for part in self.mla_parts or ():
            for layer in part["layers"]:
                out[int(layer)] = part
        return out

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of every layer on one rank (one host-tier entry)."""
        return sum(self.layer_bytes())

    def to_dict(self) -> Dict[str, Any]:
        """Plain dict (JSON-able), as sent in ``kv_transfer_params``."""
        return asdict(self)

    def mismatch(self, other: Dict[str, Any]) -> Optional[str]:
        """Why KV blocks of a peer with geometry ``other`` (a :meth:`to_dict`) cannot be used
        here, or None when they can. Compares everything that fixes a block's bytes (layers,
        heads, head_dim, dtype, block size, MLA, block format); TP may differ (resharded), and so
        may a state group's slot stride (``slot_bytes``: vLLM pads a rank's state page to its
        attention page, which halves with TP; each side's stride is in its own layout)."""
        keys = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "use_mla", "block_format", "groups",
                "kv_order", "mla_parts")

        mine = self.to_dict()
        theirs = dict(other)
        for d in (mine, theirs):
            if isinstance(d.get("groups"), (list, tuple)):
                d["groups"] = without_slot_stride(d["groups"])
        theirs.setdefault("kv_order", "lbhnc")  # a peer from before the field: vLLM's CPU layout
        diff = [f"{k}: local {mine[k]!r}, remote {theirs.get(k)!r}" for k in keys
                if _plain(theirs.get(k)) != _plain(mine[k])]
        return "; ".join(diff) if diff else None

    def namespace(self, extra: str = "") -> str:
        """Host-tier namespace: blocks of engines whose namespaces differ never share keys."""
        return (
            f"vllm/{self.model}/{self.block_format}/bs{self.block_size}/L{self.num_layers}"
            f"/H{self.num_kv_heads}/D{self.head_dim}/tp{self.tp}" + self._groups_tag() + (f"/{extra}" if extra else "")
        )

    def _groups_tag(self) -> str:
        """Namespace part naming the groups (empty for a uniform model, so its keys are as before)."""
        if self.mla_parts:
            return "/sparse=" + ";".join(f"{p['name']}.{p['layout']}:" + ",".join(str(l) for l in p["layers"])
                                         for p in self.mla_parts)
        if not self.groups:
            return ""
        parts = []
        for grp in self.groups:
            w = grp.get("sliding_window")
            kind = "state" if grp.get("kind") == "state" else ("sw%d" % w if w else "full")
            parts.append(kind + ":" + ",".join(str(l) for l in grp["layers"]))
        return "/groups=" + ";".join(parts)

    def tpu_sync_layout(self, num_blocks: int, dp: int = 1) -> Dict[str, Any]:
        """The ``tpu_sync`` layout (``ParallelLayout`` JSON) of this engine: order ``lbhnc``
        with the block format tag, ``num_blocks`` blocks per rank (``dp`` data-parallel
        replicas of TP ranks: tpu-inference's DP, ranks ``d * tp + t``); for an RPA v3 cache the order
        :attr:`kv_order` (the planner then reshards between TP sizes and block sizes and moves
        only real heads and tokens, never padding). With :attr:`groups` the groups
        form (``tpu_sync::layout::HybridLayout`` JSON): one group per vLLM KV cache group, each
        ``num_blocks`` blocks per rank (vLLM's groups share one block pool) and the block format
        tag, or the RPA v3 order (vLLM-TorchTPU's attention groups, each layer its own RPA v3
        tensor). With ``dp`` > 1 the groups' layout has ``dp`` replicas of ``num_blocks`` blocks
        per rank, as a uniform one (tpu-inference's DP: the groups share each replica's pool).

        Sparse MLA caches (:attr:`mla_parts`) are the groups form too: one ``mla`` group per
        part (``head_dim`` its real bytes per token, fp8, so tpu_sync's ``rpamla`` rows are its
        ``lanes``), ``num_blocks`` blocks each, one block table for all (:func:`placement`
        takes one list of ids for them); the indexer's ``SEQ_ALONG_LANE`` cache is an
        ``attention`` group of one head and one plane of 132 fp8 bytes in the ``lbhnc`` order,
        tagged :data:`SAL_INDEXER_FORMAT`: opaque whole blocks.

        Raises:
            ValueError: KV cache groups with the SEQ_ALONG_LANE or MLA cache (not mapped yet)."""
        if self.mla_parts:
            def kind(p: Dict[str, Any]) -> Dict[str, Any]:
                if p["layout"] == "seq_along_lane":
                    return dict(type="attention", num_kv_heads=1, head_dim=int(p["lanes"]), kv_planes=1, dtype="fp8")
                return dict(type="mla", head_dim=int(p["bytes"]), dtype="fp8")

            return dict(
                model=dict(name=self.model, groups=[
                    dict(name=p["name"], layers=[int(l) for l in p["layers"]], kind=kind(p)) for p in self.mla_parts]),
                spec=dict(tp=self.tp, pcp=1, dp=int(dp), block_size=self.block_size, order=MLA_ORDER),
                groups=[dict(num_blocks=int(num_blocks), order="lbhnc", block_format=SAL_INDEXER_FORMAT)
                        if p["layout"] == "seq_along_lane" else dict(num_blocks=int(num_blocks))
                        for p in self.mla_parts],
            )
        if self.groups and (self.is_sal or self.kv_order == MLA_ORDER):
            raise ValueError(f"TpuSyncConnector: KV cache groups with the {self.kv_order} cache are not supported yet "
                             "(the RPA v3 caches and vLLM's CPU cache are)")
        if self.groups:
            attn = dict(type="attention", num_kv_heads=1 if self.use_mla else self.num_kv_heads, head_dim=self.head_dim,
                        kv_planes=self.kv_planes, dtype=self.dtype)
            groups = []
            glayouts = []
            for g, grp in enumerate(self.groups):
                if grp.get("kind") == "state":
                    # One slot per block of vLLM's shared pool, slot stride page_size_padded.
                    groups.append(dict(name=f"g{g}_state", layers=[int(l) for l in grp["layers"]],
                                       kind=grp["state"]))
                    glayouts.append(dict(num_blocks=int(num_blocks), order="nhd", slot_bytes=int(grp["slot_bytes"])))
                    continue
                # The RPA v3 orders name their own element order (no tag, as uniform layouts).
                glayouts.append(dict(num_blocks=int(num_blocks)) if self.is_rpa3 else
                                dict(num_blocks=int(num_blocks), block_format=self.block_format))
                kind = dict(attn)
                w = grp.get("sliding_window")
                if w:
                    kind["sliding_window"] = int(w)
                groups.append(dict(name=f"g{g}_" + ("sliding" if w else "full"), layers=[int(l) for l in grp["layers"]],
                                   kind=kind))
            return dict(
                model=dict(name=self.model, groups=groups),
                spec=dict(tp=self.tp, pcp=1, dp=int(dp), block_size=self.block_size,
                          order=self.kv_order if self.is_rpa3 else "lbhnc"),
                groups=glayouts,
            )
        # The SEQ_ALONG_LANE cache's bytes of one (block, head) are one contiguous run, K's rows
        # of D' elements x block_size tokens then V's: tpu_sync's opaque LBHNC region of a model
        # whose head_dim is D' (head_dim padding, where D' > head_dim, is moved with it). Plans
        # move whole regions: whole blocks, or head slices of blocks between TP sizes; both sides
        # must have this block format and block size.
        sal = self.is_sal
        if sal and self.use_mla:
            raise ValueError("TpuSyncConnector: an MLA model's cache in the SEQ_ALONG_LANE layout is not supported")
        return dict(
            model=dict(
                name=self.model,
                num_layers=self.num_layers,
                num_kv_heads=1 if self.use_mla else self.num_kv_heads,
                head_dim=self.sal_head_dim if sal else self.head_dim,
                kv_planes=self.kv_planes,
                dtype=self.dtype,
            ),
            spec=dict(tp=self.tp, pcp=1, dp=int(dp), block_size=self.block_size,
                      order="lbhnc" if sal else self.kv_order),
            num_blocks=int(num_blocks),
            # The TPU orders that name their own element order carry no block format tag (so
            # they plan against the GPU orders); the opaque LBHNC regions need one.
            **({} if self.is_rpa3 or self.kv_order == MLA_ORDER else dict(block_format=self.block_format)),
        )


def _plain(v: Any) -> Any:
    """``v`` as it reads back from JSON (tuples are lists), for comparing a local value with a
    peer's."""
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def placement(layout: Dict[str, Any], block_ids: Sequence[Any], first_token: int = 0,
              next_token: Optional[int] = None) -> Dict[str, Any]:
    """``tpu_sync`` placement of a request whose blocks have the same ids on every TP rank (as
    in vLLM, where all TP workers share one block table). For a layout with groups
    (:meth:`KvGeometry.tpu_sync_layout` of a grouped geometry) ``block_ids`` holds one list per
    group: that group's held blocks (:meth:`KvGeometry.group_held_ids`, from ``first_token``
    on). ``first_token``: the blocks hold the request from that token (block-aligned) on, as
    :func:`tpu_sync.plan.placement` reads it (a flat list then starts at block
    ``first_token // block_size``). ``next_token`` (layouts with groups): the first token
    the destination computes after the pull (None: the request's next token); a
    sliding-window group then holds that token's window (:meth:`KvGeometry.held_blocks`).

    A grouped layout in the TPU MLA order (vLLM-TorchTPU's sparse MLA caches,
    :attr:`KvGeometry.mla_parts`) takes one flat list: all its groups share vLLM's one block
    table.

    Raises:
        ValueError: a grouped layout given a number of lists other than its group count."""
    tp = int(layout["spec"]["tp"])
    if "groups" in layout:
        n = len(layout["groups"])
        if layout["spec"].get("order") == MLA_ORDER and all(not isinstance(b, (list, tuple)) for b in block_ids):
            block_ids = [list(block_ids)] * n
        if len(block_ids) != n or not all(isinstance(g, (list, tuple)) for g in block_ids):
            raise ValueError(f"TpuSyncConnector: block ids must be one list per KV cache group ({n}), got "
                             f"{str(block_ids)[:200]}")
        gids = [[int(b) for b in ids] for ids in block_ids]
        gout = dict(layout=layout, dp_rank=0, block_ids=[[list(ids) for _ in range(tp)] for ids in gids])
        if first_token:
            gout["first_token"] = int(first_token)
        if next_token is not None:
            gout["next_token"] = int(next_token)
        return gout
    ids = [int(b) for b in block_ids]
    out = dict(layout=layout, dp_rank=0, block_ids=[list(ids) for _ in range(tp)])
    if first_token:
        out["first_token"] = int(first_token)
    return out


def without_slot_stride(groups: Sequence[Any]) -> List[Any]:
    """Groups (a geometry's or a layout's) without a state group's ``slot_bytes``: each
    engine's own slot stride (vLLM pads a rank's state page to its attention page), which
    another engine's geometry or presumed layout must not carry."""
    return [{k: v for k, v in g.items() if k != "slot_bytes"} if isinstance(g, dict) else g for g in groups]


def pullers_of_rank(src: Dict[str, Any], rank: Union[int, Iterable[int]], num_tokens: int, decode_tp: int) -> int:
    """How many ranks of a decode instance with TP ``decode_tp`` (same model and block format)
    pull from producer rank ``rank`` of placement ``src`` (or from any of the ranks ``rank``,
    when one endpoint serves several: a JAX runner): the registration's expected releases,
    counted by consumer rank (the connector's endpoints count releases by rank, so a consumer
    with one endpoint per rank and one with a single endpoint for all its ranks count alike).
    0 when no decode rank reads from them: a replica that the plan does not use (the TPU engines'
    MLA latent, or KV heads replicated because there are fewer than TP, pulled from fewer
    producer ranks than hold them), which the producer need not register. Uses the native
    planner (:class:`tpu_sync.Plan`), the one the consumer plans its pull with."""
    ranks = {int(rank)} if isinstance(rank, int) else {int(r) for r in rank}
    layout = src["layout"]
    nb = -(-int(num_tokens) // int(layout["spec"]["block_size"]))
    if "groups" in layout:
        # Same groups; each group's held blocks numbered from 0 in a layout just large enough,
        # state slots without the producer's stride (a rank's padded page depends on its TP:
        # the decode instance's own is not known here, and no stride changes who reads what).
        dst_layout = dict(layout, spec=dict(layout["spec"], tp=int(decode_tp), dp=1),
                          groups=[dict(g, num_blocks=max(nb, 1)) for g in without_slot_stride(layout["groups"])])
        dst = dict(layout=dst_layout, dp_rank=0,
                   block_ids=[[list(range(len(per[0]))) for _ in range(int(decode_tp))] for per in src["block_ids"]])
    else:
        dst_layout = dict(layout, spec=dict(layout["spec"], tp=int(decode_tp), dp=1), num_blocks=max(nb, 1))
        dst = placement(dst_layout, list(range(nb)))
    return len({d for s, d in _rank_pairs(src, dst, num_tokens) if s in ranks})


def _rank_pairs(src: Dict[str, Any], dst: Dict[str, Any], num_tokens: int) -> Set[Tuple[int, int]]:
    """``(source rank, destination rank)`` of every span the native planner plans between
    placements ``src`` and ``dst`` (:class:`tpu_sync.Plan`)."""
    import tpu_sync

    plan = tpu_sync.Plan(src, dst, int(num_tokens))
    try:
        return {(int(sp.src_rank), int(sp.dst_rank)) for sp in plan.spans()}
    finally:
        plan.close()


def source_ranks(src_layout: Dict[str, Any], dst: Dict[str, Any], num_tokens: int,
                 dst_ranks: Iterable[int]) -> List[int]:
    """The producer ranks (of ``src_layout``, a uniform layout or the sparse MLA caches' one
    block table) that the destination ranks ``dst_ranks`` of placement ``dst`` read a request
    of ``num_tokens`` tokens from, sorted: planned with the native planner against stand-in
    source block ids (which ranks send does not depend on them). A both-at-once consumer asks
    one of them for the request's placement: their registrations wait for its release, while
    another rank's may already be gone (released by its own pullers).

    Raises:
        ValueError, tpu_sync errors: a layout the planner refuses."""
    nb = -(-int(num_tokens) // int(src_layout["spec"]["block_size"]))
    src = placement(src_layout, list(range(1, nb + 1)))
    want = {int(r) for r in dst_ranks}
    return sorted({s for s, d in _rank_pairs(src, dst, num_tokens) if d in want})


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


def layer_order(names: Sequence[str]) -> List[str]:
    """vLLM layer names in model layer order (the cache layer numbering). Needs vLLM."""
    from vllm.model_executor.models.utils import extract_layer_index

    return sorted(names, key=lambda n: (extract_layer_index(n), n))


def kv_groups(kv_cache_config: Any, block_size: int, tp: int = 1,
              state_split: Optional[Tuple[str, Dict[str, int]]] = None) -> Optional[Tuple[Dict[str, Any], ...]]:
    """:attr:`KvGeometry.groups` from vLLM's ``KVCacheConfig``: None when its groups are one
    full-attention group (a uniform model); otherwise one dict per ``kv_cache_groups`` entry
    with the cache layers of its ``layer_names`` and its kind from its ``kv_cache_spec``
    (``FullAttentionSpec``; ``SlidingWindowSpec.sliding_window`` in tokens; ``MambaSpec``: a
    state group, :func:`mamba_state_group` with ``state_split``, the model's
    :func:`mamba_state_split`). Needs vLLM.

    Raises:
        ValueError: a group this connector cannot move (MLA, chunked local attention,
            cross-attention, ...: the kind is named; a ``MambaSpec`` with a
            ``mamba_cache_mode`` other than ``"none"``, speculative state blocks, a state
            sharded over TP, or a model of state groups only), or an attention group whose
            block size differs from the engine's ``block_size``.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    order = layer_order([n for g in groups for n in g.layer_names])
    index = {n: i for i, n in enumerate(order)}
    out = []
    for g, grp in enumerate(groups):
        spec = grp.kv_cache_spec
        kind = type(spec).__name__
        if type(spec) is FullAttentionSpec and getattr(spec, "attention_chunk_size", None) is None \
                and not getattr(spec, "sliding_window", None):
            w = None
        elif type(spec) is SlidingWindowSpec:
            w = int(spec.sliding_window)
        elif type(spec) is MambaSpec:
            where = f"KV cache group {g} ({', '.join(grp.layer_names[:3])}...) is MambaSpec"
            mode = str(getattr(spec, "mamba_cache_mode", "none"))
            if mode != "none":
                # align/all keep states at block boundaries in several blocks per request; the
                # connector maps one slot per request (docs/vllm.md, "Hybrid models").
                raise ValueError(f"TpuSyncConnector: {where} with mamba_cache_mode={mode!r}; only 'none' "
                                 f"(prefix caching off) is moved")
            if int(getattr(spec, "num_speculative_blocks", 0) or 0):
                raise ValueError(f"TpuSyncConnector: {where} with {spec.num_speculative_blocks} speculative state "
                                 f"blocks; only one state slot per request is moved")
            state, slot = mamba_state_group(spec, tp, state_split)
            out.append(dict(kind="state", layers=sorted(index[n] for n in grp.layer_names), state=state,
                            slot_bytes=int(slot)))
            continue
        else:
            raise ValueError(f"TpuSyncConnector: KV cache group {g} ({', '.join(grp.layer_names[:3])}...) is "
                             f"{kind}; only full attention and sliding window groups are moved")
        if int(spec.block_size) != int(block_size):
            raise ValueError(f"TpuSyncConnector: KV cache group {g} has block size {spec.block_size}, the engine "
                             f"{block_size}")
        out.append(dict(kind="attention", layers=sorted(index[n] for n in grp.layer_names), sliding_window=w))
    if all(grp["kind"] == "state" for grp in out):
        raise ValueError("TpuSyncConnector: every KV cache group is a MambaSpec state group; a model without "
                         "attention layers is not moved")
    if len(out) == 1 and out[0]["sliding_window"] is None:
        return None
    return tuple(out)


def _has_state_group(kv_cache_config: Any) -> bool:
    return any(type(g.kv_cache_spec).__name__ == "MambaSpec"
               for g in getattr(kv_cache_config, "kv_cache_groups", None) or ())


def mamba_state_group(spec: Any, tp: int = 1, split: Optional[Tuple[str, Dict[str, Any]]] = None
                      ) -> Tuple[Dict[str, Any], int]:
    """The tpu_sync state group kind (``tpu_sync::layout::GroupKind::State`` JSON) of a vLLM
    ``MambaSpec`` and its slot stride in bytes (``page_size_padded``, else the dense state
    size): one component per ``(shape, dtype)`` of the spec, in order (vLLM lays a Mamba
    layer's states one after another in each block of the group, e.g. the convolution state
    ``(d_conv - 1, conv_dim)`` then the SSM state ``(heads, head_dim, d_state)``).

    With ``split`` (the model's :func:`mamba_state_split`), each component is described in the
    whole model's heads (:func:`state_components`), so the state moves between engines of
    different TP, each rank its share of every segment. Without it, ``rows`` is the first
    dimension (1 for 1-D) and each row one opaque segment of the rank's elements: that
    describes a TP=1 engine (or a replicated state) only. :func:`kv_groups` uses it for the
    connector's state groups (docs/vllm.md, "Hybrid models").

    Raises:
        ValueError: a dtype tpu_sync cannot describe; a ``split`` whose per-rank shapes at
        ``tp`` are not the spec's (named); ``tp > 1`` for a state sharded over TP without a
        ``split``."""
    replicated = bool(getattr(spec, "tp_replicated", False))
    names = []
    for i, dt in enumerate(spec.dtypes):
        name = str(dt)
        if name not in TORCH_TO_TPU_SYNC_DTYPE:
            raise ValueError(f"TpuSyncConnector: Mamba state {i} is {name}, which tpu_sync cannot describe")
        names.append(TORCH_TO_TPU_SYNC_DTYPE[name])
    shapes = [tuple(int(d) for d in shape) for shape in spec.shapes]
    dense = sum(_prod(sh) * int(getattr(dt, "itemsize", 4)) for sh, dt in zip(shapes, spec.dtypes))
    slot = int(getattr(spec, "page_size_padded", None) or dense)
    if split is not None and not replicated:
        try:
            comps = state_components(split[0], split[1], shapes, names, tp)
            return dict(type="state", components=comps, replicated=False), slot
        except ValueError as e:
            whole = _whole_model_state(split, shapes, names, int(tp))
            if whole is not None:
                return dict(type="state", components=whole, replicated=False), slot
            if int(tp) > 1:
                raise
            _log.info("tpu_sync: the Mamba state described as one rank's (%s)", e)
    if int(tp) > 1 and not replicated:
        raise ValueError("TpuSyncConnector: a TP-sharded Mamba state needs the model's head split of each component "
                         "(mamba_state_split found none for this model: docs/vllm.md, \"Hybrid models\")")
    comps = []
    for i, (dims, dt) in enumerate(zip(shapes, names)):
        rows = dims[0] if len(dims) > 1 else 1
        elems = _prod(dims[1:] if len(dims) > 1 else dims)
        comps.append(dict(name=f"state{i}", dtype=dt, rows=rows, segments=[dict(heads=1, head_elems=elems)]))
    return dict(type="state", components=comps, replicated=replicated), slot


def _whole_model_state(split: Tuple[str, Dict[str, Any]], shapes: List[Tuple[int, ...]], names: List[str],
                       tp: int) -> Optional[List[Dict[str, Any]]]:
    """The state components at ``tp`` of a spec whose ``shapes`` are the whole model's (the
    calculator's at TP 1), or None where they are not. tpu-inference initializes vLLM's
    model-parallel group with TP 1 (``worker/tpu_worker.py`` 0.32.0), so its ``MambaSpec`` holds
    the whole state and JAX shards the arrays over the mesh's TP (docs/tpu.md); vLLM's own
    engines give each rank's shapes."""
    if tp <= 1:
        return None
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc

        method, args = split[0], dict(split[1])
        key = "tp_size" if "tp_size" in args else "tp_world_size"
        fn = getattr(calc, method)
        if [tuple(int(d) for d in sh) for sh in fn(**dict(args, **{key: 1}))] != list(shapes):
            return None
        at_tp = dict(args, **{key: tp})
        return state_components(method, at_tp, [tuple(int(d) for d in sh) for sh in fn(**at_tp)], names, tp)
    except Exception as e:  # noqa: BLE001  (not the whole model's: the caller's error stands)
        _log.debug("tpu_sync: not a whole-model state spec: %s", e)
        return None


def _prod(dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


#: The ``MambaStateShapeCalculator`` methods (vLLM ``model_executor/layers/mamba/mamba_utils.py``)
#: whose arguments :func:`state_components` turns into a split over TP.
STATE_SHAPE_METHODS = ("mamba1_state_shape", "mamba2_state_shape", "gated_delta_net_state_shape",
                       "short_conv_state_shape", "linear_attention_state_shape")

_split_lock = threading.Lock()


def mamba_state_split(vllm_config: Any) -> Optional[Tuple[str, Dict[str, Any]]]:
    """How the model's Mamba / linear-attention state splits over TP: the one
    ``MambaStateShapeCalculator`` call (a name of :data:`STATE_SHAPE_METHODS`) and its
    arguments by name that the model's ``get_mamba_state_shape_from_config(vllm_config)`` makes.

    vLLM's model classes map their Hugging Face config (``mamba_n_heads``, ``linear_num_key_heads``,
    ...) to the calculator's arguments (heads, head sizes, groups, kernel); recording that call
    while the model class computes its shapes (as vLLM's platform does when it sizes pages,
    ``platforms/interface.py``) gives the whole model's split for every architecture that uses the
    calculator, without a table of config names here. The calculator is wrapped only during that
    call, under a lock.

    Returns None (the caller then describes a TP=1 or replicated state only) when vLLM or the
    model class cannot be resolved, the model has several state layouts
    (``get_mamba_specs_from_config``), or it made no call or several, or another method's.
    Needs vLLM. Thread-safe."""
    try:
        import inspect

        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as calc
        from vllm.model_executor.models import ModelRegistry

        mc = vllm_config.model_config
        arch = getattr(mc, "architecture", None) or list(getattr(mc, "architectures", None) or [])
        model_cls, _ = ModelRegistry.resolve_model_cls(arch, model_config=mc)
    except Exception as e:  # noqa: BLE001  (any failure: no split, said in the log)
        _log.info("tpu_sync: no Mamba state split (model class not resolved: %s)", e)
        return None
    get = getattr(model_cls, "get_mamba_state_shape_from_config", None)
    if get is None or hasattr(model_cls, "get_mamba_specs_from_config"):
        _log.info("tpu_sync: no Mamba state split for %s (%s)", model_cls.__name__,
                 "no get_mamba_state_shape_from_config" if get is None else "several state layouts")
        return None
    calls: List[Tuple[str, Dict[str, Any]]] = []

    def recorder(name: str, fn: Any) -> Any:
        sig = inspect.signature(fn)

        def rec(cls: Any, *a: Any, **k: Any) -> Any:
            b = sig.bind(cls, *a, **k)
            b.apply_defaults()
            calls.append((name, {n: v for i, (n, v) in enumerate(b.arguments.items()) if i}))
            return fn(cls, *a, **k)

        return classmethod(rec)

    with _split_lock:
        saved = {n: calc.__dict__[n] for n in STATE_SHAPE_METHODS if isinstance(calc.__dict__.get(n), classmethod)}
        try:
            for n, cm in saved.items():
                setattr(calc, n, recorder(n, cm.__func__))
            get(vllm_config)
        except Exception as e:  # noqa: BLE001
            _log.info("tpu_sync: no Mamba state split (%s.get_mamba_state_shape_from_config: %s)",
                     model_cls.__name__, e)
            return None
        finally:
            for n, cm in saved.items():
                setattr(calc, n, cm)
    if len(calls) != 1:
        _log.info("tpu_sync: no Mamba state split for %s (%d calculator calls)", model_cls.__name__, len(calls))
        return None
    return calls[0]


def _local_heads(heads: int, tp: int) -> int:
    """Heads of a segment on one TP rank (as ``tpu_sync::layout::HeadSplit``: contiguous
    chunks, one head per rank when TP exceeds the heads)."""
    return max(heads // tp, 1)


def state_components(method: str, args: Dict[str, Any], shapes: Sequence[Sequence[int]], dtypes: Sequence[str],
                     tp: int) -> List[Dict[str, Any]]:
    """The state components (``tpu_sync::layout::StateComponent`` JSON) of a vLLM
    ``MambaStateShapeCalculator.<method>(**args)`` state, in the whole model's heads; ``shapes``
    (per TP rank, ``MambaSpec.shapes``) and ``dtypes`` (tpu_sync names) are the spec's, checked
    against the split at ``tp``.

    Each rank's share of a tensor column-split over TP is its share of every part, in order:
    vLLM loads the convolution weights part by part (``mamba_v2_sharded_weight_loader``), so the
    convolution state's channels on a rank are its x (Mamba2: heads x head_dim), B and C
    (``n_groups x d_state`` each; one group on every rank when ``n_groups`` is 1); GDN's its
    q, k (``num_k_heads x head_k_dim`` each) and v (``num_v_heads x head_v_dim``). The
    convolution state is ``(state_len, channels)`` (vLLM's default ``SD`` layout: ``rows =
    state_len``) or ``(channels, state_len)`` (``VLLM_SSM_CONV_STATE_LAYOUT=DS``,
    ``is_conv_state_dim_first()``: one row, each channel ``state_len`` elements). The recurrent states are
    ``(heads / tp, ...)``: one row of ``heads`` segments (Mamba1: ``intermediate_size`` channels).

    Raises:
        ValueError: an unknown method, heads that do not split over ``tp``, or per-rank shapes
        other than the spec's (each named)."""
    a = {k: int(v) for k, v in args.items() if isinstance(v, (int, bool)) or hasattr(v, "__index__")}

    def need(*keys: str) -> List[int]:
        miss = [k for k in keys if k not in a]
        if miss:
            raise ValueError(f"TpuSyncConnector: {method} without {', '.join(miss)}")
        return [a[k] for k in keys]

    def conv(parts: List[Tuple[int, int]], state_len: int) -> Tuple[Dict[str, Any], Tuple[int, int]]:
        """A convolution state of channels ``parts`` (heads, channels a head) and its per-rank
        shape as the spec has it."""
        local = sum(_local_heads(h, tp) * c for h, c in parts)
        try:
            from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

            sd = not is_conv_state_dim_first()
        except ImportError:  # an older vLLM: SD only
            sd = True
        if sd:
            return dict(name="conv", rows=state_len, segments=[dict(heads=h, head_elems=c) for h, c in parts]), \
                (state_len, local)
        return dict(name="conv", rows=1, segments=[dict(heads=h, head_elems=c * state_len) for h, c in parts]), \
            (local, state_len)

    if method == "mamba2_state_shape":
        inter, ng, nh, hd, ss, k = need("intermediate_size", "n_groups", "num_heads", "head_dim", "state_size",
                                        "conv_kernel")
        if nh <= 0 or inter % nh:
            raise ValueError(f"TpuSyncConnector: a Mamba2 state of intermediate size {inter} over {nh} heads")
        c, cs = conv([(nh, inter // nh), (ng, ss), (ng, ss)], k - 1 + a.get("num_spec", 0))
        comps = [(c, cs), (dict(name="ssm", rows=1, segments=[dict(heads=nh, head_elems=hd * ss)]),
                           (_local_heads(nh, tp), hd, ss))]
    elif method == "gated_delta_net_state_shape":
        nk, nv, hk, hv, k = need("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size")
        c, cs = conv([(nk, hk), (nk, hk), (nv, hv)], k - 1 + a.get("num_spec", 0))
        comps = [(c, cs), (dict(name="recurrent", rows=1, segments=[dict(heads=nv, head_elems=hv * hk)]),
                           (_local_heads(nv, tp), hv, hk))]
    elif method == "mamba1_state_shape":
        inter, ss, k = need("intermediate_size", "state_size", "conv_kernel")
        c, cs = conv([(inter, 1)], k - 1)
        comps = [(c, cs), (dict(name="ssm", rows=1, segments=[dict(heads=inter, head_elems=ss)]),
                           (_local_heads(inter, tp), ss))]
    elif method == "short_conv_state_shape":
        inter, k = need("intermediate_size", "conv_kernel")
        comps = [conv([(inter, 1)], k - 1 + a.get("num_spec", 0))]
    elif method == "linear_attention_state_shape":
        nh, hd = need("num_heads", "head_dim")
        comps = [(dict(name="state", rows=1, segments=[dict(heads=nh, head_elems=hd * hd)]),
                  (_local_heads(nh, tp), hd, hd))]
    else:
        raise ValueError(f"TpuSyncConnector: no TP split of a {method} state")
    bad = [f"{c['name']} splits {sg['heads']} heads over TP {tp}" for c, _ in comps for sg in c["segments"]
           if not (sg["heads"] % tp == 0 or tp % sg["heads"] == 0)]
    want = [tuple(int(d) for d in sh) for sh in shapes]
    got = [tuple(s) for _, s in comps]
    if bad or got != want or len(dtypes) != len(comps):
        raise ValueError(f"TpuSyncConnector: the {method} state split at TP={tp} gives per-rank shapes {got}, "
                         f"the MambaSpec has {want}{'; ' + ', '.join(bad) if bad else ''}: not moved")
    return [dict(c, dtype=dt) for (c, _), dt in zip(comps, dtypes)]


def state_rank_bytes(state: Dict[str, Any], tp: int) -> List[int]:
    """Bytes of one TP rank's share of each component of a state group kind (the per-rank slot
    layout tpu_sync computes, ``tpu_sync::layout::StateKv``)."""
    item = {"f32": 4, "bf16": 2, "f16": 2, "fp8": 1}
    rep = bool(state.get("replicated"))
    return [int(c.get("rows", 1)) * sum((int(sg["heads"]) if rep else _local_heads(int(sg["heads"]), int(tp)))
                                        * int(sg["head_elems"]) for sg in c["segments"]) * item[c["dtype"]]
            for c in state["components"]]


def sparse_mla_parts(layer_names: Sequence[str], indexers: Iterable[str], nope_layout: str = "sparsecore",
                     rope_layout: str = "sparsecore", indexer_layout: str = "head_along_sublane"
                     ) -> Tuple[Dict[str, Any], ...]:
    """:attr:`KvGeometry.mla_parts` of vLLM-TorchTPU's sparse MLA caches: ``layer_names`` the
    names vLLM registers caches under (sparse MLA layers and indexer K caches; sorted here by
    :func:`layer_order`), ``indexers`` those that are indexer caches. Each
    sparse layer gives two cache layers (nope, then rope), each indexer one.

    The indexer's ``seq_along_lane`` layout (:data:`SAL_INDEXER_LANES`) is moved in whole
    blocks (``lanes`` 132 bytes a token: ``bytes`` 132, its 3 padding bytes included).

    Raises:
        ValueError: an unknown layout; no sparse layer."""
    for what, v, ok in (("TPU_SPARSE_MLA_NOPE_LAYOUT", nope_layout, SPARSE_MLA_LAYOUTS),
                        ("TPU_SPARSE_MLA_ROPE_LAYOUT", rope_layout, SPARSE_MLA_LAYOUTS),
                        ("the indexer K cache layout", indexer_layout, ("head_along_sublane", "seq_along_lane"))):
        if v not in ok:
            raise ValueError(f"TpuSyncConnector: {what} {v!r} is not one of {', '.join(ok)}")
    idx = set(indexers)
    names = layer_order(list(layer_names))
    parts: Dict[str, List[int]] = {"nope": [], "rope": [], "indexer": []}
    layer = 0
    for n in names:
        if n in idx:
            parts["indexer"].append(layer)
            layer += 1
        else:
            parts["nope"].append(layer)
            parts["rope"].append(layer + 1)
            layer += 2
    if not parts["nope"]:
        raise ValueError("TpuSyncConnector: sparse MLA caches without a sparse MLA layer")
    layouts = {"nope": nope_layout, "rope": rope_layout, "indexer": indexer_layout}
    sizes = {name: (real, lanes) for name, real, lanes in SPARSE_MLA_CACHES}
    if indexer_layout == "seq_along_lane":
        sizes["indexer"] = (SAL_INDEXER_LANES, SAL_INDEXER_LANES)
    return tuple(dict(name=name, lanes=sizes[name][1], bytes=sizes[name][0], layout=layouts[name], layers=parts[name])
                 for name, _, _ in SPARSE_MLA_CACHES if parts[name])


def tpu_indexer_layout(block_size: int) -> str:
    """The layout vLLM-TorchTPU gives the DSA indexer's K cache (``head_along_sublane`` or
    ``seq_along_lane``), restating vllm-torchtpu 0.29.0 ``indexer_kv_layout``
    (``kernels/deepseek_v4/streamindex_topk/streamindex_topk.py``): ``VLLM_TPU_INDEXER_KV_CACHE_MODE``
    (default ``sal``; ``xla`` and ``has`` give ``head_along_sublane``); ``sal`` only with a
    block size that is a positive multiple of 128 and without Raiden GLM admission
    (``TPU_USE_RAIDEN_KV_CACHE_MANAGER=1`` and ``TPU_RAIDEN_GLM_ADMISSION=1``)."""
    import os

    mode = os.environ.get("VLLM_TPU_INDEXER_KV_CACHE_MODE", "sal").strip().lower()
    raiden = all(os.environ.get(k, "0").strip().lower() in ("1", "true")
                 for k in ("TPU_USE_RAIDEN_KV_CACHE_MANAGER", "TPU_RAIDEN_GLM_ADMISSION"))
    if mode == "sal" and not raiden and block_size >= 128 and block_size % 128 == 0:
        return "seq_along_lane"
    return "head_along_sublane"


def tpu_sparse_mla_parts(kv_cache_config: Any, block_size: int, latent_head: int = 576) -> Tuple[Dict[str, Any], ...]:
    """:func:`sparse_mla_parts` of a vLLM-TorchTPU engine from its ``KVCacheConfig``: its KV
    cache groups must be one group (vLLM 0.29 keeps the latent and indexer layers in one group
    of several page sizes, ``UniformTypeKVCacheSpecs``); indexer caches are the layers whose
    spec's ``head_size`` is not the latent's ``latent_head`` (the model's head size, 576 for
    DeepSeek-V3.2; ``DeepseekV32IndexerCache.get_kv_cache_spec`` gives its own, the key and
    its scale bytes), or, where the spec does not say, those named ``*.k_cache`` (vLLM's
    ``deepseek_v2.py`` names the indexer's cache ``<prefix>.k_cache``). The layouts come from
    ``TPU_SPARSE_MLA_NOPE_LAYOUT``, ``TPU_SPARSE_MLA_ROPE_LAYOUT`` and
    :func:`tpu_indexer_layout`, as the engine reads them.

    Raises:
        ValueError: no KV cache config, several groups, or what :func:`sparse_mla_parts` raises."""
    import os

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) != 1:
        raise ValueError(f"TpuSyncConnector: sparse MLA caches in {len(groups)} KV cache groups (the KV cache config "
                         "is needed, with one group for the latent and indexer layers, as vLLM 0.29 makes it)")
    grp = groups[0]
    per_layer = getattr(grp.kv_cache_spec, "kv_cache_specs", None) or {}
    indexers = []
    for n in grp.layer_names:
        head = getattr(per_layer.get(n), "head_size", None)
        if (int(head) != int(latent_head)) if head is not None else n.endswith(".k_cache"):
            indexers.append(n)
    env = os.environ
    return sparse_mla_parts(list(grp.layer_names), indexers,
                            env.get("TPU_SPARSE_MLA_NOPE_LAYOUT", "sparsecore").strip().lower(),
                            env.get("TPU_SPARSE_MLA_ROPE_LAYOUT", "sparsecore").strip().lower(),
                            tpu_indexer_layout(block_size))


def tpu_seq_along_lane(vllm_config: Any) -> bool:
    """Whether vLLM-TorchTPU allocates its KV caches in the batched ragged paged attention
    kernel's ``SEQ_ALONG_LANE`` layout (:data:`SAL_ORDER`): the attention backend is ``CUSTOM``
    (``PallasBatchedRPAAttentionBackend``) and the resolved KV cache layout is head-major
    (``LBHNC``/``BLHNC``, ``VLLM_KV_CACHE_LAYOUT=HND``). Source: vllm-torchtpu-core 0.29.0
    ``TpuPlatform`` (``platforms/tpu_platform.py``: the backend from
    ``attention_config.backend``, the layout resolved once and kept in the cache config) and
    ``PallasBatchedRPAAttentionBackend.get_kv_cache_shape`` (``KV_LAYOUT_BY_VLLM_LAYOUT``, both
    in ``layers/adapter/attention.py``). Where the cache config cannot resolve the layout (vLLM
    without ``get_resolved_kv_cache_layout``), ``VLLM_KV_CACHE_LAYOUT`` decides."""
    import os

    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if str(getattr(backend, "name", backend) or "").upper() != "CUSTOM":
        return False
    resolve = getattr(vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
    layout = None
    if resolve is not None:
        try:
            layout = resolve()
        except Exception:  # not resolved in this process
            layout = None
    if layout is not None:
        return str(getattr(layout, "name", layout)).upper() in ("LBHNC", "BLHNC")
    return os.environ.get("VLLM_KV_CACHE_LAYOUT", "").upper() == "HND"


def kv_geometry(vllm_config: Any, kv_cache_config: Any = None) -> KvGeometry:
    """The KV geometry of a vLLM engine from its ``VllmConfig`` and, for the KV cache groups of
    a hybrid model, its ``KVCacheConfig`` (see :func:`kv_groups`; None: uniform). Needs vLLM
    and torch.

    Raises:
        ValueError: a KV cache dtype tpu_sync cannot describe, or a KV cache group it cannot
        move.
    """
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    import torch
    from vllm.platforms import current_platform

    cache_dtype = cc.cache_dtype
    on_tpu = (getattr(current_platform, "device_type", "") or "") == "tpu"
    if cache_dtype in (None, "auto"):
        torch_dtype = mc.dtype
    elif on_tpu:
        # vLLM's own table stores fp8 as uint8 (CUDA's caches); the TPU backends allocate
        # float8_e4m3fn (vllm-torchtpu 0.29.0 TPU_STR_DTYPE_TO_TORCH_DTYPE,
        # layers/adapter/attention.py).
        torch_dtype = TPU_CACHE_DTYPES.get(str(cache_dtype).lower().strip())
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
    order = "lbhnc"
    if device == "cpu":
        fmt = cpu_block_format(torch_dtype, block_size, head_dim, cache_dtype or "auto")
    elif device == "tpu":
        # vllm-torchtpu's PallasAttentionBackend (and tpu-inference): ragged paged attention v3,
        # the head_dim-64 kernel when head_size == 64 (vllm_torchtpu/layers/adapter/attention.py);
        # its batched kernel (--attention-backend CUSTOM) in the SEQ_ALONG_LANE layout under
        # VLLM_KV_CACHE_LAYOUT=HND.
        order = "rpa3hd64" if head_dim == 64 else SAL_ORDER if tpu_seq_along_lane(vllm_config) else "rpa3"
        if getattr(mc, "use_mla", False):
            # tpu-inference's MLA kernel (kernels/mla/v2/kernel.py) pads the latent and the rope
            # part to 128 lanes each: the real elements are the first head_dim lanes of a token
            # only when the latent is a multiple of 128 (512 for DeepSeek-V2/V3, Kimi-K2).
            # vLLM-TorchTPU's dense MLA backend (PallasMLAttentionBackend, vllm-torchtpu 0.29.0
            # layers/adapter/attention.py) allocates its cache with the same kernel's
            # get_kv_cache_shape (kernels/mla/v2/kernel.py) and fills it through it.
            lora = getattr(getattr(mc, "hf_text_config", None), "kv_lora_rank", None)
            if lora is None or int(lora) % 128:
                raise ValueError(f"TpuSyncConnector: an MLA cache with kv_lora_rank {lora} (not a multiple of "
                                 "128) on a TPU: its rope part does not follow the latent; not mapped")
            # Tokens are packed K to a row: tpu-inference's K is MLA_KV_PACKING_SIZE
            # (tpu_inference/envs.py, 32 by default), vLLM-TorchTPU's the dtype's packing (32 /
            # bits). A block that is not a multiple of K holds padded token slots, which rpamla
            # does not map: refused where the caches are registered, which knows the engine
            # (tpu_sync.jax_kv.JaxKv for a JAX runner, WorkerSide.register_kv_caches for torch).
            order = MLA_ORDER
            if hasattr(getattr(mc, "hf_text_config", None), "index_topk"):
                # DeepSeek-V3.2 style (vLLM's deepseek_v2.py: is_v32 = hasattr(config,
                # "index_topk")): vLLM-TorchTPU gives each such layer a (nope, rope) pair of
                # fp8 caches and each indexer a K cache (docs/tpu.md, sparse MLA).
                if name != "torch.float8_e4m3fn":
                    raise ValueError(f"TpuSyncConnector: vLLM-TorchTPU's sparse MLA caches need --kv-cache-dtype fp8 "
                                     f"(its kernel takes fp8 only); the cache dtype is {name}")
                parts = tpu_sparse_mla_parts(kv_cache_config, block_size, head_dim)
                return KvGeometry(
                    model=str(mc.model), num_layers=sum(len(p["layers"]) for p in parts), num_kv_heads=1,
                    heads_per_rank=1, head_dim=head_dim, dtype="fp8", block_size=block_size,
                    tp=int(pc.tensor_parallel_size), block_format=f"vllm-tpu/{order}-sparse/fp8", use_mla=True,
                    groups=None, kv_order=order, mla_parts=parts)
        fmt = f"vllm-tpu/{order}/{name.replace('torch.', '')}"
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
        groups=kv_groups(kv_cache_config, block_size, tp, mamba_state_split(vllm_config)
                         if _has_state_group(kv_cache_config) else None) if kv_cache_config is not None else None,
        kv_order=order,
    )


def peers_from_params(params: Dict[str, Any]) -> Dict[int, str]:
    """The producer's endpoint address per TP rank, from ``kv_transfer_params``."""
    return {int(k): str(v) for k, v in (params.get("remote_addresses") or {}).items()}


#: ``kv_transfer_params`` of a request a router sends to the producer and the consumer at once
#: carry this key: a nonce (8 to 128 characters) that both sides turn into the same transfer id
#: (:func:`pair_xfer_id`), so the consumer can pull while the producer still computes.
PAIR_KEY = "tpu_sync_pair"
#: What a producer's params hold per request; :func:`pair_params` drops them from a template.
_PER_REQUEST = ("remote_request_id", "remote_block_ids", "remote_num_tokens", "remote_prompt_digest",
                "do_remote_decode", "tpu_sync_truncated", "remote_describe")


def pair_nonce(params: Optional[Dict[str, Any]]) -> Optional[str]:
    """The both-at-once nonce of ``params`` (:data:`PAIR_KEY`), or None when it has none or it
    is not a string of 8 to 128 characters."""
    v = (params or {}).get(PAIR_KEY)
    if isinstance(v, str) and 8 <= len(v) <= 128:
        return v
    return None


def pair_xfer_id(nonce: str, digest: str) -> int:
    """The transfer id of a both-at-once request: the producer registers and the consumer pulls
    it under the id derived from the router's ``nonce`` and the digest of the prompt tokens the
    producer prefills (:func:`prompt_digest`), 1 ..= 2**53 - 1. A consumer whose prompt
    differs from the producer's derives another id and never finds (or pulls) the producer's
    KV; the same nonce with the same prompt names the same KV."""
    h = hashlib.sha256(b"tpu-sync pair\0" + nonce.encode() + b"\0" + digest.encode()).digest()
    return int.from_bytes(h[:8], "little") % (2**53 - 1) + 1


def pair_params(template: Dict[str, Any], nonce: str) -> Dict[str, Any]:
    """The consumer's ``kv_transfer_params`` of a both-at-once request: a producer's earlier
    params (``template``: its addresses, geometry and block count) without their per-request
    fields, plus ``nonce``. The producer gets ``{"do_remote_decode": True, PAIR_KEY: nonce}``.

    Raises:
        ValueError: ``nonce`` is not 8 to 128 characters."""
    if pair_nonce({PAIR_KEY: nonce}) is None:
        raise ValueError("the both-at-once nonce must be a string of 8 to 128 characters")
    d = {k: v for k, v in template.items() if k not in _PER_REQUEST}
    d.update(do_remote_prefill=True, do_remote_decode=False)
    d[PAIR_KEY] = nonce
    return d


def check_pair_params(params: Dict[str, Any]) -> Optional[str]:
    """Why a consumer's both-at-once ``kv_transfer_params`` (:func:`pair_params`) are unusable,
    or None."""
    need = ("remote_addresses", "remote_geometry", "remote_num_blocks")
    missing = [k for k in need if params.get(k) in (None, "", [], {})]
    if missing:
        return f"kv_transfer_params lack {', '.join(missing)}"
    if params.get("tpu_sync_version") != PARAMS_VERSION:
        return f"kv_transfer_params version {params.get('tpu_sync_version')!r} (expected {PARAMS_VERSION})"
    if pair_nonce(params) is None:
        return f"bad {PAIR_KEY} (a string of 8 to 128 characters expected)"
    geom = params["remote_geometry"]
    addrs = params["remote_addresses"]
    if not isinstance(geom, dict) or not isinstance(addrs, dict):
        return "bad remote_geometry or remote_addresses (mappings expected)"
    try:
        bs = int(geom.get("block_size") or 0)
        nblocks = int(params["remote_num_blocks"])
        ranks = [int(k) for k in addrs]
    except (TypeError, ValueError):
        return "kv_transfer_params hold a non-integer block size, block count or TP rank"
    if bs <= 0 or nblocks <= 0 or any(r < 0 for r in ranks):
        return f"bad remote block size {bs}, block count {nblocks} or TP ranks {sorted(ranks)}"
    if geom.get("groups"):
        return "both-at-once transfers of models with KV cache groups are not supported"
    return None


def dp_scheduler_size(vllm_config: Any) -> int:
    """DP replicas that tpu-inference's DP scheduler splits the engine into, one vLLM scheduler
    each over ``num_blocks / DP`` blocks (``vllm_config.sharding_config.total_dp_size``, set by
    its platform; tpu-inference 0.32.0 ``core/sched/dp_scheduler.py``
    ``update_vllm_config_for_dp_scheduler`` installs that scheduler whenever it exceeds 1); 1
    on every other engine."""
    sc = getattr(vllm_config, "sharding_config", None)
    try:
        return max(1, int(getattr(sc, "total_dp_size", 1) or 1))
    except (TypeError, ValueError):
        return 1


def check_params(params: Dict[str, Any]) -> Optional[str]:
    """Why ``kv_transfer_params`` of a producer are unusable, or None."""
    need = ("remote_request_id", "remote_addresses", "remote_block_ids", "remote_num_tokens", "remote_geometry",
            "remote_num_blocks")
    described = params.get("remote_describe") is True
    missing = [k for k in need if params.get(k) in (None, "", [], {}) and not (described and k == "remote_block_ids")]
    if missing:
        return f"kv_transfer_params lack {', '.join(missing)}"
    if params.get("tpu_sync_version") != PARAMS_VERSION:
        return f"kv_transfer_params version {params.get('tpu_sync_version')!r} (expected {PARAMS_VERSION})"
    geom = params["remote_geometry"]
    if not isinstance(geom, dict):
        return f"remote_geometry is a {type(geom).__name__}, not a mapping"
    addrs = params["remote_addresses"]
    if not isinstance(addrs, dict):
        return f"remote_addresses is a {type(addrs).__name__}, not a mapping of TP rank to address"
    groups = geom.get("groups")
    try:
        rid = int(params["remote_request_id"])
        n = int(params["remote_num_tokens"])
        nblocks = int(params["remote_num_blocks"])
        ranks = [int(k) for k in addrs]
        bs = int(geom.get("block_size") or 0)
        if groups:
            gids = [[int(b) for b in ids] for ids in params.get("remote_block_ids") or []]
        else:
            ids: List[int] = [int(b) for b in params.get("remote_block_ids") or []]
    except (TypeError, ValueError):
        return ("kv_transfer_params hold non-integer ids, counts or ranks"
                + (" (one list per KV cache group expected)" if groups else ""))
    if not 1 <= rid < 2**53 or n <= 0 or nblocks <= 0:
        return f"bad remote_request_id {rid}, remote_num_tokens {n} or remote_num_blocks {nblocks}"
    if any(r < 0 for r in ranks):
        return f"negative TP ranks in remote_addresses: {sorted(ranks)}"
    if bs <= 0:
        return f"bad remote block size {bs}"
    if described:
        # A producer whose scheduler cannot name its blocks (tpu-inference's DP scheduler: a
        # rank's scheduler does not know its rank's offset): the consumer asks the producer's
        # endpoint for the placement it registered (with KV cache groups, each group's held
        # blocks; the consumer's plan checks them against the producer's groups).
        if groups:
            try:
                KvGeometry(**{k: geom[k] for k in KvGeometry.__dataclass_fields__ if k in geom})
            except TypeError as e:
                return f"bad remote_geometry: {e}"
        if params.get("remote_block_ids"):
            return "kv_transfer_params both describe and list the remote blocks"
        return None
    if groups:
        try:
            g = KvGeometry(**{k: geom[k] for k in KvGeometry.__dataclass_fields__ if k in geom})
        except TypeError as e:
            return f"bad remote_geometry: {e}"
        if len(gids) != g.num_groups:
            return f"{len(gids)} lists of remote block ids for {g.num_groups} KV cache groups"
        for i, ids in enumerate(gids):
            first, end = g.held_blocks(i, n)
            if len(ids) != end - first:
                return f"KV cache group {i}: {len(ids)} remote blocks, {n} tokens need {end - first}"
        return None
    if len(ids) != -(-n // bs):
        return f"{len(ids)} remote blocks for {n} tokens at block size {bs}"
    return None
