"""A real etcd server for the Python cluster tests (the Python twin of ``mod.rs`` here): Debian's
``etcd`` binary (``scripts/install-etcd.sh``, ``make etcd``) started on reserved loopback ports (``ports.py``) with
its data in a temp dir, killed and removed afterwards. Shared by ``bindings/python/tests``,
``tests/vllm`` and ``tests/sglang`` (each puts this directory on ``sys.path``)."""

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request

import ports


def etcd_bin():
    """``$ETCD_BIN``, else ``etcd`` on PATH, else ``/usr/bin/etcd``; None when not installed."""
    exe = os.environ.get("ETCD_BIN") or shutil.which("etcd")
    if exe:
        return exe
    return "/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None


@contextlib.contextmanager
def etcd_server(tag="tsync-etcd"):
    """Starts etcd and yields its client URL (``http://127.0.0.1:PORT``) once it is healthy
    (within 30 s, else AssertionError). Callers skip when :func:`etcd_bin` is None."""
    exe = etcd_bin()
    assert exe is not None, "no etcd binary (scripts/install-etcd.sh)"
    d = tempfile.mkdtemp(prefix=f"{tag}-")
    held = [ports.reserve(), ports.reserve()]
    cp, pp = held[0].port, held[1].port
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
            assert p.poll() is None, f"etcd exited: {open(os.path.join(d, 'etcd.log')).read()[-2000:]}"
            assert time.time() - t0 < 30, "etcd did not start"
            time.sleep(0.05)
        yield curl
    finally:
        p.kill()
        p.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)
        for h in held:
            h.release()


def count_keys(curl, prefix):
    """Number of etcd keys under ``prefix`` (etcd's JSON gateway, count only)."""
    k = prefix.encode()
    end = k[:-1] + bytes([k[-1] + 1])
    body = json.dumps({"key": base64.b64encode(k).decode(), "range_end": base64.b64encode(end).decode(),
                       "count_only": True}).encode()
    r = urllib.request.urlopen(urllib.request.Request(curl + "/v3/kv/range", data=body), timeout=5)
    return int(json.loads(r.read()).get("count", 0))
