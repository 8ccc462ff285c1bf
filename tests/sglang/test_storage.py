"""TpuSyncStorage against SGLang's real host pool classes of every layout (no engine).

Round trips through every method (generic, zero-copy v1, pool-aware v2), byte-exact against
SGLang's own page accessors; the multi-pool prefix rule with a sidecar page evicted between
exists and get; checksums (a corrupted page is a miss); warm restart from /dev/shm; namespacing
across TP ranks, models and layouts (MLA shares across TP ranks).
"""

import mmap
import os
import uuid

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageConfig, HiCacheStorageExtraInfo, PoolHitPolicy,
                                                  PoolName, PoolTransfer)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import pools
from pools import MHA_LAYOUTS, MLA_LAYOUTS, PAGE
from tpu_sync.sglang import pages
from tpu_sync.sglang.storage import ConfigError, TpuSyncStorage

ALL = [("mha", l) for l in MHA_LAYOUTS] + [("mla", l) for l in MLA_LAYOUTS]


def config(tp_rank=0, tp_size=1, mla=False, model="tiny", layout_page_first=False, **extra):
    extra = dict(dict(backend_name="tpu_sync", module_path="tpu_sync.sglang.storage", class_name="TpuSyncStorage",
                      interface_v1=1, host_capacity_bytes=16 << 20), **extra)
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=layout_page_first, model_name=model, extra_config=extra)


def make_pool(kind, layout, seed=1):
    return pools.mha_pool(layout, seed) if kind == "mha" else pools.mla_pool(layout, seed)


def hashes(n, tag="a"):
    """SGLang-style page keys (64 hex chars)."""
    import hashlib

    out, h = [], b""
    for i in range(n):
        h = hashlib.sha256(h + f"{tag}{i}".encode()).digest()
        out.append(h.hex())
    return out


def page_data(pool, index):
    """One page's bytes in entry order (SGLang's flat page; kv_split: its meta pointers)."""
    if pool.layout == "page_first_kv_split":
        return pools.page_bytes_of(pool, index)
    return pool.get_data_page(index, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def shm_name():
    name = f"tpusync-sgl-test-{uuid.uuid4().hex[:8]}"
    yield name
    import tpu_sync

    for s in tpu_sync.list_segments():
        if s["name"].startswith(name):
            tpu_sync.remove_segment(s["name"], force=True)


@pytest.mark.parametrize("kind,layout", ALL)
def test_pieces_cover_sglang_page_buffer_meta(kind, layout):
    pool = make_pool(kind, layout)
    idx = pool.alloc(3 * PAGE)
    for p in range(3):
        start = int(idx[p * PAGE])
        mine = sorted((b.data_ptr() + off, n) for (bi, off, n) in pages.page_pieces(pool, start)
                      for b in [pages.base_tensors(pool)[bi]])
        ptrs, sizes = pool.get_page_buffer_meta(idx[p * PAGE:(p + 1) * PAGE])
        theirs = sorted(zip(ptrs, sizes))
        # Same bytes: merge adjacent ranges on both sides before comparing.
        assert _merge(mine) == _merge(theirs)
        assert sum(n for _, n in mine) == pages.page_bytes(pool)


def _merge(ranges):
    out = []
    for a, n in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == a:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((a, n))
    return out


@pytest.mark.parametrize("kind,layout", ALL)
def test_round_trips_through_every_method(kind, layout):
    src = make_pool(kind, layout, 1)
    pools.fill(src, 11)
    st = TpuSyncStorage(config(mla=kind == "mla"), {})
    st.register_mem_pool_host(src)
    st.register_mem_host_pool_v2(src, PoolName.KV)
    st.on_host_pools_registered()
    n = 5
    keys = hashes(n)
    hi = src.alloc(n * PAGE)
    want = [page_data(src, int(hi[i * PAGE])) for i in range(n)]
    assert len(set(want)) == n
    # zero-copy v1: set from the pool, get into another pool's slots
    assert st.batch_set_v1(keys[:3], hi[:3 * PAGE], HiCacheStorageExtraInfo()) == [True] * 3
    assert st.batch_exists(keys) == 3 and st.exists(keys[0]) and not st.exists(keys[3])
    # read back into other slots of the pool (v1 moves pages in the registered pool)
    ok = st.batch_get_v1(keys, hi.new_tensor(list(range(int(hi[-1]) + 1, int(hi[-1]) + 1 + n * PAGE))))
    assert ok == [True, True, True, False, False]
    base = int(hi[-1]) + 1
    for i in range(3):
        assert page_data(src, base + i * PAGE) == want[i]
    # generic path (copies; SGLang's get_data_page / set_from_flat_data_page format)
    if layout != "page_first_kv_split":
        vals = [src.get_data_page(int(hi[i * PAGE]), flat=True) for i in range(3, 5)]
        assert st.batch_set(keys[3:], vals)
        assert st.set(keys[0], src.get_data_page(int(hi[0]), flat=True))  # already present: fine
        assert st.batch_exists(keys) == 5
        dummies = [src.get_dummy_flat_data_page() for _ in keys]
        got = st.batch_get(keys, dummies)
        assert all(g is not None for g in got)
        for i in range(n):
            assert got[i].view(torch.uint8).numpy().tobytes() == want[i]
        one = st.get(keys[4], src.get_dummy_flat_data_page())
        assert one.view(torch.uint8).numpy().tobytes() == want[4]
        # what the generic path wrote, the zero-copy path reads (same entry format)
        pools.fill(src, 55)  # overwrite the pool, then read every page back in place
        assert st.batch_get_v1(keys, hi) == [True] * n
        for i in range(n):
            assert page_data(src, int(hi[i * PAGE])) == want[i]
    else:
        assert st.batch_set_v1(keys[3:], hi[3 * PAGE:]) == [True, True]
    # pool-aware calls on the KV pool alone
    r = st.batch_exists_v2(keys, [])
    assert r.kv_hit_pages == n and r.restorable_prefix_pages == list(range(1, n + 1))
    m = st.get_stats()
    assert sum(m.prefetch_pgs) > 0 and sum(m.backup_pgs) > 0
    assert st.counters["corrupt"] == 0 and st.counters["errors"] == 0
    st.clear()
    assert st.batch_exists(keys) == 0
    st.close()


def test_factory_builds_it_as_sglang_does():
    st = StorageBackendFactory.create_backend("dynamic", config(), None)
    assert isinstance(st, TpuSyncStorage)
    with pytest.raises(ConfigError):
        TpuSyncStorage(config(host_capacity_byte=1), {})
    with pytest.raises(ConfigError):
        TpuSyncStorage(config(verify_checksums="yes"), {})


def test_corrupted_page_is_a_miss_and_recomputable(shm_name):
    src = pools.mha_pool("page_first_direct", 3)
    pools.fill(src, 5)
    st = TpuSyncStorage(config(shm_name=shm_name), {})
    st.register_mem_pool_host(src)
    keys = hashes(4, "c")
    hi = src.alloc(4 * PAGE)
    assert st.batch_set_v1(keys, hi) == [True] * 4
    target = page_data(src, int(hi[2 * PAGE]))
    path = st.store_of().info()["segment"]
    assert f"{shm_name}-kv-tp0" in path
    st.close()
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = mm.find(target[:4096])
        assert at >= 0
        mm[at + 100] ^= 0xFF  # behind the tier's back
    st = TpuSyncStorage(config(shm_name=shm_name), {})
    st.register_mem_pool_host(src)
    assert st.batch_exists(keys) == 4  # presence is not content
    dst = src.alloc(4 * PAGE)
    assert st.batch_get_v1(keys, dst) == [True, True, False, False]
    assert st.counters["corrupt"] == 1
    for i in range(2):
        assert page_data(src, int(dst[i * PAGE])) == page_data(src, int(hi[i * PAGE]))
    # the corrupt page and its chain below it are gone; SGLang recomputes and writes them again
    assert st.batch_exists(keys) == 2
    assert st.batch_set_v1(keys, hi) == [True] * 4
    assert st.batch_get_v1(keys, dst) == [True] * 4
    st.close()


@pytest.mark.parametrize("kind,layout", [("mha", "layer_first"), ("mla", "page_first")])
def test_warm_restart_reattaches_shm_tier(shm_name, kind, layout):
    src = make_pool(kind, layout, 4)
    pools.fill(src, 6)
    st = TpuSyncStorage(config(mla=kind == "mla", shm_name=shm_name), {})
    st.register_mem_pool_host(src)
    keys = hashes(3, "w")
    hi = src.alloc(3 * PAGE)
    want = [page_data(src, int(hi[i * PAGE])) for i in range(3)]
    assert st.batch_set_v1(keys, hi) == [True] * 3
    st.close()
    fresh = make_pool(kind, layout, 8)
    st = TpuSyncStorage(config(mla=kind == "mla", shm_name=shm_name), {})
    st.register_mem_pool_host(fresh)
    assert st.store_of().info()["attach"] == "attached"
    assert st.batch_exists(keys) == 3
    dst = fresh.alloc(3 * PAGE)
    assert st.batch_get_v1(keys, dst) == [True] * 3
    assert [page_data(fresh, int(dst[i * PAGE])) for i in range(3)] == want
    st.close()


def test_namespaces_separate_ranks_models_layouts_mla_shares(shm_name):
    p = pools.mha_pool("layer_first")
    ns = {}
    for name, cfg, pool in [("r0", config(0, 2), p), ("r1", config(1, 2), p), ("m", config(0, 2, model="other"), p),
                            ("lay", config(0, 2), pools.mha_pool("page_head"))]:
        s = TpuSyncStorage(cfg, {})
        s.register_mem_pool_host(pool)
        ns[name] = (s.namespaces["kv"], s.store_of().engine_key(hashes(1)[0]))
        s.close()
    assert len({v[0] for v in ns.values()}) == 4 and len({v[1] for v in ns.values()}) == 4
    # MHA: rank 1 never sees rank 0's pages
    keys = hashes(2, "ns")
    s0 = TpuSyncStorage(config(0, 2, shm_name=shm_name), {})
    s0.register_mem_pool_host(p)
    hi = p.alloc(2 * PAGE)
    assert s0.batch_set_v1(keys, hi) == [True, True]
    s0.close()
    s1 = TpuSyncStorage(config(1, 2, shm_name=shm_name), {})
    s1.register_mem_pool_host(p)
    assert s1.batch_exists(keys) == 0
    s1.close()
    # MLA: KV is replicated over TP, both ranks share the namespace and the tier
    q = pools.mla_pool("page_first_direct")
    pools.fill(q, 3)
    m0 = TpuSyncStorage(config(0, 2, mla=True, shm_name=shm_name), {})
    m0.register_mem_pool_host(q)
    qi = q.alloc(2 * PAGE)
    want = [page_data(q, int(qi[i * PAGE])) for i in range(2)]
    assert m0.batch_set_v1(keys, qi) == [True, True]
    ns0 = m0.namespaces["kv"]
    m0.close()
    m1 = TpuSyncStorage(config(1, 2, mla=True, shm_name=shm_name), {})
    m1.register_mem_pool_host(q)
    assert m1.namespaces["kv"] == ns0 and "tp=shared" in ns0
    assert m1.batch_exists(keys) == 2
    di = q.alloc(2 * PAGE)
    assert m1.batch_get_v1(keys, di) == [True, True]
    assert [page_data(q, int(di[i * PAGE])) for i in range(2)] == want
    m1.close()


def _transfer(name, pool, keys, policy=PoolHitPolicy.ALL_PAGES, indices=None):
    idx = indices if indices is not None else pool.alloc(len(keys) * PAGE)
    return PoolTransfer(name=name, host_indices=idx, keys=list(keys), hit_policy=policy)


def test_multi_pool_prefix_rule_and_sidecar_evicted_between_exists_and_get():
    kv, swa, idxp = pools.mha_pool("page_first_direct", 1), pools.mha_pool("layer_first", 2), \
        pools.mla_pool("page_first", 3)
    for i, p in enumerate((kv, swa, idxp)):
        pools.fill(p, 20 + i)
    st = TpuSyncStorage(config(), {})
    st.register_mem_pool_host(kv)
    st.register_mem_host_pool_v2(kv, PoolName.KV)
    st.register_mem_host_pool_v2(swa, PoolName.SWA)
    st.register_mem_host_pool_v2(idxp, PoolName.INDEXER)
    st.on_host_pools_registered()
    assert len({st.namespaces[n] for n in ("kv", "swa", "indexer")}) == 3
    n = 6
    keys = hashes(n, "v2")
    kv_hi = kv.alloc(n * PAGE)
    assert st.batch_set_v1(keys, kv_hi) == [True] * n
    swa_t, idx_t = _transfer(PoolName.SWA, swa, keys), _transfer(PoolName.INDEXER, idxp, keys)
    want = {"swa": [page_data(swa, int(swa_t.host_indices[i * PAGE])) for i in range(n)],
            "indexer": [page_data(idxp, int(idx_t.host_indices[i * PAGE])) for i in range(n)]}
    assert st.batch_set_v2([swa_t, idx_t]) == {"swa": [True] * n, "indexer": [True] * n}
    q = lambda: [PoolTransfer(name=PoolName.SWA, keys=keys), PoolTransfer(name=PoolName.INDEXER, keys=keys)]
    r = st.batch_exists_v2(keys, q())
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (n, list(range(1, n + 1)))
    # a sidecar page missing shortens the common prefix for every pool
    swa_store = st.store_of("swa")
    swa_store.remove([swa_store.engine_key(keys[3])])
    r = st.batch_exists_v2(keys, q())
    assert r.kv_hit_pages == 3 and r.extra_pool_hit_pages == {"kv": n, "swa": 3, "indexer": n}
    # put it back, exists sees 6; then the indexer page 4 is evicted before the get
    assert st.batch_set_v2([_transfer(PoolName.SWA, swa, keys, indices=swa_t.host_indices)])["swa"] == [True] * n
    assert st.batch_exists_v2(keys, q()).kv_hit_pages == n
    ix = st.store_of("indexer")
    ix.remove([ix.engine_key(keys[4])])
    got_swa, got_idx = _transfer(PoolName.SWA, swa, keys), _transfer(PoolName.INDEXER, idxp, keys)
    res = st.batch_get_v2([got_swa, got_idx])
    assert res == {"swa": [True] * 4 + [False] * 2, "indexer": [True] * 4 + [False] * 2}
    for name, pool, t in (("swa", swa, got_swa), ("indexer", idxp, got_idx)):
        for i in range(4):
            assert page_data(pool, int(t.host_indices[i * PAGE])) == want[name][i]
    # a get never returns a longer prefix than the exists call reported
    swa_store.remove([swa_store.engine_key(keys[2])])
    assert st.batch_exists_v2(keys, q()).kv_hit_pages == 2
    assert st.batch_set_v2([_transfer(PoolName.SWA, swa, keys, indices=swa_t.host_indices)])["swa"] == [True] * n
    res = st.batch_get_v2([_transfer(PoolName.SWA, swa, keys)])
    assert res["swa"] == [True, True] + [False] * 4
    # trailing pages (Mamba-like state): only the window before the prefix end must exist
    st.register_mem_host_pool_v2(pools.mha_pool("page_first", 9), PoolName.MAMBA)
    mam = st._tiers["mamba"].pool
    keys2 = hashes(5, "tr")
    assert st.batch_set_v1(keys2, kv.alloc(5 * PAGE)) == [True] * 5
    assert st.batch_set_v2([_transfer(PoolName.MAMBA, mam, keys2[3:])])["mamba"] == [True, True]
    r = st.batch_exists_v2(keys2, [PoolTransfer(name=PoolName.MAMBA, keys=keys2[3:],
                                                hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert r.kv_hit_pages == 5 and r.restorable_prefix_pages == [5]
    t = _transfer(PoolName.MAMBA, mam, keys2[3:], PoolHitPolicy.TRAILING_PAGES)
    assert st.batch_get_v2([t])["mamba"] == [True, True]
    ms = st.store_of("mamba")
    ms.remove([ms.engine_key(keys2[4])])
    assert st.batch_get_v2([_transfer(PoolName.MAMBA, mam, keys2[3:], PoolHitPolicy.TRAILING_PAGES)])["mamba"] == \
        [False, False]
    with pytest.raises(ValueError):
        st.batch_exists_v2(keys2, [PoolTransfer(name=PoolName.MAMBA, keys=keys2, hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
    st.close()
