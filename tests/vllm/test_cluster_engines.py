"""Two real vLLM engines sharing a prefix cache through the cluster directory (etcd, started here)
and the remote tier: engine A (kv_both, cluster on) serves the prompts and stays up; engine B
(kv_both, cluster on, an empty host tier of its own) serves the same prompts and loads their
prefixes from A straight into its device blocks (tpu_sync.cluster.load), as a local host-tier
hit: same cached-token counts, output tokens equal to a plain run. Skipped without etcd. (Speed
lives in benchmarks: a tiny model's TTFT says nothing of a load's worth.)"""

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

from test_engine import BACKEND, LENS, cached, engines, expected_host_hits, plain, toks  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cluster_util"))
from etcd import count_keys, etcd_bin, etcd_server  # noqa: E402

PREFIX = "/tpu-sync/e2e"


@pytest.fixture(scope="module")
def etcd():
    if etcd_bin() is None:
        pytest.skip("no etcd binary (scripts/install-etcd.sh)")
    with etcd_server("tsync-vllm-etcd") as curl:
        yield curl


def block_entries(curl):
    """Block entries in the directory."""
    return count_keys(curl, PREFIX + "/b/")


#: The remote tier's pre-shared key of these engines (each serves its host tier only to holders).
FLEET_PSK_HEX = "5c" * 8 + "0123456789abcdef" * 3


def cluster_spec(engines, curl, host_id, **kw):
    extra = dict(host_capacity_bytes=64 << 20,
                 cluster=dict(endpoints=[curl], advertise="127.0.0.1:0", host_id=host_id, prefix=PREFIX,
                              lease_ttl=5, remote_psk_hex=FLEET_PSK_HEX))
    spec = engines.spec(connector=dict(kv_role="kv_both", policy="recompute", extra=extra))
    spec.update(kw)
    return spec


@contextlib.contextmanager
def serving_engine_a(engines, plain, curl, tag, host_id, saved):
    """Starts engine A (cluster on) on the prompts, waits for its output (token-identical to
    plain, ``saved`` blocks saved) and for its blocks in the directory (published
    asynchronously; a bounded wait on the value), yields its result while it keeps serving, and
    stops it after."""
    hold = os.path.join(engines.dir, tag + ".hold")
    if os.path.exists(hold):
        os.remove(hold)
    a = engines.start(tag, cluster_spec(engines, curl, host_id, hold_file=hold, hold_s=600))
    try:
        deadline = time.time() + 420
        while not os.path.exists(a.out):
            assert a.poll() is None, f"engine A exited:\n{engines.tail(tag)}"
            assert time.time() < deadline, "engine A did not finish"
            time.sleep(0.2)
        res_a = json.load(open(a.out))
        assert toks(res_a) == toks(plain)
        assert res_a["worker_stats"]["saved_blocks"] == saved
        t0 = time.time()
        while block_entries(curl) < saved and time.time() - t0 < 30:
            time.sleep(0.1)
        assert block_entries(curl) == saved
        yield res_a
    finally:
        open(hold, "w").close()
        try:
            a.wait(timeout=60)
        except subprocess.TimeoutExpired:
            a.kill()
            a.wait()


def test_second_engine_loads_the_first_engines_prefixes(engines, plain, etcd):
    if BACKEND == "ref":
        pytest.skip("the cluster tier is tpu_sync's own data path")
    with serving_engine_a(engines, plain, etcd, "cluster_a", "engine-a", sum(n // 32 for n in LENS)):
        res_b = engines.run("cluster_b", cluster_spec(engines, etcd, "engine-b"))
        want = [expected_host_hits(n) for n in LENS]
        assert cached(res_b) == want, "engine B must load A's prefixes as host-tier hits"
        assert toks(res_b) == toks(plain), "engine B's output differs from a plain run"
        # B loaded the blocks it reused straight from A into its device blocks (one remote load
        # per prompt, tpu_sync.cluster.load), and holds them in its own tier afterwards.
        assert res_b["tier_stats"]["remote_blocks"] == sum(want) // 32
        assert res_b["tier_stats"]["remote_loads"] == len(LENS)
        assert res_b["worker_stats"]["loaded_blocks"] == sum(want) // 32
