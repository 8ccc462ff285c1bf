#!/usr/bin/env python3
"""cudaMemcpy baseline for the GPU check: the same KV bytes as benches/gpu/gpu_copy.rs moved
between device memory and pinned host memory with cupy (torch if cupy is missing).

Shape: 32 layers of [2, 128, 16, 8, 128] bf16 (8 MiB each); 64 blocks per layer and plane
(every other block id, reversed) = 4096 pieces of 32 KiB = 128 MiB.

Measured (median of --iters after 2 warm-ups, wall clock around issue + stream sync):
  pieces_d2h / pieces_h2d     4096 cudaMemcpyAsync calls from a Python loop (includes the
                              Python call overhead of each call: compare with the native
                              baseline, memcpy_baseline.cu, for the same call pattern in C)
  contiguous_d2h / _h2d       one cudaMemcpyAsync of all 128 MiB (the DMA bandwidth bound)
Prints one line: BASELINE {json}.
"""
import argparse
import json
import statistics
import sys
import time

LAYERS, PLANES, NUM_BLOCKS = 32, 2, 128
BLOCK = 16 * 8 * 128 * 2  # bytes of one block of one plane (bf16)
IDS = [i * 2 for i in reversed(range(64))]


def pieces():
    out, slot = [], 0
    for layer in range(LAYERS):
        for plane in range(PLANES):
            for bid in IDS:
                out.append((layer, plane * NUM_BLOCKS * BLOCK + bid * BLOCK, slot * BLOCK))
                slot += 1
    return out


def timed(fn, iters):
    ts = []
    for i in range(iters + 2):
        t = time.perf_counter()
        fn()
        if i >= 2:
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def run_cupy(iters):
    import cupy as cp
    import cupyx
    import numpy as np
    from cupy.cuda import runtime as rt

    layer_bytes = PLANES * NUM_BLOCKS * BLOCK
    rng = np.random.default_rng(7)
    dev = [cp.asarray(rng.integers(1, 255, layer_bytes, dtype=np.uint8)) for _ in range(LAYERS)]
    ps = pieces()
    total = len(ps) * BLOCK
    host = cupyx.empty_pinned((total,), dtype=np.uint8)
    hptr = host.ctypes.data
    contiguous = cp.empty(total, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    d2h, h2d = rt.memcpyDeviceToHost, rt.memcpyHostToDevice

    def pieces_d2h():
        for layer, off, at in ps:
            rt.memcpyAsync(hptr + at, dev[layer].data.ptr + off, BLOCK, d2h, stream.ptr)
        stream.synchronize()

    def pieces_h2d():
        for layer, off, at in ps:
            rt.memcpyAsync(dev[layer].data.ptr + off, hptr + at, BLOCK, h2d, stream.ptr)
        stream.synchronize()

    def contiguous_d2h():
        rt.memcpyAsync(hptr, contiguous.data.ptr, total, d2h, stream.ptr)
        stream.synchronize()

    def contiguous_h2d():
        rt.memcpyAsync(contiguous.data.ptr, hptr, total, h2d, stream.ptr)
        stream.synchronize()

    res = {"library": "cupy " + cp.__version__, "bytes": total, "pieces": len(ps)}
    res["pieces_d2h_s"] = timed(pieces_d2h, iters)
    # The pieces really arrived: compare a sample with the device contents.
    for k in range(0, len(ps), 257):
        layer, off, at = ps[k]
        want = cp.asnumpy(dev[layer][off:off + BLOCK])
        if not np.array_equal(host[at:at + BLOCK], want):
            raise SystemExit(f"baseline D2H piece {k} differs")
    res["pieces_h2d_s"] = timed(pieces_h2d, iters)
    res["contiguous_d2h_s"] = timed(contiguous_d2h, iters)
    res["contiguous_h2d_s"] = timed(contiguous_h2d, iters)
    res["device"] = rt.getDeviceProperties(0)["name"].decode()
    return res


def run_torch(iters):
    import torch

    layer_bytes = PLANES * NUM_BLOCKS * BLOCK
    dev = [torch.randint(1, 255, (layer_bytes,), dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
    ps = pieces()
    total = len(ps) * BLOCK
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    contiguous = torch.empty(total, dtype=torch.uint8, device="cuda")

    def pieces_d2h():
        for layer, off, at in ps:
            host[at:at + BLOCK].copy_(dev[layer][off:off + BLOCK], non_blocking=True)
        torch.cuda.synchronize()

    def pieces_h2d():
        for layer, off, at in ps:
            dev[layer][off:off + BLOCK].copy_(host[at:at + BLOCK], non_blocking=True)
        torch.cuda.synchronize()

    def contiguous_d2h():
        host.copy_(contiguous, non_blocking=True)
        torch.cuda.synchronize()

    def contiguous_h2d():
        contiguous.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    res = {"library": "torch " + torch.__version__, "bytes": total, "pieces": len(ps)}
    res["pieces_d2h_s"] = timed(pieces_d2h, iters)
    res["pieces_h2d_s"] = timed(pieces_h2d, iters)
    res["contiguous_d2h_s"] = timed(contiguous_d2h, iters)
    res["contiguous_h2d_s"] = timed(contiguous_h2d, iters)
    res["device"] = torch.cuda.get_device_name(0)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    try:
        res = run_cupy(a.iters)
    except ImportError as e:
        print(f"baseline: cupy unavailable ({e}); using torch", file=sys.stderr)
        res = run_torch(a.iters)
    print("BASELINE " + json.dumps(res))


if __name__ == "__main__":
    main()
