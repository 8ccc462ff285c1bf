"""Throughput of a real vLLM engine with host-tier saves on and off (issue 26, item 3).

Three engines, each in its own process, on the same model and machine:

* ``plain``: no connector (the baseline: saves off);
* ``sync``: ``TpuSyncConnector`` with the host tier, ``async_saves=False`` (every prompt block
  that becomes full is copied into the tier inside ``wait_for_save``, in the step);
* ``async``: the same with ``async_saves=True`` (the default: the step queues the D2H and
  returns; a background thread copies; a finished request's blocks are freed once saved).

Each round sends every engine the same batch of fresh random prompts (so every engine computes
every prompt and the tiers save every full block), one engine after the other, in an order
rotated per round; throughput = generated tokens / wall time of the batch (prefill included,
as a serving engine sees it). Outputs are compared token for token across the three engines.
Prints min/median/max per engine, the ratios of the medians to ``plain`` and the load average.

Usage (vLLM virtualenv; ``make bench-vllm-saves``):
    python benches/vllm_offload_saves.py [--requests 8] [--tokens 1000] [--max-tokens 64]
        [--rounds 5] [--layers 8] [--hidden 512] [--json FILE]

The model is the one of ``benches/vllm_ttft.py`` (random weights, built once under
target/vllm-bench/). Timings depend on the machine and its load; the ratios are the result.
"""

import argparse
import json
import os
import random
import sys
import time

from vllm_bench_engines import ENV, ROOT, answer_channel, common_args, ensure_model, summary
from vllm_bench_engines import Proc as _Proc

MODES = ("plain", "sync", "async")


def serve(mode, model, max_len, max_seqs):
    """An engine process: JSON commands on stdin, one JSON answer per line."""
    out = answer_channel()
    from vllm import LLM, SamplingParams

    kw = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=max_len, max_num_seqs=max_seqs,
              max_num_batched_tokens=max_len, block_size=32, enable_prefix_caching=False, seed=0,
              distributed_executor_backend="uni")
    if mode != "plain":
        kw["kv_transfer_config"] = dict(
            kv_connector="TpuSyncConnector", kv_connector_module_path="tpu_sync.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=dict(host_capacity_bytes=1 << 30, async_saves=mode == "async"))
    llm = LLM(**kw)
    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        sp = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = [list(o.outputs[0].token_ids) for o in outs]
        saved = None
        if sched is not None:
            # Not timed: let the last saves finish and the held blocks go (a serving engine keeps
            # stepping), so every round starts alike.
            deadline = time.time() + 30
            while sched.scheduler_side.pending_frees() and time.time() < deadline:
                llm.llm_engine.step()
            saved = sched.scheduler_side.stats["saved_blocks"]
        print(json.dumps({"tokens": toks, "wall_s": dt, "saved_blocks": saved}), file=out, flush=True)


def Proc(mode, a, model, max_len):
    return _Proc(__file__, [mode, "--model", model, "--max-len", str(max_len), "--requests", str(a.requests)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = common_args(ap).parse_args()
    os.environ.update(ENV)
    model = a.model or os.path.join(ROOT, "target", "vllm-bench", f"llama-L{a.layers}-H{a.hidden}")
    max_len = a.max_len or max(4096, a.tokens + a.max_tokens + 64)
    if a.serve:
        serve(a.serve, model, max_len, a.requests)
        return
    ensure_model(model, a.layers, a.hidden, max_len)
    procs = {}
    try:
        for m in MODES:
            procs[m] = Proc(m, a, model, max_len)
        rng = random.Random(26)
        tput = {m: [] for m in MODES}
        saved = {}
        for r in range(a.rounds + 1):  # round 0 warms every engine
            prompts = [[rng.randrange(3, 1000) for _ in range(a.tokens)] for _ in range(a.requests)]
            order = MODES[r % 3:] + MODES[:r % 3]
            got = {}
            for m in order:
                got[m] = procs[m].ask(prompts=prompts, max_tokens=a.max_tokens)
            ref = got["plain"]["tokens"]
            for m in MODES:
                if got[m]["tokens"] != ref:
                    raise SystemExit(f"round {r}: the {m} engine's outputs differ from the plain engine's")
            for m in ("sync", "async"):
                saved[m] = got[m]["saved_blocks"]
            if r:
                for m in MODES:
                    tput[m].append(a.requests * a.max_tokens / got[m]["wall_s"])
                print(f"round {r}: " + "  ".join(f"{m} {tput[m][-1]:7.1f} tok/s" for m in MODES), flush=True)
    finally:
        for p in procs.values():
            p.close()
    res = {m: summary(tput[m]) for m in MODES}
    want = (a.rounds + 1) * a.requests * (a.tokens // 32)
    res.update(requests=a.requests, tokens=a.tokens, max_tokens=a.max_tokens, rounds=a.rounds,
               model=os.path.basename(model), saved_blocks=saved, expected_saved_blocks=want,
               loadavg=os.getloadavg())
    print()
    for m in MODES:
        s = res[m]
        print(f"{m:6s}: min {s['min']:7.1f}  median {s['median']:7.1f}  max {s['max']:7.1f} tok/s")
    for m in ("sync", "async"):
        res[f"{m}/plain"] = res[m]["median"] / res["plain"]["median"]
        print(f"  {m} saves / no saves (medians): {res[f'{m}/plain']:.3f}")
    print(f"  blocks saved: {saved} (every full prompt block: {want})")
    print(f"  load average: {' '.join(f'{x:.2f}' for x in res['loadavg'])}")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
