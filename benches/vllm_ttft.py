"""TTFT of a 2,000-token prompt loaded from the host KV tier vs recomputed, in one vLLM engine.

One real vLLM engine (CPU backend) with TpuSyncConnector in ``kv_both`` role (host-DRAM offload
through ``tpu_sync.Store``). Each round sends a fresh random 2,000-token prompt twice with
``max_tokens=1`` (so the request's wall time is its time to first token): the first time it is
not in the tier and is prefilled (recomputed; its blocks are saved), the second time its blocks
load from the tier and only the last block is computed. Prints each round, the medians and the
ratio recomputed / loaded. Greedy tokens of the two are compared (they must be equal).

Usage (vLLM virtualenv; ``make bench-vllm``):
    python benches/vllm_ttft.py [--tokens 2000] [--rounds 5] [--layers 8] [--hidden 512] [--model DIR]

The default model (built once under target/vllm-bench/) is a random-weight Llama with 8 layers,
hidden 512, 8 query heads and 2 KV heads of 64, so a 2,000-token prefill does real work on a CPU
(about 16 MiB of KV in fp32). Timings depend on the machine and its load; the ratio is the
result.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--model", default=None)
    ap.add_argument("--capacity-gib", type=float, default=1.0)
    a = ap.parse_args()
    os.environ.update(ENV)
    model = a.model or os.path.join(ROOT, "target", "vllm-bench", f"llama-L{a.layers}-H{a.hidden}")
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "vllm", "build_tiny_model.py"), model,
                        "--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.hidden // 64),
                        "--kv-heads", "2", "--head-dim", "64", "--intermediate", str(a.hidden * 11 // 4),
                        "--max-len", str(max(4096, a.tokens + 64))], check=True)
    from vllm import LLM, SamplingParams

    max_len = max(4096, a.tokens + 64)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=max_len, max_num_seqs=4,
              max_num_batched_tokens=max_len, block_size=32, enable_prefix_caching=False, seed=0,
              distributed_executor_backend="uni",
              kv_transfer_config=dict(kv_connector="TpuSyncConnector", kv_connector_module_path="tpu_sync.vllm",
                                      kv_role="kv_both", kv_load_failure_policy="recompute",
                                      kv_connector_extra_config=dict(host_capacity_bytes=int(a.capacity_gib * 2**30))))
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(1)

    def ttft(prompt):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t, out

    def prompt():
        return [rng.randrange(3, 1000) for _ in range(a.tokens)]

    # Warm both paths (first-call allocations, kernel selection) with a prompt of its own.
    w = prompt()
    ttft(w)
    ttft(w)
    recomputed, loaded = [], []
    for r in range(a.rounds):
        p = prompt()
        t_miss, o_miss = ttft(p)
        t_hit, o_hit = ttft(p)
        if o_hit.num_cached_tokens < (a.tokens - 1) // 32 * 32:
            raise SystemExit(f"round {r}: the second request did not hit the tier ({o_hit.num_cached_tokens} tokens)")
        if list(o_hit.outputs[0].token_ids) != list(o_miss.outputs[0].token_ids):
            raise SystemExit(f"round {r}: loaded KV gave another token than recomputed KV")
        recomputed.append(t_miss)
        loaded.append(t_hit)
        print(f"round {r}: recomputed {t_miss * 1e3:8.1f} ms   loaded {t_hit * 1e3:8.1f} ms   "
              f"({o_hit.num_cached_tokens} of {a.tokens} tokens from the host tier)", flush=True)
    rm, lm = statistics.median(recomputed), statistics.median(loaded)
    res = dict(tokens=a.tokens, layers=a.layers, hidden=a.hidden, rounds=a.rounds,
               recomputed_ms=round(rm * 1e3, 1), loaded_ms=round(lm * 1e3, 1), ratio=round(rm / lm, 2))
    print(f"TTFT {a.tokens}-token prompt: recomputed {rm * 1e3:.1f} ms, loaded from host tier {lm * 1e3:.1f} ms "
          f"(medians of {a.rounds}); recomputed / loaded = {rm / lm:.2f}x")
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
