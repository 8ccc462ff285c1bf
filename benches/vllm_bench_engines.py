"""What the vLLM benchmarks share (``benches/vllm_layerwise_ttft.py``,
``benches/vllm_offload_saves.py``): the engine environment, the random-weight model they build
once, an engine process driven by JSON lines, and min/median/max summaries."""

import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Engine processes: offline, in-process engine core, 2 GiB of CPU KV cache.
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1"}


def ensure_model(model, layers, hidden, max_len):
    """Builds the benchmarks' random-weight Llama at ``model`` unless it exists (``layers``
    layers, ``hidden`` wide, 2 KV heads of 64, fp32 in the engines)."""
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "vllm", "build_tiny_model.py"), model,
                        "--layers", str(layers), "--hidden", str(hidden), "--heads", str(hidden // 64),
                        "--kv-heads", "2", "--head-dim", "64", "--intermediate", str(hidden * 11 // 4),
                        "--max-len", str(max_len)], check=True)


def answer_channel():
    """In an engine process: the original stdout for the JSON answers; everything else (vLLM
    logs to stdout) goes to stderr from here on."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


class Proc:
    """An engine process (``script --serve ...``): one JSON command per line on its stdin, one
    JSON answer per line on its stdout; it says ``{"ready": true}`` once its engine is up."""

    def __init__(self, script, args):
        env = dict(os.environ, **ENV)
        self.p = subprocess.Popen([sys.executable, os.path.abspath(script), "--serve"] + list(args),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.read()

    def read(self):
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise SystemExit(f"engine process exited ({self.p.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def send(self, **cmd):
        """Sends one command without waiting for its answer (:meth:`read` it later)."""
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def ask(self, **cmd):
        self.send(**cmd)
        return self.read()

    def close(self):
        try:
            self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.p.stdin.flush()
            self.p.wait(timeout=60)
        except Exception:
            self.p.kill()


def common_args(ap):
    """The options every vLLM benchmark has: rounds, the model (its size, or a path), the JSON
    output, and the hidden ones of its engine processes."""
    import argparse

    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--max-len", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def summary(xs):
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}
