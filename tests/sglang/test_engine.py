"""Real SGLang 0.5.23 engines on CPU (tiny random Llama, greedy), each in its own process
(``run_engine.py``), compared token for token.

* ``direct``: HiCache with SGLang's own ``direct`` I/O backend (the reference);
* ``tpu_sync``: the same with the tpu_sync I/O backend (``TPU_SYNC_HICACHE_IO=1``) and the
  tpu_sync L3 storage backend in a ``/dev/shm`` tier; device pages are evicted by filler prompts
  so that the repeated prompts are loaded back from the host pool (L2 -> L1 through tpu_sync);
* ``restart``: a new engine process re-attaches that tier: a prompt sharing the first prompt's
  prefix hits it from L3 (``cached_tokens_details``), and a page corrupted in the tier meanwhile
  fails its checksum and is recomputed; outputs stay identical.
"""

import json
import mmap
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from conftest import HERE

PAGE = 16
_rng = random.Random(20261201)
A = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (297, 330)]
A0X = A[0][:288] + [_rng.randrange(3, 1000) for _ in range(41)]  # A[0]'s first 18 pages + a new tail
FILLERS = [[_rng.randrange(3, 1000) for _ in range(500)] for _ in range(4)]
SHM = f"tpusync-sgl-e2e-{os.getpid()}"
CAPACITY = 64 << 20
ENGINE_TIMEOUT = 600
STORAGE = dict(backend_name="tpu_sync", module_path="tpu_sync.sglang.storage", class_name="TpuSyncStorage",
               interface_v1=1, shm_name=SHM, host_capacity_bytes=CAPACITY, prefetch_threshold=16)
HICACHE = dict(enable_hierarchical_cache=True, hicache_io_backend="direct", hicache_mem_layout="page_first_direct",
               hicache_ratio=2.0, hicache_write_policy="write_through")


class Engines:
    def __init__(self, workdir, model):
        self.dir = os.path.join(workdir, "runs")
        os.makedirs(self.dir, exist_ok=True)
        self.model = model

    def start(self, tag, steps, engine=None, env=None):
        out = os.path.join(self.dir, tag + ".json")
        if os.path.exists(out):
            os.remove(out)
        stats = os.path.join(self.dir, tag + ".stats")
        if os.path.isdir(stats):
            for n in os.listdir(stats):
                os.remove(os.path.join(stats, n))
        spec = dict(model=self.model, steps=steps, engine=engine or {},
                    env=dict(env or {}, TPU_SYNC_SGLANG_STATS_DIR=stats))
        sp = os.path.join(self.dir, tag + ".spec.json")
        json.dump(spec, open(sp, "w"))
        log = open(os.path.join(self.dir, tag + ".log"), "w")
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "run_engine.py"), sp, out], stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        p.tag, p.out, p.stats = tag, out, stats
        return p

    def finish(self, p):
        try:
            rc = p.wait(timeout=ENGINE_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            pytest.fail(f"engine {p.tag} did not finish:\n{self.tail(p.tag)}")
        if rc != 0 or not os.path.exists(p.out):
            pytest.fail(f"engine {p.tag} exited {rc}:\n{self.tail(p.tag)}")
        res = json.load(open(p.out))
        from tpu_sync.sglang import stats

        res["stats"] = {k: stats.collect(p.stats, k) for k in ("io", "storage")}
        return res

    def tail(self, tag, n=5000):
        try:
            return open(os.path.join(self.dir, tag + ".log")).read()[-n:]
        except OSError:
            return "(no log)"


def toks(res, step):
    return [o["output_ids"] for o in res["steps"][step]["outputs"]]


def details(res, step):
    return [o["cached_tokens_details"] or {} for o in res["steps"][step]["outputs"]]


STEPS = [{"generate": A}, {"generate": FILLERS}, {"generate": A}, {"generate": [A0X]}]


@pytest.fixture(scope="module")
def engines(workdir, tiny_model):
    return Engines(workdir, tiny_model)


@pytest.fixture(scope="module")
def runs(engines):
    """The reference and the tpu_sync engine, run side by side."""
    import tpu_sync

    for s in tpu_sync.list_segments():
        if s["name"].startswith(SHM):
            tpu_sync.remove_segment(s["name"], force=True)
    ref = engines.start("direct", STEPS, engine=HICACHE)
    ours = engines.start("tpu_sync", STEPS, env={"TPU_SYNC_HICACHE_IO": "1"},
                         engine=dict(HICACHE, hicache_storage_backend="dynamic",
                                     hicache_storage_backend_extra_config=json.dumps(STORAGE)))
    r = engines.finish(ref)
    o = engines.finish(ours)
    yield r, o
    for s in tpu_sync.list_segments():
        if s["name"].startswith(SHM):
            tpu_sync.remove_segment(s["name"], force=True)


def test_io_backend_matches_direct_and_moves_the_pages(runs):
    ref, ours = runs
    assert len({tuple(t) for t in toks(ref, 0)}) == 2, "the model must not be degenerate"
    for step in (0, 1, 2, 3):
        assert toks(ours, step) == toks(ref, step), f"step {step} differs from the direct backend"
    assert toks(ref, 2) == toks(ref, 0)
    # The repeated prompts were evicted from the device and loaded back from the host pool.
    d = details(ours, 2)
    assert all(x.get("host", 0) >= 256 for x in d), d
    io = ours["stats"]["io"]
    assert len(io) == 1, io
    c = io[0]
    assert c["backup_calls"] > 0 and c["backup_bytes"] > 0 and c["load_layers"] >= 2 and c["load_bytes"] > 0, c
    assert c["fallbacks"] == 0, c
    # The library's own pacer counters saw the copies.
    assert c["pacing"]["bytes"] >= c["backup_bytes"] + c["load_bytes"], c
    assert ref["stats"]["io"] == []  # the reference never used tpu_sync
    st = ours["stats"]["storage"][0]
    assert st["set_stored"] > 0 and st["errors"] == 0, st


def _keys(ids):
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(ids[: len(ids) // PAGE * PAGE], None, page_size=PAGE)


def corrupt_page(namespace, ids, page):
    """Flips one byte of a stored page of ``ids`` in the shm tier, behind its back."""
    import tpu_sync

    name = f"{SHM}-kv-tp0"
    st = tpu_sync.Store(namespace=namespace, block_bytes=2 * 2 * PAGE * 2 * 32 * 4, capacity_bytes=CAPACITY,
                        shm_name=name)
    try:
        assert st.info()["attach"] == "attached"
        keys = [st.engine_key(h) for h in _keys(ids)]
        assert st.lookup(keys) == len(keys), "the tier lost pages"
        out = bytearray(2 * 2 * PAGE * 2 * 32 * 4)
        assert st.get(keys[page:page + 1], [out]).delivered == 1
        path = st.info()["segment"]
    finally:
        st.close()
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = mm.find(bytes(out[:4096]))
        assert at >= 0
        mm[at + 100] ^= 0xFF


def test_restarted_engine_hits_l3_and_recomputes_a_corrupted_page(engines, runs):
    ref, ours = runs
    ns = ours["stats"]["storage"][0]["tiers"]["kv"]["namespace"]
    corrupt_page(ns, A[1], 3)
    res = engines.finish(engines.start(
        "restart", [{"generate": [A0X]}, {"generate": [A[1]]}], env={"TPU_SYNC_HICACHE_IO": "1"},
        engine=dict(HICACHE, hicache_storage_backend="dynamic",
                    hicache_storage_backend_extra_config=json.dumps(STORAGE))))
    # A new process: the shared prefix of A0X came from the re-attached L3 tier.
    d = details(res, 0)[0]
    assert d.get("storage", 0) >= 256, d
    assert toks(res, 0) == toks(ref, 3)
    # The corrupted page failed its checksum: a miss from there on, recomputed, same output.
    assert toks(res, 1) == [toks(ref, 0)[1]]
    st = res["stats"]["storage"][0]
    assert st["corrupt"] >= 1 and st["errors"] == 0, st
    assert details(res, 1)[0].get("storage", 0) <= 3 * PAGE, details(res, 1)
