"""Where one SGLang HiCache page lives in a host KV pool, as byte ranges (no SGLang import).

A host tier entry is one page in SGLang's own *flat page* format: the bytes of
``host_pool.get_data_page(index, flat=True)`` (``sglang/srt/mem_cache/pool_host/mha.py`` and
``mla.py``), i.e. the sub-tensor ``kv_buffer[<page slice>]`` read in row-major order:

=====================  ===========================================  ==============================
layout                 MHA ``kv_buffer`` / page slice               runs per page
=====================  ===========================================  ==============================
``layer_first``        ``[2, L, size, H, D]`` / ``[:, :, t:t+P]``    ``2 * L`` (K then V, by layer)
``page_first``         ``[2, size, L, H, D]`` / ``[:, t:t+P]``       2 (K, V)
``page_first_direct``  ``[2, pages, L, P, H, D]`` / ``[:, p:p+1]``   2
``page_head``          ``[2, pages, H, P, L, D]`` / ``[:, p:p+1]``   2
=====================  ===========================================  ==============================

MLA pools have no leading K/V dimension (``[L, size, 1, D]``, ``[size, L, 1, D]``,
``[pages, L, P, 1, D]``): ``L`` runs or one. The same entry is therefore produced by SGLang's
generic path (``get_data_page`` + ``set_from_flat_data_page``) and by the zero-copy ``v1`` path
(these byte ranges, copied straight between the pool and the tier), so the two interoperate.
The entry's meaning depends on the layout, dtype and geometry, which are all part of the tier's
namespace (:func:`tpu_sync.sglang.storage.namespace_of`).
"""

from __future__ import annotations

from typing import Any, List, Tuple

Run = Tuple[int, int]


def contiguous_runs(t: Any, base: Any) -> List[Run]:
    """``(byte offset into base's storage, bytes)`` of the maximal contiguous pieces of tensor
    ``t`` in row-major order (adjacent pieces are merged)."""
    out: List[Run] = []
    _runs(t, int(base.data_ptr()), out)
    merged: List[Run] = []
    for off, n in out:
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((off, n))
    return merged


def _runs(t: Any, base_ptr: int, out: List[Run]) -> None:
    if t.numel() == 0:
        return
    if t.is_contiguous():
        out.append((int(t.data_ptr()) - base_ptr, int(t.numel()) * int(t.element_size())))
        return
    for i in range(int(t.shape[0])):
        _runs(t[i], base_ptr, out)


#: The split buffers of an MLA ``page_first_kv_split`` pool, in entry order (SGLang's
#: ``get_page_buffer_meta`` order: latent K, RoPE V, indexer K, indexer scales).
KV_SPLIT_BUFFERS = ("k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer")


def base_tensors(pool: Any) -> List[Any]:
    """The tensors holding ``pool``'s pages: ``[kv_buffer]``, or the split buffers of
    ``page_first_kv_split`` (each ``[pages, layers, page_size, 1, width]``)."""
    if getattr(pool, "layout", None) == "page_first_kv_split":
        return [getattr(pool, n) for n in KV_SPLIT_BUFFERS if getattr(pool, n, None) is not None]
    return [pool.kv_buffer]


def has_page_buffer(pool: Any) -> bool:
    """Whether the pool keeps its pages in contiguous buffers addressable by byte ranges (the
    MHA and MLA host pools in every layout above); other pools go through SGLang's copy
    helpers (``get_data_page`` / ``set_from_flat_data_page``)."""
    layout = getattr(pool, "layout", None)
    if layout not in ("layer_first", "page_first", "page_first_direct", "page_head", "page_first_kv_split"):
        return False
    try:
        bases = base_tensors(pool)
    except AttributeError:
        return False
    return bool(bases) and all(hasattr(b, "is_contiguous") and b.is_contiguous() for b in bases)


def page_pieces(pool: Any, index: int) -> List[Tuple[int, int, int]]:
    """``(base tensor number, byte offset, bytes)`` of the page whose first token slot is host
    index ``index``, in entry order (base tensors as :func:`base_tensors`)."""
    if getattr(pool, "layout", None) == "page_first_kv_split":
        page = int(index) // int(pool.page_size)
        out = []
        for i, b in enumerate(base_tensors(pool)):
            out.extend((i, off, n) for off, n in contiguous_runs(b[page:page + 1], b))
        return out
    return [(0, off, n) for off, n in contiguous_runs(pool.get_data_page(int(index), flat=False), pool.kv_buffer)]


def page_runs(pool: Any, index: int) -> List[Run]:
    """Byte ranges of the page whose first token slot is host index ``index`` inside
    ``pool.kv_buffer``, in flat page order (single-buffer layouts)."""
    return contiguous_runs(pool.get_data_page(int(index), flat=False), pool.kv_buffer)


def page_bytes(pool: Any) -> int:
    """Bytes of one page of ``pool`` (one tier entry)."""
    if getattr(pool, "layout", None) == "page_first_kv_split":
        return sum(n for _, _, n in page_pieces(pool, 0))
    d = pool.get_dummy_flat_data_page()
    return int(d.numel()) * int(d.element_size())
