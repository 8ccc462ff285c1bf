"""``TpuSyncLinker`` against SGLang's real device KV pool (``MHATokenToKVPool`` on CPU) and its
real ``LayerWiseLoadCounter``, without an engine: offload -> lookup -> layer-wise load round
trips byte-exact, a warm restart through ``/dev/shm``, a corrupted page cut from the hit,
cancel, reset, close, and the refusals (hybrid components, bad config, wrong slots)."""

import mmap
import os
import time
import types

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from pools import pattern
from tpu_sync.sglang import linker as lk

PAGE, LAYERS, HEADS, DIM, TOKENS = 16, 2, 2, 32, 256
ENTRY = 2 * LAYERS * PAGE * HEADS * DIM * 4


def device_pool(seed=1):
    pool = MHATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.float32, head_num=HEADS, head_dim=DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    for i, t in enumerate(list(pool.k_buffer) + list(pool.v_buffer)):
        t.copy_(pattern(tuple(t.shape), seed + i))
    return pool


def make(pool, shm=None, components=(ComponentType.FULL,), **extra):
    params = types.SimpleNamespace(page_size=PAGE, token_to_kv_pool_allocator=types.SimpleNamespace(
        get_kvcache=lambda: pool), tp_cache_group=None, attn_tp_cache_group=None, pp_rank=0, pp_size=1)
    server_args = types.SimpleNamespace(model_path="tiny-test", tp_size=2)
    cfg = dict(extra, host_capacity_bytes=64 << 20)
    if shm:
        cfg["shm_name"] = shm
    return lk.TpuSyncLinker(server_args, params, components=set(components), extra_config=cfg, forward_stream=None)


def slots(*pages):
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def keys(n, tag="a"):
    return [f"{tag}{i:062d}" for i in range(n)]


def page_of(pool, plane, layer, page):
    t = (pool.k_buffer if plane == 0 else pool.v_buffer)[layer]
    return t[page * PAGE:(page + 1) * PAGE].clone()


def offload(linker, hashes, pages):
    assert linker.offload([PoolTransfer(name=PoolName.KV, keys=hashes, device_indices=slots(*pages))])
    deadline = time.time() + 60
    while linker.num_completed_offloads() < 1 and time.time() < deadline:
        time.sleep(0.01)
    assert linker.pop_completed_offload() is True


def load_all(linker, rid, hashes, pages):
    assert linker.load(rid, [PoolTransfer(name=PoolName.KV, keys=hashes, device_indices=slots(*pages))])
    index = linker.start_layer_wise_loading()
    assert index >= 0
    counter = linker.layer_done_counter
    counter.set_consumer(index)
    return index, counter


@pytest.fixture
def shm_name():
    name = f"tpusync-linker-test-{os.getpid()}"
    yield name
    import tpu_sync

    for s in tpu_sync.list_segments():
        if s["name"].startswith(name):
            tpu_sync.remove_segment(s["name"], force=True)


def test_offload_restart_lookup_and_layer_wise_load_round_trip(shm_name):
    src = device_pool(1)
    want = {(pl, l, i): page_of(src, pl, l, p) for pl in (0, 1) for l in range(LAYERS) for i, p in enumerate((3, 7, 4))}
    a = make(src, shm_name)
    hashes = keys(3)
    offload(a, hashes, (3, 7, 4))
    assert a.lookup("r0", [PoolTransfer(name=PoolName.KV, keys=hashes)]) == [1, 2, 3]
    a.close()

    # A second linker over another device pool (another process, as far as the tier knows)
    # re-attaches the segment and loads the pages into other slots, layer by layer.
    dst = device_pool(50)
    b = make(dst, shm_name)
    assert b.attach == "attached"
    assert b.lookup("r1", [PoolTransfer(name=PoolName.KV, keys=hashes + keys(2, "z"))]) == [1, 2, 3]
    index, counter = load_all(b, "r1", hashes, (10, 2, 12))
    for layer in range(LAYERS):
        counter.wait_until(layer)  # what the forward pass does before attention of `layer`
        for pl in (0, 1):
            for i, p in enumerate((10, 2, 12)):
                assert torch.equal(page_of(dst, pl, layer, p), want[(pl, layer, i)]), (pl, layer, p)
    assert b.finish_layer_wise_loading(index) is True
    c = b.snapshot()
    assert c["loads"] == 1 and c["load_pages"] == 3 and c["load_layers"] == LAYERS, c
    assert c["load_bytes"] == 3 * ENTRY and c["staged_bytes"] == 0, c
    assert c["tier"]["get_dram"] == 3, c
    b.close()


def test_corrupted_page_is_cut_from_the_hit(shm_name):
    pool = device_pool(3)
    a = make(pool, shm_name)
    hashes = keys(4, "c")
    offload(a, hashes, (1, 2, 3, 4))
    ns = a.namespace
    a.close()
    # Flip one byte of page 2's entry in the segment.
    import tpu_sync

    st = tpu_sync.Store(namespace=ns, block_bytes=ENTRY, capacity_bytes=64 << 20, shm_name=shm_name + "-tp0")
    path = st.info()["segment"]
    st.close()
    entry = torch.cat([page_of(pool, pl, l, 3).reshape(-1) for pl in (0, 1) for l in range(LAYERS)])
    needle = entry.numpy().tobytes()[:4096]
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = mm.find(needle)
        assert at >= 0
        mm[at + 8] ^= 0x40
    b = make(device_pool(4), shm_name)
    # Presence says 4 pages; the verified read stops before the corrupted one.
    assert b.store.lookup([b.store.engine_key(h) for h in hashes]) == 4
    assert b.lookup("r", [PoolTransfer(name=PoolName.KV, keys=hashes)]) == [1, 2]
    assert b.snapshot()["corrupt"] == 1
    # The store dropped the corrupt page and its chain: a later lookup agrees without a read.
    assert b.store.lookup([b.store.engine_key(h) for h in hashes]) == 2
    b.close()


def test_load_without_staging_reads_again_and_refuses_missing_pages():
    pool = device_pool(5)
    a = make(pool)
    hashes = keys(2, "s")
    offload(a, hashes, (5, 6))
    want = page_of(pool, 1, 1, 6)
    # No lookup for this rid (its staging was dropped): the load reads and verifies itself.
    index, counter = load_all(a, "fresh", hashes, (8, 9))
    assert a.finish_layer_wise_loading(index) is True
    assert torch.equal(page_of(pool, 1, 1, 9), want)
    # A chain the tier does not fully hold is refused, so SGLang recomputes it.
    assert a.load("missing", [PoolTransfer(name=PoolName.KV, keys=hashes + keys(1, "q"),
                                           device_indices=slots(10, 11, 12))]) is False
    a.close()


def test_cancel_and_reset():
    a = make(device_pool(6))
    hashes = keys(2, "k")
    offload(a, hashes, (1, 2))
    assert a.lookup("r", [PoolTransfer(name=PoolName.KV, keys=hashes)]) == [1, 2]
    assert a.load("r", [PoolTransfer(name=PoolName.KV, keys=hashes, device_indices=slots(3, 4))])
    assert a.cancel_queued_load("r") is True
    assert a.cancel_queued_load("r") is False
    assert a.start_layer_wise_loading() == -1
    assert a.snapshot()["staged_bytes"] == 0
    assert a.lookup("r2", [PoolTransfer(name=PoolName.KV, keys=hashes)]) == [1, 2]
    assert a.snapshot()["staged_bytes"] == 2 * ENTRY
    a.reset()
    assert a.snapshot()["staged_bytes"] == 0 and a.num_completed_offloads() == 0
    a.close()
    a.close()  # idempotent


def test_staging_budget_cuts_the_hit():
    a = make(device_pool(7), staging_bytes=2 * ENTRY)
    hashes = keys(4, "b")
    offload(a, hashes, (1, 2, 3, 4))
    assert a.lookup("r", [PoolTransfer(name=PoolName.KV, keys=hashes)]) == [1, 2]
    assert a.snapshot()["cut_by_staging"] == 2
    a.close()


def test_namespaces_keep_models_apart():
    pool = device_pool(8)
    a = make(pool)
    ns = a.namespace
    a.close()
    assert "tiny-test" in ns and "tp0of2" in ns and "f32" in ns and "page16" in ns
    other = lk.namespace_of("other-model", lk.DevicePool(pool), tp_rank=0, tp_size=2, pp_rank=0, pp_size=1)
    assert other != ns
    rank1 = lk.namespace_of("tiny-test", lk.DevicePool(pool), tp_rank=1, tp_size=2, pp_rank=0, pp_size=1)
    assert rank1 != ns


def test_refusals():
    pool = device_pool(9)
    with pytest.raises(ValueError, match="full-attention"):
        make(pool, components=(ComponentType.FULL, ComponentType.SWA))
    with pytest.raises(lk.LinkerConfigError, match="unknown"):
        make(pool, shm_nmae="typo")
    with pytest.raises(lk.LinkerConfigError, match="wrong type"):
        make(pool, verify_checksums="yes")
    a = make(pool)
    with pytest.raises(ValueError, match="whole pages|aligned"):
        a.offload([PoolTransfer(name=PoolName.KV, keys=keys(1), device_indices=torch.arange(3, 19))])
    with pytest.raises(ValueError, match="keys but"):
        a.load("x", [PoolTransfer(name=PoolName.KV, keys=keys(2), device_indices=slots(1))])
    assert a.lookup("y", [PoolTransfer(name=PoolName.KV, keys=[])]) == []
    a.close()
