"""SGLang's device KV pool as tpu_sync sees it (internal; used by the linker and the P/D backend).

SGLang's full-attention device pools keep one tensor per layer and plane:
``MHATokenToKVPool.k_buffer[l]`` / ``v_buffer[l]`` of shape ``[slots, heads, head_dim]`` and
``MLATokenToKVPool.kv_buffer[l]`` of shape ``[slots, 1, kv_cache_dim]``
(``sglang/srt/mem_cache/memory_pool.py``), where ``slots = size + page_size`` and token slot
``t`` is row ``t`` (page ``t // page_size``; page 0 is SGLang's padding page). So one page of one
layer and plane is ``page_size`` consecutive rows: ``page_size * heads * head_dim`` elements at
byte offset ``page * page_bytes``.

:class:`DevicePool` checks that a pool has this shape (token-major ``nhd`` rows, contiguous,
unpadded, no scale buffers) and gives its buffers in *plane-major* order ``[K_0 .. K_{L-1},
V_0 .. V_{L-1}]`` (MLA: ``[KV_0 .. KV_{L-1}]``), as raw byte views for the host tier and the raw
copies, or as typed ``[pages, page_size, heads, head_dim]`` views for the network endpoint.
"""

from __future__ import annotations

from typing import Any, List

from ._views import flat_bytes, shared_client, view_of

#: torch dtype name -> (tpu_sync layout dtype, tpu_sync buffer dtype).
_DTYPES = {
    "bfloat16": ("bf16", "bf16"),
    "float16": ("f16", "f16"),
    "float32": ("f32", "f32"),
    "float8_e4m3fn": ("fp8", "f8e4m3fn"),
}


class UnsupportedPoolError(ValueError):
    """A device KV pool whose memory tpu_sync cannot address page by page."""


class DevicePool:
    """Geometry and buffers of one SGLang full-attention device KV pool.

    Attributes:
        pool: the SGLang pool.
        mla: one latent plane (MLA) instead of K and V.
        planes: 2 (K, V) or 1 (MLA).
        layers: layers of the pool (``layer_num``).
        heads, head_dim: per row (MLA: 1 and ``kv_cache_dim``).
        page_size: tokens per page.
        num_pages: pages per buffer (``slots // page_size``).
        row_bytes: bytes of one token row of one layer and plane.
        page_bytes: bytes of one page of one layer and plane (``page_size * row_bytes``).
        layout_dtype, buffer_dtype: tpu_sync dtype names (``"bf16"``/``"bf16"``,
            ``"fp8"``/``"f8e4m3fn"``, ...).

    Raises:
        UnsupportedPoolError: a pool of another kind (hybrid, scaled KV, ``hnd`` or vectorized
            layouts, padded or strided rows, K and V of different head sizes).
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        layout = getattr(pool, "kv_cache_layout", None)
        if layout not in (None, "nhd"):
            raise UnsupportedPoolError(f"tpu_sync: device KV layout {layout!r} is not handled (only token-major nhd)")
        if getattr(pool, "k_scale_buffer", None) is not None or getattr(pool, "native_k_scale_buffer", None) is not None:
            raise UnsupportedPoolError("tpu_sync: scaled KV caches (per-block scales) are not handled")
        if getattr(pool, "k_buffer", None) is not None and getattr(pool, "v_buffer", None) is not None:
            planes = [list(pool.k_buffer), list(pool.v_buffer)]
            self.mla = False
            if int(getattr(pool, "v_head_dim", pool.head_dim)) != int(pool.head_dim):
                raise UnsupportedPoolError("tpu_sync: K and V head sizes differ")
        elif getattr(pool, "kv_buffer", None) is not None and not hasattr(pool, "full_kv_pool"):
            planes = [list(pool.kv_buffer)]
            self.mla = True
        else:
            raise UnsupportedPoolError(f"tpu_sync: {type(pool).__name__} is not a full-attention MHA or MLA pool")
        if not planes[0]:
            raise UnsupportedPoolError("tpu_sync: the device KV pool has no layers")
        first = planes[0][0]
        for plane in planes:
            if len(plane) != len(planes[0]):
                raise UnsupportedPoolError("tpu_sync: K and V have different layer counts")
            for t in plane:
                if t.dim() != 3 or tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
                    raise UnsupportedPoolError(
                        f"tpu_sync: device KV buffers must all be [slots, heads, head_dim] of one dtype, got "
                        f"{tuple(t.shape)} {t.dtype} and {tuple(first.shape)} {first.dtype}")
                if not t.is_contiguous():
                    raise UnsupportedPoolError("tpu_sync: device KV buffers must be contiguous (no padded rows)")
        name = str(first.dtype).replace("torch.", "")
        if name not in _DTYPES:
            raise UnsupportedPoolError(f"tpu_sync: KV dtype {first.dtype} is not handled")
        self.layout_dtype, self.buffer_dtype = _DTYPES[name]
        self.planes = len(planes)
        self.layers = len(planes[0])
        self.heads, self.head_dim = int(first.shape[1]), int(first.shape[2])
        self.page_size = int(pool.page_size)
        self.num_pages = int(first.shape[0]) // self.page_size
        self.row_bytes = self.heads * self.head_dim * int(first.element_size())
        self.page_bytes = self.page_size * self.row_bytes
        self._tensors = [t for plane in planes for t in plane]
        self._raw: List[Any] = []
        self._typed: List[Any] = []

    @property
    def tensors(self) -> List[Any]:
        """The buffers, plane-major (``[K_0 .. K_{L-1}, V_0 .. V_{L-1}]``)."""
        return list(self._tensors)

    def tensor(self, plane: int, layer: int) -> Any:
        return self._tensors[plane * self.layers + layer]

    def raw_views(self) -> List[Any]:
        """Zero-copy ``u8`` views of every buffer, plane-major (for the host tier and raw copies)."""
        if not self._raw:
            self._raw = [view_of(t) for t in self._tensors]
        return list(self._raw)

    def raw_view(self, plane: int, layer: int) -> Any:
        return self.raw_views()[plane * self.layers + layer]

    def typed_views(self) -> List[Any]:
        """Zero-copy views ``[num_pages, page_size, heads, head_dim]`` of the KV dtype, plane-major:
        exactly the per-layer buffer of a tpu_sync layout with ``kv_planes=1`` and ``2 * layers``
        (MLA: ``layers``) layers, order ``nhd`` (for :class:`tpu_sync.Endpoint`)."""
        if not self._typed:
            client = shared_client()
            rows = self.num_pages * self.page_size
            self._typed = [
                client.view(flat_bytes(t)[: rows * self.row_bytes], shape=[self.num_pages, self.page_size, self.heads,
                                                                           self.head_dim], dtype=self.buffer_dtype)
                for t in self._tensors
            ]
        return list(self._typed)

    def page_offset(self, page: int) -> int:
        """Byte offset of ``page`` in every buffer."""
        return int(page) * self.page_bytes


def pages_of_slots(slots: Any, page_size: int) -> List[int]:
    """Page ids of token slots that are whole, aligned pages (``len(slots)`` a multiple of
    ``page_size``; each page's slots consecutive from a multiple of ``page_size``).

    Raises:
        ValueError: slots that are not whole aligned pages.
    """
    import torch

    t = torch.as_tensor(slots).detach().to(device="cpu", dtype=torch.int64).reshape(-1)
    if t.numel() % page_size:
        raise ValueError(f"tpu_sync: {t.numel()} token slots are not whole pages of {page_size}")
    if t.numel() == 0:
        return []
    p = t.reshape(-1, page_size)
    starts = p[:, 0]
    if bool(torch.any(starts % page_size)) or not torch.equal(p, starts[:, None] + torch.arange(page_size)):
        raise ValueError("tpu_sync: token slots are not aligned contiguous pages")
    return (starts // page_size).tolist()
