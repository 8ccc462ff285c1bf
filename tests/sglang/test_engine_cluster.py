"""Two real SGLang engines (CPU, tiny model, HiCache with the tpu_sync L3 storage backend) sharing
their L3 tiers through the cluster: an etcd server started here holds the prefix directory. Engine
``cluster-a`` serves the prompts ``A`` and stays up; engine ``cluster-b`` (an empty tier of its
own, no ``/dev/shm`` segment) then serves the same prompts: its storage backend finds A's pages
through the directory and reads them from A's remote tier (storage hits in
``cached_tokens_details``), and its output tokens are identical to the reference engine's
(``direct``, a plain HiCache run). Skipped without an etcd binary (scripts/install-etcd.sh)."""

import json
import os
import sys
import time

import pytest

from engines import A, HICACHE, PAGE, STORAGE, details, toks, wait_for

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cluster_util"))
from etcd import count_keys, etcd_bin, etcd_server  # noqa: E402

PREFIX = "/tpu-sync/sgl-e2e"
#: The fleet's pre-shared key: the remote tier between the two engines is TLS 1.3 with mutual PSK
#: authentication (docs/security.md), as a deployment beyond one host must run it.
FLEET_PSK_HEX = "3d" * 8 + "89abcdef01234567" * 3


@pytest.fixture(scope="module")
def etcd():
    if etcd_bin() is None:
        pytest.skip("no etcd binary (scripts/install-etcd.sh)")
    with etcd_server("tsync-sgl-e2e-etcd") as curl:
        yield curl


def engine(curl, host_id):
    storage = {k: v for k, v in STORAGE.items() if k != "shm_name"}
    storage["cluster"] = dict(endpoints=[curl], advertise="127.0.0.1:0", host_id=host_id, prefix=PREFIX,
                              lease_ttl=5, fetch_timeout=10, remote_psk_hex=FLEET_PSK_HEX)
    # wait_complete: a prefetch from L3 is never cut short by SGLang's timeout on a loaded machine.
    return dict(HICACHE, hicache_storage_backend="dynamic", hicache_storage_prefetch_policy="wait_complete",
                hicache_storage_backend_extra_config=json.dumps(storage))


def test_second_engine_reads_the_first_engines_pages_through_the_cluster(launched, etcd):
    e = launched
    done, go, release = (e.path(f"cluster-{n}") for n in ("a.done", "b.go", "a.release"))
    for p in (done, go, release):
        if os.path.exists(p):
            os.remove(p)
    env = {"TPU_SYNC_HICACHE_IO": "1"}
    a = e.start("cluster-a", [{"generate": A}, {"mark": done}, {"wait_file": release}], env=env,
                engine=engine(etcd, "sgl-a"))
    # B starts at once (engine start-up is the slow part) and waits for A's pages.
    e.start("cluster-b", [{"wait_file": go}, {"generate": A}], env=env, engine=engine(etcd, "sgl-b"))
    try:
        wait_for(lambda: os.path.exists(done) or a.poll() is not None, "engine cluster-a")
        assert a.poll() is None, e.tail("cluster-a")
        # Every full page of both prompts is backed up to A's L3 tier (write-through, on SGLang's
        # backup thread) and published (batched): bounded wait on the directory's entry count.
        pages = sum(len(ids) // PAGE for ids in A)
        t0 = time.time()
        while count_keys(etcd, PREFIX + "/b/") < pages and time.time() - t0 < 120:
            time.sleep(0.2)
        assert count_keys(etcd, PREFIX + "/b/") >= pages
        open(go, "w").close()
        res_b = e.finish("cluster-b")
    finally:
        open(release, "w").close()
    res_a = e.finish("cluster-a")
    ref = e.finish("direct")
    assert toks(res_a, 0) == toks(ref, 0)
    assert toks(res_b, 1) == toks(ref, 0), "engine B's output differs from a plain run"
    # B's prefixes came from A's tier: storage hits of at least 16 of A[0]'s 18 full pages.
    d = details(res_b, 1)
    assert all(x.get("storage", 0) >= 16 * PAGE for x in d), d
    st = res_b["stats"]["storage"][0]
    assert st["remote_fetches"] >= 1 and st["remote_pages"] >= 2 * 16 and st["remote_errors"] == 0, st
    assert st["corrupt"] == 0 and st["errors"] == 0, st
