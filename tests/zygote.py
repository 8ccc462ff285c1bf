"""A fork server for the engine processes of the engine tests (vLLM: ``tests/vllm``, SGLang:
``tests/sglang``): imports torch and the engine once, then forks one child per engine run, so
that each of a suite's engines skips the 15-35 s import (issue 23: `make test` in 25 minutes on
2 cores).

    python zygote.py serve SOCKET RUNNER    # the server (each suite's conftest.py starts one)
    python zygote.py run RUNNER ARGS...     # a client: what ``python RUNNER ARGS...`` would do

``RUNNER`` is an engine runner script (``tests/vllm/run_engine.py``, ``tests/sglang/
run_engine.py``). Its module is imported by the server (its top level must import nothing
heavy) and gives ``main()`` (run in each forked child with ``sys.argv = [RUNNER] + ARGS``), and
optionally ``ZYGOTE_PREIMPORT`` (the modules the server imports: what the engine imports while
it starts; a missing one is skipped), ``ZYGOTE_IMPORT_TIME_ENV`` (prefixes of environment
variables read at import time, see below) and ``zygote_child()`` (called in each child before
``main``).

A client is a small process that stands for its engine: the test starts it as it would start
``RUNNER`` (``subprocess.Popen``, its own session), and the engine, forked by the server, gets
the client's stdin/stdout/stderr (passed over the socket), environment, working directory and
arguments. The client exits with the engine's exit status (128 + N for a signal N). When the
client dies (the tests' ``os.killpg(proc.pid, SIGKILL)`` and ``Popen.kill``), the server kills the
engine's process group at once, so killing a client kills its engine as it would kill a plain
``RUNNER``.

Where the server cannot be used, the client runs ``RUNNER`` itself (``execv``): no
``TPU_SYNC_ZYGOTE`` socket in its environment, a server that is gone or serves another runner,
or an environment that differs from the server's in a variable that is read at import time
(``IMPORT_TIME_ENV`` plus the runner's own). Nothing is shared between engines but the imported
modules: every engine is a fresh fork of a process that ran no model and no torch operation, and
that has no Python thread but its main one (checked before each fork; the native threads it has
are OpenBLAS's idle pools of numpy and torch, which OpenBLAS shuts down and restarts around a
fork with its own ``pthread_atfork`` handlers), and ``tpu_sync`` is first imported in the child.

Who may connect: the socket is a file in the test's work directory with mode 0600 (the test
user only); requests are JSON lines with file descriptors attached (``SCM_RIGHTS``).
"""

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import time

ENV_SOCKET = "TPU_SYNC_ZYGOTE"
# Variables that change what an import does or how the interpreter starts: a request whose value
# differs from the server's runs without the server. Not ``LD_*``: the loader reads them when a
# program starts, so a fork keeps the server's libraries either way, while the engine's own
# subprocesses (TP workers) start with the request's values. (vLLM's CPU platform sets
# ``LD_PRELOAD`` in the environment of whatever process built a config, pytest's included, for
# the workers it starts; the first engines of a session never had it.) A runner adds its
# engine's own (``ZYGOTE_IMPORT_TIME_ENV``).
IMPORT_TIME_ENV = ("OMP_", "KMP_", "MKL_", "PYTHON", "TORCH_", "CUDA_", "HF_HOME", "TRANSFORMERS_", "MALLOC_")
ENV_IGNORED = ("PYTHONPATH", ENV_SOCKET)
_import_time_env = IMPORT_TIME_ENV


def _load_runner(path):
    """Imports the runner script ``path`` as a module (its folder first on ``sys.path``)."""
    import importlib

    here = os.path.dirname(os.path.abspath(path))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(os.path.splitext(os.path.basename(path))[0])


def _import_relevant(env):
    return {k: v for k, v in env.items()
            if k.startswith(_import_time_env) and k not in ENV_IGNORED}


def _threads():
    import threading

    return threading.active_count()


# ---- server ---------------------------------------------------------------------------------

def serve(path, runner_path):
    global _import_time_env
    t0 = time.time()
    env0 = dict(os.environ)  # before the imports, which set some variables themselves
    import importlib

    runner_path = os.path.abspath(runner_path)
    runner = _load_runner(runner_path)  # the children call its main
    _import_time_env = IMPORT_TIME_ENV + tuple(getattr(runner, "ZYGOTE_IMPORT_TIME_ENV", ()))
    for m in getattr(runner, "ZYGOTE_PREIMPORT", ()):
        try:
            importlib.import_module(m)
        except Exception as e:  # an optional module of this engine version
            print(f"zygote: skipped {m}: {e}", flush=True)

    base_env = _import_relevant(env0)
    # What the imports set (e.g. vLLM's defaults for torch): a child gets these too, where its
    # request left the variable as the server was given it.
    set_by_imports = {k: v for k, v in os.environ.items() if env0.get(k) != v}
    unset_by_imports = [k for k in env0 if k not in os.environ]
    base_env = (base_env, env0, set_by_imports, unset_by_imports)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path + ".tmp"
    if os.path.exists(tmp):
        os.remove(tmp)
    old = os.umask(0o177)
    try:
        srv.bind(tmp)
    finally:
        os.umask(old)
    srv.listen(64)
    os.replace(tmp, path)  # ready: clients connect only once the imports are done
    print(f"zygote: ready in {time.time() - t0:.1f} s on {path}", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ, None)
    children = {}  # pid -> client connection
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        for key, _ in sel.select(timeout=0.05):
            if key.data is None:
                conn, _ = srv.accept()
                try:
                    pid = _spawn(conn, sel, srv, base_env, runner, runner_path)
                except Exception as e:
                    _send(conn, {"error": f"{type(e).__name__}: {e}"})
                    conn.close()
                    continue
                if pid is None:
                    conn.close()
                    continue
                children[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
            else:
                # A client's socket is readable only when it closed (it sends nothing more):
                # its process died, so its engine dies too.
                pid = key.data
                try:
                    data = key.fileobj.recv(64)
                except OSError:
                    data = b""
                if not data:
                    _kill(pid)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            _send(conn, {"exit": code if code >= 0 else 128 - code})
            try:
                sel.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()
    for pid in list(children):
        _kill(pid)
    try:
        os.remove(path)
    except OSError:
        pass


def _kill(pid):
    for f in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            f()
            return
        except OSError:
            pass


def _send(conn, msg):
    try:
        conn.sendall((json.dumps(msg) + "\n").encode())
    except OSError:
        pass


def _spawn(conn, sel, srv, base_env, runner, runner_path):
    """Reads one request (JSON line + stdin/stdout/stderr) from ``conn`` and forks its engine;
    answers ``{"pid": N}``, or ``{"fallback": why}`` (then ``None``: the client runs it itself)."""
    conn.settimeout(10)
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not msg.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError("request cut short")
        msg += more
    conn.settimeout(None)
    req = json.loads(msg)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected 3 descriptors, got {len(fds)}")
    if os.path.abspath(req.get("runner", "")) != runner_path:
        for fd in fds:
            os.close(fd)
        _send(conn, {"fallback": f"the server runs {runner_path}"})
        return None
    relevant, env0, set_by_imports, unset_by_imports = base_env
    # A variable may have the value the server was started with, or the one its own imports set
    # (a parent that imported vLLM too, as pytest does for the connector tests, passes those on).
    env1 = dict(os.environ)
    asked = _import_relevant(req["env"])
    differ = sorted(k for k in set(asked) | set(relevant) | set(_import_relevant(env1))
                    if asked.get(k) not in (env0.get(k), env1.get(k)))
    if differ:
        for fd in fds:
            os.close(fd)
        _send(conn, {"fallback": "its import-time environment differs from the server's in " + ", ".join(differ)})
        return None
    n = _threads()
    if n != 1:
        for fd in fds:
            os.close(fd)
        _send(conn, {"fallback": f"the server has {n} Python threads"})
        return None
    pid = os.fork()
    if pid == 0:  # the engine
        code = 1
        try:
            os.setsid()
            sel.close()
            srv.close()
            conn.close()
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
                os.close(fd)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            env = dict(req["env"])
            for k, v in set_by_imports.items():
                if env.get(k) == env0.get(k):
                    env[k] = v
            for k in unset_by_imports:
                if env.get(k) == env0.get(k):
                    env.pop(k, None)
            os.environ.clear()
            os.environ.update(env)
            os.chdir(req["cwd"])
            for p in reversed([p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]):
                if p not in sys.path:
                    sys.path.insert(0, p)
            sys.argv = [runner_path] + req["args"]
            import random

            random.seed()
            child = getattr(runner, "zygote_child", None)
            if child is not None:
                child()
            runner.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            try:
                import atexit

                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    return pid


# ---- for the tests ---------------------------------------------------------------------------

@contextlib.contextmanager
def serving(runner_path, workdir):
    """Runs a server for ``runner_path`` (its log: ``workdir/zygote.log``) while the ``with``
    block runs, its socket in ``os.environ[TPU_SYNC_ZYGOTE]``; yields the socket's path. The server
    is ready once its socket exists (clients wait for it)."""
    import subprocess

    path = os.path.join(workdir, f"zygote-{os.getpid()}.sock")
    with open(os.path.join(workdir, "zygote.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", path, runner_path],
                                env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    os.environ[ENV_SOCKET] = path
    try:
        yield path
    finally:
        os.environ.pop(ENV_SOCKET, None)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for p in (path, path + ".tmp"):
            if os.path.exists(p):
                os.remove(p)


def wants_engines(config):
    """Whether a pytest run's arguments may select engine tests: no argument (the whole
    directory), a directory, or a file whose name holds ``engine``. The conftests start the fork
    server (and build the tiny models) before collection only then: collection imports torch and
    the engine for half a minute, which the server's own import overlaps on a second core."""
    args = [str(a).split("::")[0] for a in (config.args or [])]
    return not args or any(os.path.isdir(a) or "engine" in os.path.basename(a) for a in args)


class Background:
    """A command run beside the session (the tiny models' builds, output to a log file), waited
    for where what it makes is needed. Its exit status is not checked: the caller builds in the
    foreground whatever it did not make, so a failure shows there."""

    def __init__(self):
        self._proc = None

    def start(self, argv, log_path, env):
        import subprocess

        with open(log_path, "w") as log:
            self._proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    @property
    def started(self):
        return self._proc is not None

    def wait(self, timeout=600):
        """Waits until it ended (killed after ``timeout`` s); at once if none runs."""
        import subprocess

        if self._proc is None:
            return
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)  # the shell and the builder it runs
            self._proc.wait()
        self._proc = None


class EarlyServer:
    """:func:`serving` entered at ``pytest_sessionstart`` and left at ``pytest_sessionfinish``
    (a pytest hook cannot hold a ``with`` block)."""

    def __init__(self):
        self._cm = None

    def start(self, runner_path, workdir):
        self._cm = serving(runner_path, workdir)
        return self._cm.__enter__()

    def stop(self):
        if self._cm is not None:
            cm, self._cm = self._cm, None
            cm.__exit__(None, None, None)


def command(runner_path):
    """The command line that runs ``runner_path``: through the server when one is up
    (``TPU_SYNC_ZYGOTE`` set), else the script itself. Append the runner's arguments; the started
    process stands for the engine either way (exit status, kill)."""
    if os.environ.get(ENV_SOCKET):
        return [sys.executable, os.path.abspath(__file__), "run", runner_path]
    return [sys.executable, runner_path]


# ---- client ---------------------------------------------------------------------------------

def _fallback(runner_path, args, why):
    if why:
        print(f"zygote: running {os.path.basename(runner_path)} directly: {why}", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, runner_path] + args)


def run(runner_path, args):
    runner_path = os.path.abspath(runner_path)
    path = os.environ.get(ENV_SOCKET)
    if not path:
        _fallback(runner_path, args, None)
    # The server becomes ready (its socket appears) once its imports are done.
    deadline = time.time() + 180
    while not os.path.exists(path):
        if time.time() > deadline:
            _fallback(runner_path, args, f"no server at {path}")
        time.sleep(0.1)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        req = dict(runner=runner_path, args=args, env=dict(os.environ), cwd=os.getcwd())
        socket.send_fds(s, [(json.dumps(req) + "\n").encode()], [0, 1, 2])
        f = s.makefile("rb")
        first = json.loads(f.readline() or b"{}")
    except (OSError, ValueError) as e:
        _fallback(runner_path, args, f"server at {path}: {e}")
    if "pid" not in first:
        _fallback(runner_path, args, first.get("fallback") or first.get("error") or "server closed")
    # SIGTERM/SIGINT end this process, whose closed socket makes the server kill the engine.
    line = f.readline()
    if not line:
        print("zygote: server gone before the engine finished", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(int(json.loads(line)["exit"]))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 3 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
