"""TpuSyncStorage with ``cluster`` settings against SGLang's real host pool (no engine) and a real
etcd started here: instance B's exists / batch_get find the pages instance A stored through the
directory and read them from A's remote tier byte-exact; a dead peer is a miss, not a hang; bad
settings are a ConfigError. Skipped without an etcd binary (scripts/install-etcd.sh)."""

import os
import sys

import pytest

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

import pools
from pools import PAGE
from test_storage import config, hashes, page_data
from tpu_sync.sglang.storage import ConfigError, TpuSyncStorage

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cluster_util"))
from etcd import etcd_bin, etcd_server  # noqa: E402

PREFIX = "/tpu-sync/sgl-unit"


@pytest.fixture(scope="module")
def etcd():
    if etcd_bin() is None:
        pytest.skip("no etcd binary (scripts/install-etcd.sh)")
    with etcd_server("tsync-sgl-etcd") as curl:
        yield curl


#: The remote tier's pre-shared key of these instances (each serves its pages only to holders).
FLEET_PSK_HEX = "a7" * 8 + "fedcba9876543210" * 3


def cluster(curl, host_id, **kw):
    return dict(dict(endpoints=[curl], advertise="127.0.0.1:0", host_id=host_id, prefix=PREFIX, lease_ttl=3,
                     fetch_timeout=3, remote_psk_hex=FLEET_PSK_HEX), **kw)


def storage(pool, curl, host_id):
    st = TpuSyncStorage(config(cluster=cluster(curl, host_id)), {})
    st.register_mem_pool_host(pool)
    return st


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
def test_a_peer_reads_pages_another_instance_stored(etcd, layout):
    src = pools.mha_pool(layout, 1)
    pools.fill(src, 21)
    a = storage(src, etcd, f"sgl-a-{layout}")
    dst = pools.mha_pool(layout, 2)
    pools.fill(dst, 77)
    b = storage(dst, etcd, f"sgl-b-{layout}")
    assert a.namespaces == b.namespaces
    keys = hashes(6, "cl" + layout)
    hi = src.alloc(6 * PAGE)
    want = [page_data(src, int(hi[i * PAGE])) for i in range(6)]
    assert a.batch_set_v1(keys[:5], hi[:5 * PAGE], HiCacheStorageExtraInfo()) == [True] * 5
    a._tier().member.publisher.sync(10)
    # B holds nothing itself: exists counts A's pages, the read fetches them from A's remote tier.
    assert b.store_of().lookup([b.store_of().engine_key(k) for k in keys]) == 0
    assert b.batch_exists(keys) == 5 and b.exists(keys[0])
    di = dst.alloc(6 * PAGE)
    assert b.batch_get_v1(keys, di) == [True] * 5 + [False]
    for i in range(5):
        assert page_data(dst, int(di[i * PAGE])) == want[i]
    c = b.counters
    assert c["remote_fetches"] == 1 and c["remote_pages"] == 5 and c["remote_errors"] == 0, c
    # Now local hits: read again without A.
    a.close()
    fresh = dst.alloc(6 * PAGE)
    assert b.batch_get_v1(keys, fresh) == [True] * 5 + [False]
    assert [page_data(dst, int(fresh[i * PAGE])) for i in range(5)] == want[:5]
    assert b.counters["remote_fetches"] == 1
    b.close()


def test_a_dead_peer_is_a_miss_not_a_hang(etcd):
    src = pools.mha_pool("page_first_direct", 3)
    pools.fill(src, 5)
    a = storage(src, etcd, "sgl-dead-a")
    dst = pools.mha_pool("page_first_direct", 4)
    b = storage(dst, etcd, "sgl-dead-b")
    keys = hashes(3, "dead")
    hi = src.alloc(3 * PAGE)
    assert a.batch_set_v1(keys, hi) == [True] * 3
    a._tier().member.publisher.sync(10)
    assert b.batch_exists(keys) == 3
    # A's server goes away with its directory entries still there (its lease has not lapsed).
    a._tier().member.server.close()
    di = dst.alloc(3 * PAGE)
    before = [page_data(dst, int(di[i * PAGE])) for i in range(3)]
    assert b.batch_get_v1(keys, di) == [False] * 3  # (each fetch bounded by fetch_timeout)
    assert [page_data(dst, int(di[i * PAGE])) for i in range(3)] == before
    assert b.counters["remote_errors"] >= 1 and b.counters["errors"] == 0
    a.close()
    b.close()


def test_bad_cluster_settings_are_config_errors():
    for bad in ("not a dict", dict(endpoints=["http://127.0.0.1:1"]), dict(advertise="127.0.0.1:0"),
                dict(endpoints=["http://127.0.0.1:1"], advertise="127.0.0.1:0", no_such_key=1)):
        with pytest.raises(ConfigError):
            TpuSyncStorage(config(cluster=bad), {})
