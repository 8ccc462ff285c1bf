"""Fuzz-style input checking: every public function and method of :mod:`tpu_sync` gets random
integers (negative, zero, past 2^32, 2^53, 2^64), floats (NaN, infinities), strings (empty, NUL,
lone surrogates), bytes, containers, objects and real library objects, in every position. The
only exceptions allowed are :mod:`tpu_sync.errors` types, and the process must not crash: the
fuzzing runs in a subprocess (with a small staging budget, so nothing it creates can pin much
memory), which reports every violation and ends with a summary line.

Raw PJRT pointers (``Client.adopt``, ``Client.adopt_buffer``) are the one documented exception
to "any value": the library cannot check that an address is a live PJRT object, so they get 0
and non-integers only.
"""

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

FUZZ = textwrap.dedent(r'''
    import inspect, math, random, sys, traceback
    sys.path.insert(0, HERE)
    import tpu_sync
    from tpu_sync import errors
    from test_validation import DST, SRC, TOKENS, DIMS, layers
    from conftest import pattern

    ITERS = int(sys.argv[1])
    rng = random.Random(20261201)
    client = tpu_sync.Client(cpu_devices=2)
    buf = client.buffer_from_host(pattern(64, 1))
    kvbufs = layers(client, pattern, 3)
    store = tpu_sync.Store(namespace="fuzz", block_bytes=4096, capacity_bytes=1 << 20)
    key = store.chain_keys(list(range(16)), 16)[0]
    ep = tpu_sync.Endpoint(listen="127.0.0.1:0", timeout=2, heartbeat_timeout=2)
    peer = tpu_sync.Endpoint(listen=None, timeout=2)
    plan = tpu_sync.Plan(SRC, DST, TOKENS)

    class Weird:
        def __index__(self):
            raise RuntimeError("no index")
        def __float__(self):
            raise RuntimeError("no float")
        def __str__(self):
            raise RuntimeError("no str")
        def __repr__(self):
            return "Weird()"

    INTS = [-1, 0, 1, 2, 7, 16, 63, 64, 255, 4096, 2**31, 2**32 - 1, 2**32, 2**53 - 1, 2**53, 2**63 - 1, 2**63,
            2**64 - 1, 2**64, 2**70, -2**63, -2**70]
    VALUES = INTS + [
        None, True, False, 0.0, -0.5, 1.5, 1e300, float("nan"), float("inf"), -float("inf"), 1j,
        "", "x", "\0", "127.0.0.1:1", "0=127.0.0.1:1", "\ud800", "a" * 5000, b"", b"\xff" * 16, bytearray(8),
        [], [0], [1, 2, 3], [[0]], [[-1]], [["x"]], (), (buf, 0, bytearray(8)), [(buf, 0, bytearray(8))],
        [(buf, 2**64, bytearray(8), 2**70)], {}, {"a": 1}, {0: kvbufs}, {0: [buf]}, {-1: kvbufs}, {2**40: kvbufs},
        {0: "x"}, {"0": "127.0.0.1:1"}, {0: "a=b"}, SRC, DST, dict(SRC, extra=1), {"layout": None}, [float("nan")],
        object(), Weird(), buf, client, store, ep, plan, key, [key], [key, b"short"], int, print, range(3),
        iter([1, 2]), memoryview(b"abcd"),
    ]
    POINTERS = [0, None, "x", 1.5, object(), b"", -1 if False else 0]

    bad = []
    calls = 0

    def call(name, fn, args, kwargs):
        global calls
        calls += 1
        try:
            r = fn(*args, **kwargs)
            if hasattr(r, "close") and r is not client and r is not store and r is not ep:
                try:
                    r.close()
                except errors.TpuSyncError:
                    pass
        except errors.TpuSyncError:
            pass
        except BaseException as e:  # noqa: BLE001 - the point of the test
            bad.append(f"{name}{tuple(map(repr_short, args))} {kwargs!r:.200}: {type(e).__name__}: {e!s:.300}\n"
                       + "".join(traceback.format_tb(e.__traceback__)[-3:]))

    def repr_short(v):
        r = repr(v)
        return r if len(r) < 80 else r[:77] + "..."

    def fuzz(name, fn, iters, pointer_params=()):
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return
        params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY,
                                                                   p.POSITIONAL_ONLY)]
        for _ in range(iters):
            args, kwargs = [], {}
            for p in params:
                pool = POINTERS if p.name in pointer_params else VALUES
                if p.default is not p.empty and rng.random() < 0.3:
                    continue  # keep the default
                v = rng.choice(pool)
                if p.kind == p.KEYWORD_ONLY:
                    kwargs[p.name] = v
                elif kwargs or (p.default is not p.empty and rng.random() < 0.5):
                    kwargs[p.name] = v
                else:
                    args.append(v)
            call(name, fn, args, kwargs)

    # Module-level functions and constructors.
    skip = {"errors", "ABI_VERSION", "__version__", "TpuSyncError"}
    for n in tpu_sync.__all__:
        if n in skip:
            continue
        obj = getattr(tpu_sync, n)
        if inspect.isclass(obj):
            if n in ("Client", "Store", "Endpoint", "Plan"):
                fuzz(n, obj, ITERS if n != "Client" else max(4, ITERS // 8))
            if n == "Client":
                fuzz("Client.adopt", obj.adopt, ITERS, ("api_ptr", "client_ptr"))
        elif callable(obj):
            fuzz(n, obj, ITERS)
    tpu_sync.resume_pacing()
    tpu_sync.set_pacing(16 << 20, 64 << 20)

    # Methods and properties of live objects (close last).
    def instances():
        copy = tpu_sync.d2h([(buf, 0, bytearray(64))])
        lease = store.pin([key])
        xfer = peer.pull(99, ep.address, SRC, DST, TOKENS, {0: layers(client, pattern, 9)})
        return {"Client": client, "Buffer": buf, "Store": store, "Endpoint": ep, "Plan": plan, "Copy": copy,
                "Lease": lease, "Transfer": xfer}

    objs = instances()
    for cname, o in objs.items():
        for mname, m in inspect.getmembers(type(o)):
            if mname.startswith("_") or mname in ("close", "unpin"):
                continue
            if isinstance(m, property):
                call(f"{cname}.{mname}", lambda o=o, mname=mname: getattr(o, mname), (), {})
                continue
            if not callable(m):
                continue
            fuzz(f"{cname}.{mname}", getattr(o, mname), ITERS, ("pjrt_buffer", "api_ptr", "client_ptr"))
    tpu_sync.resume_pacing()
    for cname, o in objs.items():
        for v in VALUES[:12] + [object(), "x"]:
            call(f"{cname}.close", o.close, (v,), {}) if "drain" in str(inspect.signature(o.close)) else None
        call(f"{cname}.close", o.close, (), {})
        # A closed object raises InvalidHandleError, never anything else.
        for mname, m in inspect.getmembers(type(o)):
            if not mname.startswith("_") and callable(m) and not isinstance(m, property):
                fuzz(f"closed {cname}.{mname}", getattr(o, mname), 2, ("pjrt_buffer", "api_ptr", "client_ptr"))
    peer.close()
    print(f"FUZZ calls={calls} violations={len(bad)}")
    for b in bad[:40]:
        print("BAD", b)
    sys.exit(1 if bad else 0)
''')


def test_every_public_function_raises_only_tpu_sync_errors():
    env = dict(os.environ, TPU_SYNC_STAGING_BUDGET_BYTES=str(64 << 20), RUST_BACKTRACE="0")
    p = subprocess.run([sys.executable, "-c", "HERE = %r\n" % HERE + FUZZ, "40"], env=env, capture_output=True,
                       text=True, timeout=600)
    out = p.stdout + p.stderr[-4000:]
    assert p.returncode == 0, f"exit {p.returncode} (a negative code is a signal: a crash):\n{out}"
    summary = [line for line in p.stdout.splitlines() if line.startswith("FUZZ ")]
    assert summary and "violations=0" in summary[0], out
    calls = int(summary[0].split("calls=")[1].split()[0])
    assert calls > 2000, summary
