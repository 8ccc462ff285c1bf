"""The JAX adapter (tpu_sync.jax_kv.JaxKv, issue 25) on a real accelerator: P/D of one request's
KV blocks between two tpu-inference-shaped model runners whose caches live on a JAX device
(the GPU of the lent machine through JAX's CUDA PJRT plugin, or a CPU device here).

Per round, interleaved round-robin with a plain-JAX baseline of the same blocks:
  * tpu-sync: ``JaxKv.register`` on the producer (JAX gather of the request's blocks on the
    device, ``device_get`` into the host mirrors, viewed as PJRT CPU buffers and staged by a
    ``tpu_sync.Endpoint``), then ``JaxKv.pull`` on the consumer (pulled over loopback TCP into
    its host mirrors, resharded from the producer's block size to the consumer's, written back
    with a jitted, donating scatter on the device);
  * baseline: the same gather + ``jax.device_get`` of the producer's blocks (D2H), and
    ``jax.device_put`` + the same kind of donating scatter into the consumer's blocks (H2D):
    what a connector written on JAX alone does, with no network and no reshard.
After each tpu-sync round the consumer's caches are read back and compared byte for byte with
the reference (destination blocks = the producer's tokens re-blocked; every other block
unchanged) and the producer's caches with their original bytes; the destination blocks are
zeroed again before the next round, so each round's check can fail.

Shapes: ``layers`` per-layer RPA v3 caches ``[num_blocks, block_size, R, P, 128]`` (bf16,
8 KV heads, head_dim 128: R=8, P=2), TP=1 (one device), ``tokens`` tokens in scattered blocks.
Bytes moved per round: tokens x 8 heads x (K, V) x 128 x 2 B x layers.

Usage: python3 benches/gpu/jax_check.py [--platform gpu|cpu] [--layers 32] [--tokens 2048]
       [--rounds 5] [--backend auto|framework-copy|pjrt-view]
Needs: jax (with the platform's plugin), ml_dtypes, numpy, pytest (for the reference helpers of
bindings/python/tests/test_tpu_layouts.py), and tpu_sync with a PJRT CPU plugin for its host
views ($TPU_SYNC_PJRT_PLUGIN). Prints human lines and one ``JAXCHECK {json}`` line; exit 1 if a
check fails.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "python", "tests"))
from test_tpu_layouts import rank_caches  # noqa: E402

import tpu_sync  # noqa: E402
from tpu_sync.jax_kv import JaxKv  # noqa: E402

HEADS, DIM = 8, 128


class Runner:
    """What tpu-inference's model runner offers a connector: ``kv_caches``, re-assigned by
    every (donating) forward."""

    def __init__(self, caches):
        self.kv_caches = caches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--platform", default="gpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--src-block", type=int, default=16)
    ap.add_argument("--dst-block", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", default="auto")
    a = ap.parse_args()

    dev = jax.devices(a.platform)[0]
    mesh = Mesh(np.array([dev]).reshape(1, 1), ("data", "model"))
    sh = NamedSharding(mesh, P("data", None, "model"))
    L, T = a.layers, a.tokens
    s_bs, d_bs = a.src_block, a.dst_block
    s_n, d_n = -(-T // s_bs), -(-T // d_bs)
    s_nb, d_nb = 2 * s_n + 5, 2 * d_n + 5
    s_ids = [(7 * i + 3) % s_nb for i in range(s_n)]
    d_ids = [(d_nb - 1 - 2 * i) % d_nb for i in range(d_n)]
    assert len(set(s_ids)) == s_n and len(set(d_ids)) == d_n
    t0 = time.perf_counter()
    src = rank_caches(L, T, HEADS, DIM, "bf16", 1, s_bs, s_nb, [s_ids], False, seed=7)[0]
    want = rank_caches(L, T, HEADS, DIM, "bf16", 1, d_bs, d_nb, [d_ids], False, seed=7)[0]
    rng = np.random.default_rng(5)
    dst0 = []
    for layer in range(L):
        c = rng.integers(1, 0xFFFF, size=want[layer].shape, dtype=np.uint16)
        c[d_ids] = 0
        dst0.append(c)
    expect = []
    for layer in range(L):
        e = dst0[layer].copy()
        e[d_ids] = want[layer][d_ids]
        expect.append(e)
    bf = ml_dtypes.bfloat16
    prod = Runner([jax.device_put(c.view(bf), sh) for c in src])
    cons = Runner([jax.device_put(c.view(bf), sh) for c in dst0])
    real = T * HEADS * 2 * DIM * 2 * L
    print(f"== device {dev.platform}:{dev.device_kind}; {L} layers, {T} tokens, blocks {s_bs} -> {d_bs}, "
          f"{real / 2**20:.0f} MiB per round (setup {time.perf_counter() - t0:.1f} s)", flush=True)

    client = tpu_sync.Client()
    pk = JaxKv(prod, backend=a.backend, client=client)
    ck = JaxKv(cons, backend=a.backend, client=client)
    print(f"== back ends: producer {pk.backend} ({pk.backend_reason}); consumer {ck.backend}", flush=True)
    model = tpu_sync.model("jax-check", num_layers=L, num_kv_heads=HEADS, head_dim=DIM, dtype="bf16")

    s_idx = jax.device_put(np.array(s_ids, np.int32), dev)
    d_idx = jax.device_put(np.array(d_ids, np.int32), dev)
    # On the bf16 bit patterns as 16-bit integers: XLA's CPU backend canonicalises NaN payloads
    # in a float scatter (across the whole array), and random bit patterns hold NaNs.
    u16, bcast = jax.numpy.uint16, jax.lax.bitcast_convert_type
    gather = jax.jit(lambda c, i: bcast(bcast(c, u16)[i], c.dtype))
    scatter = jax.jit(lambda c, i, x: bcast(bcast(c, u16).at[i].set(bcast(x, u16)), c.dtype), donate_argnums=0)
    zero = jax.jit(lambda c, i: bcast(bcast(c, u16).at[i].set(0), c.dtype), donate_argnums=0)
    # The consumer's destination blocks as the baseline writes them: already re-blocked on the
    # host (the baseline does not reshard).
    host_blocks = [w[d_ids].view(bf) for w in want]

    def baseline():
        t = time.perf_counter()
        got = [jax.device_get(gather(c, s_idx)) for c in prod.kv_caches]
        d2h = time.perf_counter() - t
        assert sum(g.nbytes for g in got) >= real
        t = time.perf_counter()
        new = [scatter(c, d_idx, jax.device_put(x, dev)) for c, x in zip(cons.kv_caches, host_blocks)]
        jax.block_until_ready(new)
        h2d = time.perf_counter() - t
        cons.kv_caches = new
        return d2h, h2d

    def host(x):
        return np.asarray(jax.device_get(x)).view(np.uint16)

    failures = []
    rows = {"ts_register_s": [], "ts_pull_s": [], "base_d2h_s": [], "base_h2d_s": []}
    with tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=60, name="prefill") as pe, \
            tpu_sync.Endpoint(listen=None, timeout=60, name="decode") as de:
        for rnd in range(a.rounds + 1):  # round 0 warms both up (compiles), not counted
            cons.kv_caches = [zero(c, d_idx) for c in cons.kv_caches]
            jax.block_until_ready(cons.kv_caches)
            rid = 1000 + rnd
            t = time.perf_counter()
            place = pk.register(pe, rid, model, s_ids, T)
            reg = time.perf_counter() - t
            t = time.perf_counter()
            rep = ck.pull(de, rid, pe.address, place, model, d_ids, T, timeout_s=120)
            jax.block_until_ready(cons.kv_caches)
            pull = time.perf_counter() - t
            if rep["bytes"] != real:
                failures.append(f"round {rnd}: {rep['bytes']} bytes moved, expected {real}")
            bad = [layer for layer in range(L) if not np.array_equal(host(cons.kv_caches[layer]), expect[layer])]
            if bad:
                failures.append(f"round {rnd}: consumer layers differ from the reference: {bad[:8]}")
            bad = [layer for layer in range(L) if not np.array_equal(host(prod.kv_caches[layer]), src[layer])]
            if bad:
                failures.append(f"round {rnd}: producer layers changed: {bad[:8]}")
            d2h, h2d = baseline()
            if rnd:
                rows["ts_register_s"].append(reg)
                rows["ts_pull_s"].append(pull)
                rows["base_d2h_s"].append(d2h)
                rows["base_h2d_s"].append(h2d)
            print(f"   round {rnd}: tpu-sync register {reg * 1e3:.1f} ms, pull {pull * 1e3:.1f} ms; "
                  f"JAX device_get {d2h * 1e3:.1f} ms, device_put+scatter {h2d * 1e3:.1f} ms"
                  f"{'' if rnd else ' (warm-up)'}", flush=True)
    summ = {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in rows.items() if v}
    ratio = None
    if rows["ts_register_s"]:
        ts = statistics.median(r + p for r, p in zip(rows["ts_register_s"], rows["ts_pull_s"]))
        base = statistics.median(d + h for d, h in zip(rows["base_d2h_s"], rows["base_h2d_s"]))
        ratio = ts / base
        print(f"== median tpu-sync register+pull {ts * 1e3:.1f} ms vs JAX device_get+device_put {base * 1e3:.1f} ms: "
              f"{ratio:.2f}x the baseline's time ({real / ts / 1e9:.2f} vs {real / base / 1e9:.2f} GB/s)")
    st = ck.stats()
    out = {"platform": dev.platform, "device_kind": dev.device_kind, "backend": pk.backend,
           "layers": L, "tokens": T, "bytes": real, "rounds": a.rounds, "times": summ,
           "ratio_time_vs_jax": ratio, "consumer_stats": st, "failures": failures,
           "loadavg": os.getloadavg()}
    print("JAXCHECK " + json.dumps(out, default=str))
    for f in failures:
        print("FAIL:", f)
    print("== byte-exact checks:", "FAILED" if failures else f"passed ({a.rounds + 1} rounds)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
