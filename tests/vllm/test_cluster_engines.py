"""Two real vLLM engines sharing a prefix cache through the cluster directory (etcd, started here)
and the remote tier: engine A (kv_both, cluster on) serves the prompts and stays up; engine B
(kv_both, cluster on, an empty host tier of its own) serves the same prompts and loads their
prefixes from A, exactly as a local host-tier hit: same cached-token counts, output tokens equal
to a plain run. Each request's TTFT is recorded (max_tokens=1 runs) and printed as a ratio to a
plain engine's, for information (speed targets live in benchmarks). Skipped without etcd."""

import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

from test_engine import BACKEND, LENS, cached, engines, expected_host_hits, plain, toks  # noqa: F401

PREFIX = "/tpu-sync/e2e"


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def etcd():
    exe = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if exe is None:
        pytest.skip("no etcd binary (scripts/install-etcd.sh)")
    d = tempfile.mkdtemp(prefix="tsync-vllm-etcd-")
    cp, pp = _port(), _port()
    curl, purl = f"http://127.0.0.1:{cp}", f"http://127.0.0.1:{pp}"
    log = open(os.path.join(d, "etcd.log"), "w")
    p = subprocess.Popen([exe, "--name", "t", "--data-dir", os.path.join(d, "data"),
                          "--listen-client-urls", curl, "--advertise-client-urls", curl,
                          "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
                          "--initial-cluster", f"t={purl}", "--logger", "zap", "--log-level", "warn"],
                         stdout=log, stderr=log)
    try:
        t0 = time.time()
        while True:
            try:
                if b'"true"' in urllib.request.urlopen(curl + "/health", timeout=1).read():
                    break
            except OSError:
                pass
            assert time.time() - t0 < 30, "etcd did not start"
            time.sleep(0.05)
        yield curl
    finally:
        p.kill()
        p.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def block_entries(curl):
    """Block entries in the directory (etcd's JSON gateway, count only)."""
    k = (PREFIX + "/b/").encode()
    end = k[:-1] + bytes([k[-1] + 1])
    body = json.dumps({"key": base64.b64encode(k).decode(), "range_end": base64.b64encode(end).decode(),
                       "count_only": True}).encode()
    r = urllib.request.urlopen(urllib.request.Request(curl + "/v3/kv/range", data=body), timeout=5)
    return int(json.loads(r.read()).get("count", 0))


def cluster_spec(engines, curl, host_id, **kw):
    extra = dict(host_capacity_bytes=64 << 20,
                 cluster=dict(endpoints=[curl], advertise="127.0.0.1:0", host_id=host_id, prefix=PREFIX,
                              lease_ttl=5))
    spec = engines.spec(connector=dict(kv_role="kv_both", policy="recompute", extra=extra))
    spec.update(kw)
    return spec


def ttft_spec(spec):
    """``spec`` generating one token per request, one request at a time, timing each."""
    return dict(spec, max_tokens=1, ttft=True)


def test_second_engine_loads_the_first_engines_prefixes(engines, plain, etcd):
    if BACKEND == "ref":
        pytest.skip("the cluster tier is tpu_sync's own data path")
    hold = os.path.join(engines.dir, "cluster-a.hold")
    if os.path.exists(hold):
        os.remove(hold)
    a = engines.start("cluster_a", cluster_spec(engines, etcd, "engine-a", hold_file=hold, hold_s=600))
    try:
        deadline = time.time() + 420
        while not os.path.exists(a.out):
            assert a.poll() is None, f"engine A exited:\n{engines.tail('cluster_a')}"
            assert time.time() < deadline, "engine A did not finish"
            time.sleep(0.2)
        res_a = json.load(open(a.out))
        assert toks(res_a) == toks(plain)
        saved = sum(n // 32 for n in LENS)
        assert res_a["worker_stats"]["saved_blocks"] == saved
        # A's blocks are in the directory (published asynchronously; bounded wait on the value).
        t0 = time.time()
        while block_entries(etcd) < saved and time.time() - t0 < 30:
            time.sleep(0.1)
        assert block_entries(etcd) == saved

        res_b = engines.run("cluster_b", cluster_spec(engines, etcd, "engine-b"))
        want = [expected_host_hits(n) for n in LENS]
        assert cached(res_b) == want, "engine B must load A's prefixes as host-tier hits"
        assert toks(res_b) == toks(plain), "engine B's output differs from a plain run"
        # B fetched everything A holds for these prompts (also each prompt's last full block,
        # which the engine then recomputes since it holds the last prompt token).
        assert res_b["tier_stats"]["remote_blocks"] == saved
        assert res_b["worker_stats"]["loaded_blocks"] == sum(want) // 32

        # TTFT, one request at a time, max_tokens=1: recompute (plain) vs loaded from A.
        ttft_plain = engines.run("cluster_ttft_plain", ttft_spec(engines.spec()))
        ttft_b = engines.run("cluster_ttft_b", ttft_spec(cluster_spec(engines, etcd, "engine-c")))
        assert cached(ttft_b) == want
        tp = [o["ttft_s"] for o in ttft_plain["runs"][0]["outputs"]]
        tb = [o["ttft_s"] for o in ttft_b["runs"][0]["outputs"]]
        print("TTFT plain  s:", [round(x, 4) for x in tp])
        print("TTFT remote s:", [round(x, 4) for x in tb])
        print("TTFT remote/plain:", [round(b / p, 3) for b, p in zip(tb, tp)])
    finally:
        open(hold, "w").close()
        try:
            a.wait(timeout=60)
        except subprocess.TimeoutExpired:
            a.kill()
            a.wait()
