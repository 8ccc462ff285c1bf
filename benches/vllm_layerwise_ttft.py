"""TTFT with and without layer pipelining (``layerwise``), in real vLLM engines at 2,000 tokens.

Two measurements, each interleaving the two modes round-robin over several rounds on the same
engines (the connector's ``layerwise`` setting is switched between requests, so both modes see
the same engines, caches and machine load), min/median/max and the ratio of the medians:

* **P/D**: a producer engine (``kv_producer``) and a consumer engine (``kv_consumer``), each in
  its own process, like a proxy in front of them: the prefill request (``max_tokens=1``,
  ``do_remote_decode``) goes to the producer, its ``kv_transfer_params`` to the consumer
  (``max_tokens=1``). TTFT = from sending the prefill request to the consumer's first token.
  Whole-request mode: the producer registers (stages) the request in the engine step after it
  finished; the consumer pulls asynchronously and schedules the request once every layer
  arrived. Layer-wise mode: the producer registered the request before the prefill's forward
  and staged each layer as vLLM saved it; the consumer schedules the request at once and its
  forward waits for each layer. The producer process keeps stepping its engine after answering,
  as a serving engine does. Interleaved with them, ``local``: the same prompt length computed
  by the prefill engine alone (no transfer), the single-engine TTFT that P/D is compared with;
  and per P/D request the producer's prefill (prefill request sent -> answered), the consumer's
  part (params sent -> first token) and the pull's own time (the consumer worker's ``pull_us``).
* **P/D both at once** (``--both``): the prompt goes to the producer and the consumer at the
  same time (``tpu_sync_pair``, as ``examples/vllm/proxy.py --both-at-once`` sends it), so the
  consumer asks for the producer's registration and pulls while the prefill runs. TTFT = from
  sending both to the consumer's first token; whole mode: the producer registers the request in
  the step that prefills it and stages every layer after the forward; layer-wise: each layer is
  staged and published as vLLM saves it, so the pull of layer ``l`` overlaps the compute of
  layer ``l + 1``. Reported: layer-wise / whole TTFT, and the consumer's time after the
  producer answered in each mode (their difference is the transfer hidden behind the prefill).
* **Offload**: one ``kv_both`` engine; each round prefills a fresh prompt (saved to the host
  tier), then loads it from the tier twice (vLLM's own prefix cache is off), once with
  synchronous loads in ``start_load_kv`` and once with layer-wise loads, alternating which goes
  first. TTFT = the wall time of a ``max_tokens=1`` request.

Greedy tokens of every mode are compared with each other (they must be equal).

Usage (vLLM virtualenv; ``make bench-vllm-layerwise``):
    python benches/vllm_layerwise_ttft.py [--tokens 2000] [--rounds 5] [--part pd|offload|all]
        [--both] [--layers 8] [--hidden 512] [--json FILE]

The model is the one of ``benches/vllm_ttft.py`` (random weights, 8 layers, hidden 512, built
once under target/vllm-bench/). Timings depend on the machine and its load; the ratios are the
result.
"""

import argparse
import dataclasses
import json
import os
import random
import sys
import time

from vllm_bench_engines import ENV, ROOT, answer_channel, common_args, ensure_model, summary
from vllm_bench_engines import Proc as _Proc


def Proc(role, model, max_len):
    return _Proc(__file__, [role, "--model", model, "--max-len", str(max_len)])


def build_llm(model, max_len, role, extra):
    from vllm import LLM

    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=max_len, max_num_seqs=4,
               max_num_batched_tokens=max_len, block_size=32, enable_prefix_caching=False, seed=0,
               distributed_executor_backend="uni",
               kv_transfer_config=dict(kv_connector="TpuSyncConnector", kv_connector_module_path="tpu_sync.vllm",
                                       kv_role=role, kv_load_failure_policy="fail" if role != "kv_both" else
                                       "recompute", kv_connector_extra_config=extra))


def set_layerwise(llm, on):
    """Switches the connector's ``layerwise`` setting on both sides (in-process engine)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group()
    for conn in (sched, worker):
        conn.config = dataclasses.replace(conn.config, layerwise=on)
        for side in (conn.scheduler_side, conn.worker_side):
            if side is not None:
                side.cfg = conn.config
    return sched


def serve(role, model, max_len):
    """A producer or consumer process: JSON commands on stdin, one JSON answer per line."""
    out = answer_channel()
    from vllm import SamplingParams

    llm = build_llm(model, max_len, role, dict(pull_timeout_s=60.0, lease_s=120.0))
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        if cmd.get("op") == "template":
            # The producer's part of both-at-once params (its addresses, geometry, block count).
            sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
            print(json.dumps({"template": sched.scheduler_side.pair_template()}), file=out, flush=True)
            continue
        sched = set_layerwise(llm, bool(cmd["layerwise"]))
        if cmd.get("local"):
            sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # computed here alone
        elif role == "kv_producer":
            params = {"do_remote_decode": True}
            if cmd.get("nonce"):
                params["tpu_sync_pair"] = cmd["nonce"]  # both at once
            sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                extra_args={"kv_transfer_params": params})
        else:
            sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                extra_args={"kv_transfer_params": cmd["params"]})
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        wst = get_kv_transfer_group().worker_side.stats
        pull_us = wst.get("pull_us", 0)
        describe_us = wst.get("describe_us", 0)
        t = time.perf_counter()
        cpu = time.process_time()
        o = llm.generate([{"prompt_token_ids": cmd["prompt"]}], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t
        print(json.dumps({"tokens": list(o.outputs[0].token_ids), "params": o.kv_transfer_params,
                          "cached": o.num_cached_tokens, "engine_s": dt, "t_done": time.time(),
                          "cpu_s": time.process_time() - cpu,
                          "pull_s": (wst.get("pull_us", 0) - pull_us) / 1e6,
                          "describe_s": (wst.get("describe_us", 0) - describe_us) / 1e6}), file=out, flush=True)
        if role == "kv_producer":
            # A serving engine keeps stepping: registration (whole mode) and block frees.
            deadline = time.time() + 30
            while sched.scheduler_side.pending_sends() and time.time() < deadline:
                llm.llm_engine.step()


def fmt(s):
    return f"min {s['min'] * 1e3:7.1f}  median {s['median'] * 1e3:7.1f}  max {s['max'] * 1e3:7.1f} ms"


def bench_pd(a, model, max_len, rng):
    """P/D whole and layer-wise, in the proxy's order (prefill first, then the decode request
    with its params) and both at once (``--both``: the prompt to both engines at the same time,
    ``tpu_sync_pair``), and the same prompt length computed by the prefill engine alone
    (``local``, no transfer: the single-engine TTFT), interleaved; per P/D request also the
    producer's prefill (prefill request sent -> answered), the consumer's part after it (-> first
    token) and the pull's own time (the consumer's ``pull_us``)."""
    from tpu_sync.vllm.compat import pair_params

    prod = Proc("kv_producer", model, max_len)
    cons = Proc("kv_consumer", model, max_len)
    modes = ["local", ("seq", False), ("seq", True)]
    if a.both:
        modes += [("both", False), ("both", True)]
    times = {m: [] for m in modes}
    prefill = {m: [] for m in modes[1:]}
    consumer = {m: [] for m in modes[1:]}
    pull = {m: [] for m in modes[1:]}
    template = prod.ask(op="template")["template"] if a.both else None
    try:
        for r in range(a.rounds + 1):  # round 0 warms every mode
            k = r % len(modes)
            for m in modes[k:] + modes[:k]:
                prompt = [rng.randrange(3, 1000) for _ in range(a.tokens)]
                t = time.perf_counter()
                t_wall = time.time()
                if m == "local":
                    # On the prefill engine: the same engine, the same neighbour (the decode
                    # engine, idle after its last request) as the P/D prefill.
                    c = prod.ask(prompt=prompt, local=True, layerwise=False)
                    dt = time.perf_counter() - t
                    if r:
                        times[m].append(dt)
                        print(f"pd round {r} local          : TTFT {dt * 1e3:7.1f} ms", flush=True)
                    continue
                order, lw = m
                if order == "seq":
                    p = prod.ask(prompt=prompt, layerwise=lw)
                    tp = time.perf_counter() - t
                    c = cons.ask(prompt=prompt, params=p["params"], layerwise=lw)
                    dt = time.perf_counter() - t
                else:
                    nonce = f"bench-{r}-{rng.randrange(1 << 62):016x}"
                    prod.send(prompt=prompt, layerwise=lw, nonce=nonce)
                    cons.send(prompt=prompt, params=pair_params(template, nonce), layerwise=lw)
                    p = prod.read()
                    c = cons.read()
                    tp, dt = p["t_done"] - t_wall, c["t_done"] - t_wall
                    if (p["params"] or {}).get("tpu_sync_pair") != nonce:
                        raise SystemExit(f"round {r}: the producer did not take the both-at-once nonce")
                if c["tokens"] != p["tokens"]:
                    raise SystemExit(f"round {r}: consumer token {c['tokens']} != producer's {p['tokens']}")
                if r:
                    times[m].append(dt)
                    prefill[m].append(tp)
                    consumer[m].append(dt - tp)
                    pull[m].append(c["pull_s"])
                    print(f"pd round {r} {order:4s} {'layerwise' if lw else 'whole    '}: TTFT {dt * 1e3:7.1f} ms = "
                          f"prefill {tp * 1e3:7.1f} + consumer {(dt - tp) * 1e3:7.1f} (pull {c['pull_s'] * 1e3:6.1f}) "
                          f"ms (consumer cached {c['cached']}"
                          + (f", registration found after {c['describe_s'] * 1e3:.1f} ms)" if order == "both" else ")")
                          + f"; CPU s: producer {p['cpu_s']:.2f}, consumer {c['cpu_s']:.2f}",
                          flush=True)
    finally:
        prod.close()
        cons.close()
    out = {"local": summary(times["local"])}
    for m in modes[1:]:
        name = ("both_" if m[0] == "both" else "") + ("layerwise" if m[1] else "whole")
        out[name] = summary(times[m])
        out[name + "_prefill"] = summary(prefill[m])
        out[name + "_consumer"] = summary(consumer[m])
        out[name + "_pull"] = summary(pull[m])
    return out


def bench_offload(a, model, max_len, rng):
    from vllm import SamplingParams

    llm = build_llm(model, max_len, "kv_both", dict(host_capacity_bytes=1 << 30))
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ttft(prompt, lw):
        set_layerwise(llm, lw)
        t = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t, o

    times = {False: [], True: [], "miss": []}
    for r in range(a.rounds + 1):
        prompt = [rng.randrange(3, 1000) for _ in range(a.tokens)]
        t_miss, o_miss = ttft(prompt, False)
        order = [False, True] if r % 2 == 0 else [True, False]
        for lw in order:
            t, o = ttft(prompt, lw)
            if o.num_cached_tokens < (a.tokens - 1) // 32 * 32:
                raise SystemExit(f"round {r}: no host-tier hit ({o.num_cached_tokens} tokens)")
            if list(o.outputs[0].token_ids) != list(o_miss.outputs[0].token_ids):
                raise SystemExit(f"round {r}: loaded output differs from the recomputed one")
            if r:
                times[lw].append(t)
                print(f"offload round {r} {'layerwise' if lw else 'sync     '}: TTFT {t * 1e3:7.1f} ms", flush=True)
        if r:
            times["miss"].append(t_miss)
    return {"sync": summary(times[False]), "layerwise": summary(times[True]), "recomputed": summary(times["miss"])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--part", choices=("pd", "offload", "all"), default="all")
    ap.add_argument("--both", action="store_true",
                    help="P/D also with the prompt sent to both engines at once (tpu_sync_pair), whole and layer-wise")
    a = common_args(ap).parse_args()
    os.environ.update(ENV)
    model = a.model or os.path.join(ROOT, "target", "vllm-bench", f"llama-L{a.layers}-H{a.hidden}")
    max_len = a.max_len or max(4096, a.tokens + 64)
    if a.serve:
        serve(a.serve, model, max_len)
        return
    ensure_model(model, a.layers, a.hidden, max_len)
    rng = random.Random(7)
    res = {"tokens": a.tokens, "rounds": a.rounds, "model": os.path.basename(model)}
    if a.part in ("pd", "all"):
        res["pd"] = bench_pd(a, model, max_len, rng)
    if a.part in ("offload", "all"):
        res["offload"] = bench_offload(a, model, max_len, rng)
    print()
    if "pd" in res:
        d = res["pd"]
        print(f"single-engine TTFT       : {fmt(d['local'])}")
        names = ["whole", "layerwise"] + (["both_whole", "both_layerwise"] if "both_whole" in d else [])
        for name in names:
            print(f"P/D TTFT, {name:15s}: {fmt(d[name])}")
            print(f"  producer prefill       : {fmt(d[name + '_prefill'])}")
            print(f"  consumer (to 1st token): {fmt(d[name + '_consumer'])}")
            print(f"  pull                   : {fmt(d[name + '_pull'])}")
            # Per round TTFT - prefill (the consumer's part), then its median: a difference of
            # two medians taken from different rounds mixes rounds of different load.
            over = d[name + "_consumer"]["median"]
            print(f"  P/D / single engine (medians): {d[name]['median'] / d['local']['median']:.2f}"
                  + ("" if name.startswith("both") else
                     f"; (P/D - prefill) / pull (medians of rounds): {over / max(d[name + '_pull']['median'], 1e-9):.1f}"))
        print(f"  whole / layer-wise (medians): {d['whole']['median'] / d['layerwise']['median']:.2f}")
        if "both_whole" in d:
            bw, bl = d["both_whole"]["median"], d["both_layerwise"]["median"]
            tw, tl = d["both_whole_consumer"]["median"], d["both_layerwise_consumer"]["median"]
            print(f"  both at once: layer-wise / whole TTFT (medians): {bl / bw:.2f}; the consumer's time after the "
                  f"producer answered: whole {tw * 1e3:.1f} ms, layer-wise {tl * 1e3:.1f} ms (transfer hidden behind "
                  f"the prefill: {(tw - tl) * 1e3:.1f} ms); layer-wise both at once / single engine: "
                  f"{bl / d['local']['median']:.2f}")
    if "offload" in res:
        d = res["offload"]
        print(f"offload TTFT, recomputed : {fmt(d['recomputed'])}")
        print(f"offload TTFT, sync loads : {fmt(d['sync'])}")
        print(f"offload TTFT, layer-wise : {fmt(d['layerwise'])}")
        print(f"  sync / layer-wise (medians): {d['sync']['median'] / d['layerwise']['median']:.2f}")
    res["loadavg"] = os.getloadavg()
    print(f"load average: {' '.join(f'{x:.2f}' for x in res['loadavg'])}")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
