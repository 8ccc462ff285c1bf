"""Real SGLang engines for the engine tests, each in its own process (``run_engine.py``), and the
prompts they share.

Every engine of the first phase starts at once (:func:`launch`, the session fixture
``launched``): the HiCache reference (``direct``), the tpu_sync I/O + L3 engine (``tpu_sync``),
the tpu_sync linker engine (``linker``), and the P/D trio: a TP=1 decode engine (``pd-decode``)
fed by a TP=1 prefill engine (``pd-prefill1``) and a TP=2 prefill engine (``pd-prefill2``).
Each test module then waits for the engines it checks (:meth:`Engines.finish`, cached), so
engine start-up, the slowest part, is paid once for all of them. Second-phase engines
(restarts) start when their test needs them.
"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import HERE, fork_server

PAGE = 16
_rng = random.Random(20261201)
A = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (297, 330)]
A0X = A[0][:288] + [_rng.randrange(3, 1000) for _ in range(41)]  # A[0]'s first 18 pages + a new tail
FILLERS = [[_rng.randrange(3, 1000) for _ in range(500)] for _ in range(4)]
X = [_rng.randrange(3, 1000) for _ in range(200)]  # P/D: a request whose prefill is killed
CAPACITY = 64 << 20
ENGINE_TIMEOUT = 1500
RUN = os.getpid()
SHM = f"tpusync-sgl-e2e-{RUN}"
LINKER_SHM = f"tpusync-sgl-linker-{RUN}"

STORAGE = dict(backend_name="tpu_sync", module_path="tpu_sync.sglang.storage", class_name="TpuSyncStorage",
               interface_v1=1, shm_name=SHM, host_capacity_bytes=CAPACITY, prefetch_threshold=16)
HICACHE = dict(enable_hierarchical_cache=True, hicache_io_backend="direct", hicache_mem_layout="page_first_direct",
               hicache_ratio=2.0, hicache_write_policy="write_through")
STEPS = [{"generate": A}, {"generate": FILLERS}, {"generate": A}, {"generate": [A0X]}]

LINKER = dict(enable_unified_cache_external_linker=True, unified_cache_external_linker_backend="dynamic",
              unified_cache_external_linker_config=dict(
                  linker="TpuSyncLinker", linker_module_path="tpu_sync.sglang.linker",
                  linker_extra_config=dict(shm_name=LINKER_SHM, host_capacity_bytes=CAPACITY)))

# P/D: everything on 127.0.0.1 (SGLANG_HOST_IP binds SGLang's ZMQ sockets and the tpu_sync
# endpoint there); the decode engine notices a dead prefill after 2 missed 2 s heartbeats.
PD_PORTS = dict(prefill1=18911, prefill2=18912)
PD_ENV = {"SGLANG_HOST_IP": "127.0.0.1", "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
          "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "300",
          "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "300", "TPU_SYNC_SGLANG_PD_TIMEOUT_S": "30"}
PD = dict(disaggregation_transfer_backend="tpu_sync", disable_overlap_schedule=True, host="127.0.0.1")
TP2_CPU_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl-disabled.so.2"}
ROOMS = dict(a0_p1=2001, a1_p1=2002, a0_p2=2003, a1_p2=2004, x_p1=2005)


class Engines:
    def __init__(self, workdir, model):
        self.dir = os.path.join(workdir, "runs")
        os.makedirs(self.dir, exist_ok=True)
        self.model = model
        self.procs = {}
        self.results = {}
        self.killed = {}

    def path(self, name):
        return os.path.join(self.dir, name)

    def start(self, tag, steps, engine=None, env=None, max_tokens=8):
        out = self.path(tag + ".json")
        if os.path.exists(out):
            os.remove(out)
        stats = self.path(tag + ".stats")
        if os.path.isdir(stats):
            for n in os.listdir(stats):
                os.remove(os.path.join(stats, n))
        spec = dict(model=self.model, steps=steps, engine=engine or {}, max_tokens=max_tokens,
                    env=dict(env or {}, TPU_SYNC_SGLANG_STATS_DIR=stats))
        sp = self.path(tag + ".spec.json")
        json.dump(spec, open(sp, "w"))
        log = open(self.path(tag + ".log"), "w")
        # Through the fork server when the session has one (conftest.py's ``zygote``); the
        # process started here stands for the engine either way (exit status, kill).
        p = subprocess.Popen(fork_server.command(os.path.join(HERE, "run_engine.py")) + [sp, out], stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        p.tag, p.out, p.stats = tag, out, stats
        self.procs[tag] = p
        return p

    def finish(self, tag):
        """Waits for engine ``tag`` (once; later calls return the same result) and returns its
        result with the stats files of its processes (``stats[kind]``)."""
        if tag in self.results:
            return self.results[tag]
        p = self.procs[tag]
        try:
            rc = p.wait(timeout=ENGINE_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill(tag)
            pytest.fail(f"engine {tag} did not finish:\n{self.tail(tag)}")
        if rc != 0 or not os.path.exists(p.out):
            pytest.fail(f"engine {tag} exited {rc}:\n{self.tail(tag)}")
        res = json.load(open(p.out))
        res["stats"] = self.stats(tag)
        self.results[tag] = res
        return res

    def stats(self, tag):
        from tpu_sync.sglang import stats

        p = self.procs[tag]
        return {k: stats.collect(p.stats, k) for k in ("io", "storage", "linker", "pd-prefill", "pd-decode")}

    def kill(self, tag):
        p = self.procs[tag]
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()

    def kill_all(self):
        for tag, p in self.procs.items():
            if p.poll() is None:
                self.kill(tag)

    def tail(self, tag, n=6000):
        try:
            return open(self.path(tag + ".log")).read()[-n:]
        except OSError:
            return "(no log)"


def wait_for(pred, what, timeout=ENGINE_TIMEOUT):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def launch(engines):
    """Starts every first-phase engine (see the module docs). ``TPU_SYNC_SGLANG_ENGINES`` (a
    comma-separated list of engine names) starts only those: for working on one test file."""
    e = engines
    only = {n for n in os.environ.get("TPU_SYNC_SGLANG_ENGINES", "").split(",") if n}
    if only:
        start = e.start

        def filtered(tag, *a, **kw):
            if tag in only:
                return start(tag, *a, **kw)

        e.start = filtered
    for mark in ("pd-prefill1.done", "pd-prefill1.never", "pd-prefill2.release", "pd-decode.up", "pd-prefill1.up",
                 "pd-prefill2.up"):
        if os.path.exists(e.path(mark)):
            os.remove(e.path(mark))
    e.start("direct", STEPS, engine=HICACHE)
    e.start("tpu_sync", STEPS, env={"TPU_SYNC_HICACHE_IO": "1"},
            engine=dict(HICACHE, hicache_storage_backend="dynamic",
                        hicache_storage_backend_extra_config=json.dumps(STORAGE)))
    e.start("linker", [{"generate": A}, {"generate": [A0X]}], engine=LINKER)
    p1, p2 = PD_PORTS["prefill1"], PD_PORTS["prefill2"]
    decode_reqs = [dict(ids=A[0], room=ROOMS["a0_p1"], port=p1), dict(ids=A[1], room=ROOMS["a1_p1"], port=p1),
                   dict(ids=A[0], room=ROOMS["a0_p2"], port=p2), dict(ids=A[1], room=ROOMS["a1_p2"], port=p2),
                   dict(ids=X, room=ROOMS["x_p1"], port=p1)]
    # All three engines send their requests only once all three are up (a decode gives up on
    # a prefill whose ranks have not registered within ~15 s, and a prefill on a decode that
    # does not announce a request within SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT).
    up = {n: {"mark": e.path(f"{n}.up")} for n in ("pd-decode", "pd-prefill1", "pd-prefill2")}
    wait = {n: {"wait_file": e.path(f"{n}.up")} for n in up}
    e.start("pd-decode", [up["pd-decode"], wait["pd-prefill1"], wait["pd-prefill2"],
                          {"generate_pd": decode_reqs}], env=PD_ENV,
            engine=dict(PD, disaggregation_mode="decode", port=31300, max_total_tokens=4096,
                        max_running_requests=8))
    e.start("pd-prefill1", [up["pd-prefill1"], wait["pd-decode"], {"generate_pd": decode_reqs[:2]},
                            {"mark": e.path("pd-prefill1.done")}, {"wait_file": e.path("pd-prefill1.never")}],
            env=PD_ENV, engine=dict(PD, disaggregation_mode="prefill", disaggregation_bootstrap_port=p1, port=31100))
    # TP=2 on SGLang's CPU engine: each rank's OpenMP threads on a core of its own (SGLang refuses
    # more ranks than NUMA nodes otherwise), and no NCCL (PyPI's CUDA build of torch ships it, and
    # SGLang would open a PyNccl communicator on the CPU device; without the library it falls back
    # to gloo).
    e.start("pd-prefill2", [up["pd-prefill2"], wait["pd-decode"], {"generate_pd": decode_reqs[2:4]},
                            {"wait_file": e.path("pd-prefill2.release")}],
            env=dict(PD_ENV, **TP2_CPU_ENV),
            engine=dict(PD, disaggregation_mode="prefill", disaggregation_bootstrap_port=p2, port=31200, tp_size=2))
    if only:
        del e.start
    if "pd-prefill1" in e.procs:
        threading.Thread(target=_kill_prefill1, args=(e,), daemon=True, name="kill-pd-prefill1").start()


def _meta_received(e, tag):
    return sum(s.get("meta_received", 0) for s in e.stats(tag)["pd-prefill"])


def _pulls_done(e, tag):
    return sum(s.get("pulls_done", 0) for s in e.stats(tag)["pd-decode"])


def _kill_prefill1(e):
    """Kills the TP=1 prefill engine (its whole process group) once it has served its two
    requests, the decode engine has pulled them (a prefill's request ends once its KV is staged
    and announced, before the decode's pull: killing it then reset that pull, which failed this
    test once in a clean-clone run), and the decode has announced request X to it (its third
    metadata message), so that X waits for KV from a dead prefill. The decode's four pulls (two
    from each prefill) are all it makes. Records the prefill's stats and the time."""
    deadline = time.time() + ENGINE_TIMEOUT
    while time.time() < deadline:
        if (os.path.exists(e.path("pd-prefill1.done")) and _meta_received(e, "pd-prefill1") >= 3
                and _pulls_done(e, "pd-decode") >= 4):
            e.killed["pd-prefill1"] = dict(stats=e.stats("pd-prefill1"), at=time.time())
            e.kill("pd-prefill1")
            return
        if e.procs["pd-prefill1"].poll() is not None:
            return
        time.sleep(0.5)


def remove_segments(prefix):
    import tpu_sync

    for s in tpu_sync.list_segments():
        if s["name"].startswith(prefix):
            tpu_sync.remove_segment(s["name"], force=True)


def toks(res, step):
    return [o.get("output_ids") for o in res["steps"][step]["outputs"]]


def details(res, step):
    return [o.get("cached_tokens_details") or {} for o in res["steps"][step]["outputs"]]


def storage_keys(ids):
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(ids[: len(ids) // PAGE * PAGE], None, page_size=PAGE)


def corrupt_entry(segment_name, namespace, block_bytes, ids, page):
    """Flips one byte of the stored page ``page`` of prompt ``ids`` in a ``/dev/shm`` tier, behind
    its back (the tier is opened, read and closed first to find the page's bytes)."""
    import mmap

    import tpu_sync

    st = tpu_sync.Store(namespace=namespace, block_bytes=block_bytes, capacity_bytes=CAPACITY, shm_name=segment_name)
    try:
        assert st.info()["attach"] == "attached"
        keys = [st.engine_key(h) for h in storage_keys(ids)]
        assert st.lookup(keys) == len(keys), "the tier lost pages"
        out = bytearray(block_bytes)
        assert st.get(keys[page:page + 1], [out]).delivered == 1
        path = st.info()["segment"]
    finally:
        st.close()
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = mm.find(bytes(out[:4096]))
        assert at >= 0
        mm[at + 100] ^= 0xFF
