"""KV layouts, placements and reshard plans (pure computations in the native library)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _check as ck
from ._lib import Handle, check, json_out
from ._native import ffi, lib


def _native_preset(name: str) -> Dict[str, Any]:
    return json_out(lib.tpu_sync_model_preset, name.encode())


#: Names :func:`preset` accepts, from the native library (``tpu_sync_model_presets``): the
#: uniform presets, then the hybrid ones (KV cache groups).
PRESET_NAMES: Tuple[str, ...] = tuple(json_out(lib.tpu_sync_model_presets))

#: KV geometry of the uniform published models, from the native library
#: (``tpu_sync::layout::ModelKv::preset``), without name and dtype.
PRESETS: Dict[str, Dict[str, Any]] = {
    n: {k: v for k, v in m.items() if k not in ("name", "dtype")}
    for n, m in ((n, _native_preset(n)) for n in PRESET_NAMES) if "groups" not in m
}

#: Names of the hybrid presets (``tpu_sync::layout::HybridModel::preset``; docs/hybrid.md).
HYBRID_PRESETS: Tuple[str, ...] = tuple(n for n in PRESET_NAMES if n not in PRESETS)


def model(name: str = "custom", *, num_layers: int, num_kv_heads: int, head_dim: int,
          kv_planes: int = 2, dtype: str = "bf16") -> Dict[str, Any]:
    """A model's KV geometry as the native library's JSON form (values are checked when used:
    zero sizes and unknown dtypes are refused by the native library)."""
    return dict(name=ck.text("name", name), num_layers=ck.u32("num_layers", num_layers),
                num_kv_heads=ck.u32("num_kv_heads", num_kv_heads), head_dim=ck.u32("head_dim", head_dim),
                kv_planes=ck.u32("kv_planes", kv_planes), dtype=ck.text("dtype", dtype))


def preset(name: str, dtype: Optional[str] = None) -> Dict[str, Any]:
    """A published model's KV geometry, from the native library (``tpu_sync_model_preset``; the
    numbers and the configs they come from are documented there). A uniform preset
    (:data:`PRESETS`) is a :func:`model` dict, in ``dtype`` (default bf16); a hybrid preset
    (:data:`HYBRID_PRESETS`: qwen3-next-80b, qwen3.5-9b, gpt-oss-120b, gemma-3-27b, deepseek-v3.2,
    deepseek-v3.2-tpu)
    is a :func:`hybrid_model` dict with each group's own dtype, so ``dtype`` must be left out.
    Either goes to :func:`layout`.

    Raises: InvalidArgumentError for an unknown name or a dtype given for a hybrid preset."""
    if not isinstance(name, str) or name not in PRESET_NAMES:
        raise ck.fail(f"unknown preset {ck._short(name)} (known: {', '.join(PRESET_NAMES)})")
    if name in PRESETS:
        return model(name, dtype="bf16" if dtype is None else dtype, **PRESETS[name])
    if dtype is not None:
        raise ck.fail(f"preset {name} is hybrid: each KV cache group has its own dtype, so dtype "
                      f"cannot be given (got {ck._short(dtype)})")
    return _native_preset(name)


def hybrid_model(name: str, groups: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """A hybrid model's KV cache groups (``tpu_sync::layout::HybridModel``'s JSON form): each
    group a dict ``{"name", "layers": [cache layers], "kind": {"type": "attention" | "mla" |
    "indexer" | "state", ...}}`` as docs/hybrid.md describes (values are checked by the native
    library when used). Pass it to :func:`layout` instead of a :func:`model`."""
    gs = ck.items("groups", groups)
    for i, g in enumerate(gs):
        if not isinstance(g, dict) or "layers" not in g or "kind" not in g:
            raise ck.fail(f"groups[{i}] must be a dict with name, layers and kind, got {ck._short(g)}")
    return dict(name=ck.text("name", name), groups=list(gs))


def layout(model: Dict[str, Any], *, tp: int = 1, pcp: int = 1, dp: int = 1, block_size: int = 16,
           order: str = "nhd", num_blocks: Any) -> Dict[str, Any]:
    """How one serving instance splits the KV cache: TP over KV heads, PCP over tokens (block
    chunks), DP replicas; ``num_blocks`` blocks of ``block_size`` tokens per rank; block order
    ``nhd`` (token-major) or ``hnd`` (head-major).

    With a :func:`hybrid_model` (KV cache groups) the result is the groups form
    (``tpu_sync::layout::HybridLayout``): ``num_blocks`` is one count for every group, or a list
    with one entry per group, each a count (blocks, or slots for a state group) or a dict of the
    group's layout (``{"num_blocks": n, "block_size": ..., "order": ..., "slot_bytes": ...}``)."""
    if not isinstance(model, dict):
        raise ck.fail(f"model must be a dict (tpu_sync.model(...)), got {type(model).__name__}")
    spec = dict(tp=ck.u32("tp", tp), pcp=ck.u32("pcp", pcp), dp=ck.u32("dp", dp),
                block_size=ck.u32("block_size", block_size), order=ck.text("order", order))
    if "groups" in model:
        n = len(model["groups"])
        per = list(ck.items("num_blocks", num_blocks)) if isinstance(num_blocks, (list, tuple)) else [num_blocks] * n
        if len(per) != n:
            raise ck.fail(f"num_blocks lists {len(per)} groups, the model has {n}")
        groups = [dict(g) if isinstance(g, dict) else dict(num_blocks=ck.u32(f"num_blocks[{i}]", g))
                  for i, g in enumerate(per)]
        return dict(model=model, spec=spec, groups=groups)
    return dict(model=model, spec=spec, num_blocks=ck.u32("num_blocks", num_blocks))


def placement(layout: Dict[str, Any], block_ids: Sequence[Sequence[int]], dp_rank: int = 0,
              first_token: int = 0, next_token: Optional[int] = None) -> Dict[str, Any]:
    """Where a request's blocks are: for each rank of DP replica ``dp_rank`` (index
    ``pcp * tp + tp_rank``), the device block ids of its request blocks, in order. For a layout
    with KV cache groups, ``block_ids[group][rank]``: a sliding-window group lists only its
    window's blocks, a state group one slot id (docs/hybrid.md); every buffer is then checked
    against its own group's geometry.

    ``first_token`` (tokens, a multiple of the block size, below the request's token count):
    the placement holds the request from that token on. A pull's destination with
    ``first_token = k * block_size`` already has tokens ``[0, first_token)`` (a local
    prefix-cache hit) and receives only the rest; its ``block_ids`` then list the request
    blocks from ``k`` on (of each rank's PCP chunk). With KV cache groups it must be a multiple
    of every paged group's block size; each paged group lists its held blocks (a sliding
    window's) from that token on, a state group its one slot (the state moves whole). Checked
    when planned (InvalidArgumentError: unaligned or past the request; BlockRangeError: a
    wrong number of ids).

    ``next_token`` (layouts with KV cache groups; tokens): the first token a pull's destination
    computes after it (None: the request's next token). A sliding-window group of ``w`` tokens
    then needs ``[next_token + 1 - w, num_tokens)`` and lists the blocks of those tokens (vLLM
    recomputes the last prompt token after loading the whole prompt: ``num_tokens - 1``); a
    plan from a source whose blocks do not hold them is a MismatchError."""
    if not isinstance(layout, dict):
        raise ck.fail(f"layout must be a dict (tpu_sync.layout(...)), got {type(layout).__name__}")
    first = ck.u32("first_token", first_token)
    if "groups" in layout:
        # Groups form: block_ids[group][rank] (one slot id per rank for a state group).
        gids = [[[ck.u32(f"block_ids[{g}][{i}][{j}]", b) for j, b in enumerate(ck.items(f"block_ids[{g}][{i}]", r))]
                 for i, r in enumerate(ck.items(f"block_ids[{g}]", per))]
                for g, per in enumerate(ck.items("block_ids", block_ids))]
        gout = dict(layout=layout, dp_rank=ck.u32("dp_rank", dp_rank), block_ids=gids)
        if first:
            gout["first_token"] = first
        if next_token is not None:
            gout["next_token"] = ck.u32("next_token", next_token)
        return gout
    ids = [[ck.u32(f"block_ids[{i}][{j}]", b) for j, b in enumerate(ck.items(f"block_ids[{i}]", r))]
           for i, r in enumerate(ck.items("block_ids", block_ids))]
    out = dict(layout=layout, dp_rank=ck.u32("dp_rank", dp_rank), block_ids=ids)
    if first:
        out["first_token"] = first
    return out


@dataclass(frozen=True)
class Span:
    """``count`` runs of ``len`` bytes from (src_rank, src_buffer, src_offset + i*src_stride) to
    (dst_rank, dst_buffer, dst_offset + i*dst_stride); buffer = layer index."""

    src_rank: int
    src_buffer: int
    src_offset: int
    dst_rank: int
    dst_buffer: int
    dst_offset: int
    len: int
    count: int
    src_stride: int
    dst_stride: int


class Plan(Handle):
    """The reshard plan of one request between two placements. Immutable, thread-safe.

    Raises:
        LayoutError, BlockRangeError, MismatchError, InvalidArgumentError.
    """

    _free = lib.tpu_sync_plan_free

    def __init__(self, src: Dict[str, Any], dst: Dict[str, Any], num_tokens: int) -> None:
        self._ptr = None
        s, d = ck.json_text("src", src), ck.json_text("dst", dst)
        n = ck.u32("num_tokens", num_tokens)
        out = ffi.new("tpu_sync_plan **")
        check(lib.tpu_sync_plan_new(s, d, n, out))
        super().__init__(out[0])

    def _summary(self):
        b, n = ffi.new("uint64_t *"), ffi.new("size_t *")
        check(lib.tpu_sync_plan_summary(self._handle(), b, n))
        return int(b[0]), int(n[0])

    @property
    def total_bytes(self) -> int:
        """Bytes the plan moves."""
        return self._summary()[0]

    @property
    def num_spans(self) -> int:
        """Number of spans."""
        return self._summary()[1]

    def spans(self) -> List[Span]:
        """All spans, ordered by (destination rank, layer, destination offset)."""
        n = self.num_spans
        arr = ffi.new("tpu_sync_span[]", max(n, 1))
        got = ffi.new("size_t *")
        check(lib.tpu_sync_plan_spans(self._handle(), 0, arr, n, got))
        return [Span(s.src_rank, s.src_buffer, s.src_offset, s.dst_rank, s.dst_buffer, s.dst_offset,
                     s.len, s.count, s.src_stride, s.dst_stride) for s in arr[0:got[0]]]
