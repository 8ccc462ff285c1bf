"""The tpu_sync HiCache I/O backend against SGLang's real host pools of every layout (no engine):
device -> host backup of every layer and host -> device per-layer loads, byte-exact against the
layouts' definitions and, where SGLang's own ``direct`` backend exists on CPU (``layer_first``,
``page_first_direct``), identical to it; the library's copy counters move."""

import pytest
import torch

import pools
from pools import LAYERS, PAGE
from tpu_sync.sglang import io


def host_row(pool, plane, layer, t):
    """The host copy of token slot ``t`` of one layer (heads x dim), by the layout's definition."""
    kv = pool.kv_buffer if plane is None else pool.kv_buffer[plane]
    P = pool.page_size
    return {
        "layer_first": lambda: kv[layer, t],
        "page_first": lambda: kv[t, layer],
        "page_first_direct": lambda: kv[t // P, layer, t % P],
        "page_head": lambda: kv[t // P, :, t % P, layer],
    }[pool.layout]()


def device_planes(pool):
    if hasattr(pool, "device_k_buffers"):
        return [(0, pool.device_k_buffers), (1, pool.device_v_buffers)]
    return [(None, pool.device_kv_buffers)]


CASES = [("mha", l) for l in pools.MHA_LAYOUTS] + [("mla", l) for l in ("layer_first", "page_first",
                                                                         "page_first_direct")]


@pytest.mark.parametrize("kind,layout", CASES)
def test_backup_and_per_layer_load_round_trip(kind, layout):
    pool = pools.mha_pool(layout, 3) if kind == "mha" else pools.mla_pool(layout, 3)
    assert io.supports(pool)
    before = dict(io.COUNTERS)
    hi = pool.alloc(3 * PAGE)
    # device pages 5, 2, 9 (out of order, as a radix cache hands them out)
    di = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (5, 2, 9)])
    io.backup_all_layers(pool, hi, di)
    for plane, bufs in device_planes(pool):
        for layer in range(LAYERS):
            for h, d in zip(hi.tolist(), di.tolist()):
                assert torch.equal(host_row(pool, plane, layer, h).reshape(-1), bufs[layer][d].reshape(-1))
    # load back, layer by layer, into other device pages; each layer has landed when its call returns
    dst = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (11, 12, 1)])
    for _, bufs in device_planes(pool):
        for b in bufs:
            b[dst] = 0
    for layer in range(LAYERS):
        io.load_layer(pool, hi, dst, layer)
        for _, bufs in device_planes(pool):
            assert torch.equal(bufs[layer][dst], bufs[layer][di])
    assert io.COUNTERS["backup_calls"] == before["backup_calls"] + 1
    assert io.COUNTERS["load_layers"] == before["load_layers"] + LAYERS
    row = pool.get_size_per_token() // LAYERS
    assert io.COUNTERS["backup_bytes"] - before["backup_bytes"] == 3 * PAGE * LAYERS * row
    assert io.COUNTERS["load_bytes"] - before["load_bytes"] == 3 * PAGE * LAYERS * row


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_same_bytes_as_sglang_direct_backend(layout):
    device = pools.mha_device(5)
    ours, theirs = pools.mha_pool(layout, device=device), pools.mha_pool(layout, device=device)
    hi = ours.alloc(2 * PAGE)
    assert torch.equal(hi, theirs.alloc(2 * PAGE))
    di = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (7, 3)])
    io.backup_all_layers(ours, hi, di)
    theirs.backup_from_device_all_layer(None, hi, di, "direct")  # SGLang's direct path (shim ops on CPU)
    assert torch.equal(ours.kv_buffer, theirs.kv_buffer)


def test_pacing_counters_show_the_copies():
    import tpu_sync

    pool = pools.mha_pool("page_first_direct", 8)
    hi = pool.alloc(4 * PAGE)
    p0 = tpu_sync.pacing()
    io.backup_all_layers(pool, hi, torch.arange(4 * PAGE))
    p1 = tpu_sync.pacing()
    assert p1["batches"] > p0["batches"] and p1["bytes"] - p0["bytes"] == 4 * PAGE * pool.get_size_per_token()
