#!/usr/bin/env python3
"""NIXL (UCX over TCP) loopback transfers between two processes, for benches/peers/run.sh.

The initiator starts the target as a child process, exchanges agent metadata and the target's
buffer descriptors with it over the child's stdin/stdout (base64 lines), then for every size
times READ (target -> initiator) and WRITE (initiator -> target) of one contiguous DRAM
region: post the request, poll until DONE. Before timing, each direction's bytes are checked
(non-repeating pattern, compared byte for byte). Prints one JSON line per (operation, size):
{"system": "nixl_read"|"nixl_write", "bytes": N, "samples_s": [...]}.

Environment: UCX_TLS=tcp UCX_NET_DEVICES=lo (set by run.sh; UCX over loopback TCP).
"""

import argparse
import base64
import json
import os
import subprocess
import sys
import time

import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config


def pattern(n, seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 255, size=n, dtype=np.uint8)
    return a


def send(f, obj):
    f.write(base64.b64encode(obj).decode() + "\n")
    f.flush()


def recv(f):
    line = f.readline()
    if not line:
        raise SystemExit("nixl_bench: peer closed")
    return base64.b64decode(line.strip())


POLL = os.environ.get("NIXL_BENCH_POLL", "1") != "0"


PROG_THREAD = os.environ.get("NIXL_BENCH_PROG_THREAD", "0") != "0"
TARGET_PROG_THREAD = os.environ.get("NIXL_BENCH_TARGET_PROG_THREAD", "1") != "0"


def agent(name, prog_thread):
    # Without the progress thread, this process's polling (check_xfer_state, get_new_notifs)
    # drives UCX; with it, the thread and a poll loop compete for the CPU.
    return nixl_agent(
        name, nixl_agent_config(enable_prog_thread=prog_thread, backends=["UCX"])
    )


# Protocol lines and results go to the original stdout; the libraries' own prints to fd 1 are
# sent to stderr (set in main).
OUT = sys.stdout


def target(max_bytes):
    a = agent("target", TARGET_PROG_THREAD)
    buf = pattern(max_bytes, 7)
    reg = a.register_memory([(buf.ctypes.data, max_bytes, 0, "")], "DRAM")
    send(OUT, a.get_agent_metadata())
    send(OUT, json.dumps({"addr": buf.ctypes.data}).encode())
    peer_meta = recv(sys.stdin)
    a.add_remote_agent(peer_meta)
    # Serve until told to stop; a "check N" asks for the first N bytes' pattern match. While
    # waiting for a command, drive the backend's progress (UCX over TCP needs the target side
    # to make progress too; its progress thread alone adds milliseconds per transfer).
    import select

    while True:
        r, _, _ = select.select([sys.stdin], [], [], 0 if POLL else 0.05)
        if not r:
            a.get_new_notifs()
            continue
        line = sys.stdin.readline()
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "check":
            n = int(cmd[1])
            ok = bool(np.array_equal(buf[:n], pattern(max_bytes, 11)[:n]))
            OUT.write(("ok" if ok else "mismatch") + "\n")
            OUT.flush()
        elif cmd[0] == "reset":
            buf[:] = pattern(max_bytes, 7)
            OUT.write("ok\n")
            OUT.flush()
    a.deregister_memory(reg)


def run_xfer(a, h):
    st = a.transfer(h)
    while st == "PROC":
        st = a.check_xfer_state(h)
    if st != "DONE":
        raise SystemExit(f"nixl_bench: transfer state {st}")


def initiator(sizes, rounds, min_round_s):
    max_bytes = max(sizes)
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--role", "target", "--max", str(max_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    a = agent("initiator", PROG_THREAD)
    local = np.zeros(max_bytes, dtype=np.uint8)
    reg = a.register_memory([(local.ctypes.data, max_bytes, 0, "")], "DRAM")
    remote_meta = recv(child.stdout)
    raddr = json.loads(recv(child.stdout))["addr"]
    send(child.stdin, a.get_agent_metadata())
    remote = a.add_remote_agent(remote_meta)
    src_pattern = pattern(max_bytes, 11)
    want_read = pattern(max_bytes, 7)
    for n in sizes:
        ldesc = a.get_xfer_descs([(local.ctypes.data, n, 0)], "DRAM")
        rdesc = a.get_xfer_descs([(raddr, n, 0)], "DRAM")
        handles = {
            op: a.initialize_xfer(op, ldesc, rdesc, remote, b"bench") for op in ("READ", "WRITE")
        }
        # Byte checks: READ brings the target's pattern, WRITE delivers ours.
        local[:n] = 0
        run_xfer(a, handles["READ"])
        if not np.array_equal(local[:n], want_read[:n]):
            raise SystemExit(f"nixl_bench: READ of {n} bytes delivered wrong bytes")
        local[:n] = src_pattern[:n]
        run_xfer(a, handles["WRITE"])
        child.stdin.write(f"check {n}\n")
        child.stdin.flush()
        if child.stdout.readline().strip() != "ok":
            raise SystemExit(f"nixl_bench: WRITE of {n} bytes delivered wrong bytes")
        child.stdin.write("reset\n")
        child.stdin.flush()
        child.stdout.readline()
        # Calibrate: a round lasts at least min_round_s.
        reps = {}
        for op, h in handles.items():
            t = time.perf_counter()
            run_xfer(a, h)
            dt = max(time.perf_counter() - t, 1e-7)
            reps[op] = max(1, min(100000, int(min_round_s / dt) + 1))
        samples = {op: [] for op in handles}
        for r in range(rounds):
            order = list(handles) if r % 2 == 0 else list(reversed(list(handles)))
            for op in order:
                h = handles[op]
                t = time.perf_counter()
                for _ in range(reps[op]):
                    run_xfer(a, h)
                samples[op].append((time.perf_counter() - t) / reps[op])
        for op, v in samples.items():
            OUT.write(json.dumps({"system": "nixl_" + op.lower(), "bytes": n, "samples_s": v}) + "\n")
            OUT.flush()
        for h in handles.values():
            a.release_xfer_handle(h)
    child.stdin.write("quit\n")
    child.stdin.flush()
    child.wait(timeout=30)
    a.deregister_memory(reg)


def main():
    global OUT
    sys.stdout.flush()
    OUT = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="initiator", choices=["initiator", "target"])
    p.add_argument("--max", type=int, default=64 << 20)
    p.add_argument("--sizes", default="65536,1048576,16777216,67108864")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--round-ms", type=float, default=100)
    a = p.parse_args()
    if a.role == "target":
        target(a.max)
    else:
        initiator([int(s) for s in a.sizes.split(",")], a.rounds, a.round_ms / 1000)


if __name__ == "__main__":
    main()
