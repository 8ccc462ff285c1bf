"""Loopback TCP ports for servers a test starts in another process (etcd, vLLM servers, a child
that reads ``TPU_SYNC_METRICS_ADDR``), which must be told a port before they bind it. The Python
twin of ``tests/port_util/mod.rs``; both share the same lock files.

"Bind port 0, close, pass the number on" races: until the child binds, any socket on the machine
may take the port, and port 0 draws from the kernel's ephemeral range (32768-60999 by default),
the range every outgoing connection's source port comes from as well. A CI run failed exactly so
(etcd: ``bind: address already in use``). Ports here come from 61000-65535, above that range and
above the ranges vLLM and SGLang draw random ports from. A :class:`Port` holds an exclusive
``flock`` on ``$TMPDIR/tpu-sync-test-ports/<port>.lock`` until released, so no other test process
(Rust or Python) takes it; the kernel drops the lock when the process dies."""

import fcntl
import os
import socket
import tempfile
import time

FIRST, LAST = 61000, 65535


class Port:
    """A reserved loopback port; ``port`` is its number. Nothing listens on it until the test
    starts a server there. Release with :meth:`release` or use as a context manager."""

    def __init__(self, port, fd):
        self.port = port
        self._fd = fd

    def addr(self):
        return f"127.0.0.1:{self.port}"

    def release(self):
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        self.release()


def reserve():
    """Reserves a port in 61000-65535 that no other test process holds and that 127.0.0.1 can
    bind now; RuntimeError when every port is taken."""
    d = os.path.join(tempfile.gettempdir(), "tpu-sync-test-ports")
    os.makedirs(d, exist_ok=True)
    span = LAST - FIRST + 1
    start = (os.getpid() * 7919 ^ time.time_ns()) % span
    for i in range(span):
        port = FIRST + (start + i) % span
        try:
            fd = os.open(os.path.join(d, f"{port}.lock"), os.O_WRONLY | os.O_CREAT, 0o666)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        try:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
        except OSError:
            os.close(fd)
            continue
        return Port(port, fd)
    raise RuntimeError(f"no free loopback port in {FIRST}-{LAST}")
