"""Real SGLang host KV pools (``sglang.srt.mem_cache.pool_host``) of every layout, built on CPU
with ``pin_memory=False``, over real device buffers (``MHABufferInfo`` / ``MLABufferInfo``),
filled with non-repeating data."""

import torch

from sglang.srt.mem_cache import device_pool_info as dpi
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

LAYERS, HEADS, DIM, PAGE, DEVICE_TOKENS = 2, 2, 32, 16, 256
LORA, ROPE = 64, 32
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")


def pattern(shape, seed, dtype=torch.float32):
    """Non-repeating, non-zero data (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=torch.float32) + 0.5).to(dtype)


def mha_device(seed=1, dtype=torch.float32):
    k = tuple(pattern((DEVICE_TOKENS + PAGE, HEADS, DIM), seed + i, dtype) for i in range(LAYERS))
    v = tuple(pattern((DEVICE_TOKENS + PAGE, HEADS, DIM), seed + 100 + i, dtype) for i in range(LAYERS))
    return k, v


def mha_pool(layout, seed=1, dtype=torch.float32, device=None):
    k, v = device or mha_device(seed, dtype)
    info = dpi.MHABufferInfo(
        buffers=dpi.KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                              v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
                              layout=dpi.KVBufferLayout.NHD),
        page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM, dtype=dtype, device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=DEVICE_TOKENS,
                                start_layer=0, end_layer=LAYERS)


def mla_pool(layout, seed=1, dtype=torch.float32):
    if layout == "page_first_kv_split":
        bufs = dpi.MLASplitBuffers(k=pattern((LAYERS, DEVICE_TOKENS + PAGE, 1, LORA), seed, dtype),
                                   v=pattern((LAYERS, DEVICE_TOKENS + PAGE, 1, ROPE), seed + 1, dtype),
                                   index_k=None, index_scales=None, index_layer_indices=(), k_width=LORA,
                                   v_width=ROPE, index_width=0)
        ptrs = None
    else:
        bufs = tuple(pattern((DEVICE_TOKENS + PAGE, 1, LORA + ROPE), seed + i, dtype) for i in range(LAYERS))
        ptrs = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64)
    info = dpi.MLABufferInfo(buffers=bufs, data_ptrs=ptrs, layer_indices=tuple(range(LAYERS)),
                             device_layer_num=LAYERS, page_size=PAGE, kv_lora_rank=LORA, qk_rope_head_dim=ROPE,
                             kv_cache_dim=LORA + ROPE, dtype=dtype, device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=DEVICE_TOKENS,
                                start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)


def fill(pool, seed=7):
    """Fills every buffer holding the pool's pages with pattern data."""
    from tpu_sync.sglang import pages

    for i, b in enumerate(pages.base_tensors(pool)):
        b.copy_(pattern(tuple(b.shape), seed + i, b.dtype))


def page_bytes_of(pool, index):
    """The bytes of one page, read through SGLang's own ``get_page_buffer_meta`` pointers."""
    import ctypes

    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(index, index + PAGE))
    return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))
