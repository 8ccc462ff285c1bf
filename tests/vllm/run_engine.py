"""One real vLLM engine (CPU backend, tiny model, greedy) in this process; writes what it did as
JSON. The engine tests (test_engine.py) run several of these as separate processes.

Usage: python run_engine.py SPEC.json OUT.json
       python run_engine.py --serve ARGS...   (vLLM's HTTP server: see ``serve``)

SPEC keys:
    model (path), prompts (list of token-id lists), max_tokens (16), tp (1; > 1 runs one worker
    process per rank, whose counters are then not in OUT), repeat (1: generate the
    prompts this many times in the same engine), max_model_len (4096), dtype ("float32"),
    connector (None | {"kv_role": ..., "extra": {...}, "policy": "fail"|"recompute",
    "by_name": bool, "multi": bool (the connector as the only child of vLLM's MultiConnector, as
    vLLM-TorchTPU runs it: its platform accepts only its own connector names, among them
    TPUMultiConnector, a MultiConnector subclass)}), remote_decode (bool: send kv_transfer_params {"do_remote_decode": true},
    i.e. act as the prefill instance of a P/D pair), params (list of kv_transfer_params per
    prompt), params_file (a producer's OUT.json: once the engine is up, wait for it and use the
    kv_transfer_params of its outputs), go_file (then wait for this file before generating),
    hold_file (producer: after writing OUT.json, keep
    serving until this file exists or hold_s passes; the tests create it once the consumer is
    done, so hold_s only guards against a test that died), hold_s (1800), prefix_caching (bool,
    default off), waves (lists of prompt indices: generate them one list after the other, so a later
    wave can hit the prefix cache an earlier one filled); pair_nonces (both-at-once, one nonce
    per prompt: a producer sends {"do_remote_decode": true, "tpu_sync_pair": nonce}; a consumer
    waits for pair_file and sends tpu_sync.vllm.compat.pair_params(its template, nonce)),
    template_file (producer: once the engine is up, write its pair_template() there), go_signal
    (create this file right before generating).

OUT: {"runs": [{"outputs": [{"token_ids", "num_cached_tokens", "finish_reason",
"kv_transfer_params", "prompt_len", "logprobs" (with spec "logprobs": each sampled token's
logprob)}], "wall_s"}], "scheduler_stats", "worker_stats",
"tier_stats", "t_engine_s", "metrics", "tpu_sync_metrics"}; metrics holds vLLM's own prefix-cache
counters (``vllm:external_prefix_cache_hits``, ``vllm:prompt_tokens_cached_by_source{source=host|p2p}``,
...), i.e. what the engine itself reports about the connector's hits, and the connector's own
``vllm:tpu_sync_*`` metrics (histograms as ``_count``/``_sum``); tpu_sync_metrics is the
library's Prometheus text (``tpu_sync.metrics()``) at the end.

Environment: HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 (one
process: the tests read the connector's counters from both sides) VLLM_CPU_KVCACHE_SPACE=1.
"""

import json
import os
import sys
import time

# The fork server (tests/zygote.py) imports these once; its children skip them. Modules vLLM
# imports lazily while it builds a CPU engine of a Llama model are among them.
ZYGOTE_PREIMPORT = (
    "torch", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.llama", "vllm.model_executor.models.gemma2",
    "vllm.v1.attention.backends.cpu_attn", "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.kv_transfer.kv_connector.v1.base", "transformers", "safetensors.torch",
    # --serve: the HTTP server and the async engine client.
    "vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.api_server.entry", "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core_client", "uvicorn", "fastapi",
)
# vLLM's variables read at import time (besides the fork server's own list).
ZYGOTE_IMPORT_TIME_ENV = ("VLLM_LOGGING", "VLLM_CONFIGURE_LOGGING")


def unwrap(c):
    """Our connector itself when ``c`` is a MultiConnector holding it (``spec["connector"]["multi"]``)."""
    for child in getattr(c, "_connectors", None) or ():
        if hasattr(child, "scheduler_side"):
            return child
    return c


def connectors(llm):
    """The scheduler-side and worker-side connectors (in-process engine only)."""
    sched = None
    try:
        sched = unwrap(llm.llm_engine.engine_core.engine_core.scheduler.connector)
    except AttributeError:
        pass
    worker = None
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            worker = unwrap(get_kv_transfer_group())
    except Exception:
        pass
    return sched, worker


def wait_for(path: str, what: str, limit_s: float = 600) -> None:
    """Waits for another process's file (``SystemExit`` after ``limit_s``)."""
    deadline = time.time() + limit_s
    while not os.path.exists(path):
        if time.time() > deadline:
            raise SystemExit(f"no {what} at {path}")
        time.sleep(0.05)


def fork_engine_processes() -> None:
    """Starts the processes vLLM starts for an engine (a TP > 1 engine's workers, an API
    server's engine core) with ``fork`` instead of ``spawn``.

    vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` in its
    ``check_and_update_config``, so each of them imports torch and vLLM again (20-25 s on 2
    cores; a TP=2 P/D test took 46-56 s, 12-16 s with ``fork``). ``fork`` is vLLM's own default
    elsewhere; what a child must not inherit is a used OpenMP thread pool, and this process (a
    fork of the zygote, which ran no torch operation) has run none either when it starts them:
    the model is loaded and run only in them. TP workers still bind their OpenMP threads to
    their own cores (``VLLM_CPU_OMP_THREADS_BIND``), as after ``spawn``.
    ``TPU_SYNC_VLLM_SPAWN_WORKERS=1`` keeps vLLM's ``spawn``."""
    if os.environ.get("TPU_SYNC_VLLM_SPAWN_WORKERS") == "1":
        return
    from vllm.platforms import cpu

    original = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def serve(args: list) -> None:
    """``run_engine.py --serve ARGS``: vLLM's OpenAI-compatible HTTP server, as ``python -m
    vllm.entrypoints.openai.api_server ARGS`` runs it, in this process (through the zygote, so it
    skips the import; its engine core forked, see :func:`fork_engine_processes`)."""
    fork_engine_processes()
    # What the module's ``__main__`` block runs (vLLM 0.29 and 0.32).
    from vllm.entrypoints.launchers.api_server.entry import main as serve_main

    sys.argv = ["vllm.entrypoints.openai.api_server"] + list(args)
    serve_main()


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2:])
        return
    spec = json.load(open(sys.argv[1]))
    out_path = sys.argv[2]
    from vllm import LLM, SamplingParams

    kw = dict(model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
              max_model_len=spec.get("max_model_len", 4096), max_num_seqs=4,
              max_num_batched_tokens=spec.get("max_model_len", 4096), block_size=32,
              enable_prefix_caching=bool(spec.get("prefix_caching")), seed=0, distributed_executor_backend="uni",
              disable_log_stats=False)
    if spec.get("tp", 1) > 1:
        # One worker process per TP rank (bind them to cores with VLLM_CPU_OMP_THREADS_BIND).
        kw.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
        fork_engine_processes()
    c = spec.get("connector")
    if c:
        ktc = dict(kv_connector="TpuSyncConnector", kv_role=c["kv_role"],
                   kv_connector_extra_config=c.get("extra", {}),
                   kv_load_failure_policy=c.get("policy", "recompute"))
        if not c.get("by_name"):
            ktc["kv_connector_module_path"] = "tpu_sync.vllm"
        if c.get("multi"):
            child = {k: v for k, v in ktc.items() if k != "kv_load_failure_policy"}
            ktc = dict(kv_connector="MultiConnector", kv_role=c["kv_role"],
                       kv_connector_extra_config={"connectors": [child]},
                       kv_load_failure_policy=ktc["kv_load_failure_policy"])
        kw["kv_transfer_config"] = ktc
    t0 = time.time()
    llm = LLM(**kw)
    t_engine = time.time() - t0
    sched, worker = connectors(llm)
    prompts = [{"prompt_token_ids": list(p)} for p in spec["prompts"]]
    params = spec.get("params")
    if spec.get("template_file"):
        deadline = time.time() + 60
        while sched.scheduler_side.pair_template() is None and time.time() < deadline:
            time.sleep(0.05)
        tmp = spec["template_file"] + ".tmp"
        json.dump(sched.scheduler_side.pair_template(), open(tmp, "w"))
        os.replace(tmp, spec["template_file"])
    if spec.get("pair_file"):
        from tpu_sync.vllm.compat import pair_params

        wait_for(spec["pair_file"], "producer template")
        template = json.load(open(spec["pair_file"]))
        params = [pair_params(template, n) for n in spec["pair_nonces"]]
    if spec.get("params_file"):
        wait_for(spec["params_file"], "producer output")
        produced = json.load(open(spec["params_file"]))
        params = [o["kv_transfer_params"] for o in produced["runs"][0]["outputs"]]
    if spec.get("go_file"):
        wait_for(spec["go_file"], "go file")
    if spec.get("go_signal"):
        open(spec["go_signal"], "w").close()
    runs = []
    lp = 0 if spec.get("logprobs") else None
    for _ in range(spec.get("repeat", 1)):
        if spec.get("remote_decode"):
            nonces = spec.get("pair_nonces") or [None] * len(prompts)
            sps = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=lp,
                                  extra_args={"kv_transfer_params": dict(
                                      {"do_remote_decode": True}, **({"tpu_sync_pair": n} if n else {}))})
                   for n in nonces]
        elif params:
            sps = [SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True, logprobs=lp,
                                  extra_args={"kv_transfer_params": dict(p)} if p else None)
                   for p in params]
        else:
            sps = [SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True, logprobs=lp)
                   for _ in prompts]
        outs = []
        t1 = time.time()
        if spec.get("waves"):
            # Prompts in waves, one generate call each (a later wave's requests can hit the
            # prefix cache of an earlier one's); outputs in prompt order.
            by_index = {}
            for wave in spec["waves"]:
                got = llm.generate([prompts[i] for i in wave], [sps[i] for i in wave], use_tqdm=False)
                by_index.update(zip(wave, got))
            res = [by_index[i] for i in range(len(prompts))]
        else:
            res = llm.generate(prompts, sps, use_tqdm=False)
        wall = time.time() - t1
        for o in res:
            outs.append(dict(prompt_len=len(o.prompt_token_ids), token_ids=list(o.outputs[0].token_ids),
                             num_cached_tokens=o.num_cached_tokens, finish_reason=o.outputs[0].finish_reason,
                             kv_transfer_params=o.kv_transfer_params))
            if spec.get("logprobs"):
                # The sampled token's logprob at each position (SamplingParams(logprobs=0)).
                outs[-1]["logprobs"] = [float(d[t].logprob)
                                        for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])]
        runs.append(dict(outputs=outs, wall_s=round(wall, 3)))
    if sched is not None and sched.scheduler_side is not None:
        # Finished requests hold their blocks until the workers registered them with the
        # endpoint (prefill requests) or saved them to the host tier (async saves): step the
        # engine until that happened, so the counters below are final.
        deadline = time.time() + 30
        while sched.scheduler_side.pending_frees() and time.time() < deadline:
            llm.llm_engine.step()
    metrics = {}
    for m in llm.get_metrics():
        if ("prefix_cache" in m.name or "by_source" in m.name or m.name.startswith("vllm:kv")
                or m.name.startswith("vllm:tpu_sync")):
            labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name"))
            key = m.name + ("{" + labels + "}" if labels else "")
            value = getattr(m, "value", None)
            if isinstance(value, (int, float)):
                metrics[key] = value
            elif isinstance(getattr(m, "count", None), (int, float)):  # a histogram
                metrics[m.name + "_count" + key[len(m.name):]] = m.count
                metrics[m.name + "_sum" + key[len(m.name):]] = m.sum
    tpu_sync_metrics = None
    if c:
        import tpu_sync

        tpu_sync_metrics = tpu_sync.metrics()
    res = dict(runs=runs, t_engine_s=round(t_engine, 2), metrics=metrics, tpu_sync_metrics=tpu_sync_metrics,
               scheduler_stats=dict(sched.scheduler_side.stats) if sched is not None and sched.scheduler_side else None,
               worker_stats=dict(worker.worker_side.stats) if worker is not None and worker.worker_side else None)
    try:
        res["adapter_stats"] = worker.worker_side.adapter_stats
    except Exception as e:  # no worker in this process (tp > 1)
        res["adapter_stats"] = {"error": str(e)}
    try:
        res["tier_stats"] = worker.worker_side.tier.stats() if worker.worker_side.tier is not None else None
    except Exception as e:  # no worker in this process (tp > 1), or no tier
        res["tier_stats"] = {"error": str(e)}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, default=str)
    os.replace(tmp, out_path)
    print("RESULT " + json.dumps(res, default=str)[:2000], flush=True)
    hold = spec.get("hold_file")
    if hold:
        # Only a guard against a test that died: under load a consumer's start-up alone has
        # taken 155 s (a TP=2 engine beside another suite), so 120 s let a producer go away
        # before the consumer's pull.
        deadline = time.time() + spec.get("hold_s", 1800)
        while not os.path.exists(hold) and time.time() < deadline:
            time.sleep(0.05)
    if worker is not None:
        worker.shutdown()
    del llm


if __name__ == "__main__":  # vLLM may spawn processes: keep the guard
    main()
