"""Runs one real SGLang engine (offline ``sglang.Engine``, CPU) from a JSON spec and writes a JSON
result. Usage: ``python run_engine.py SPEC.json OUT.json``.

Spec: ``model``, ``engine`` (extra Engine kwargs), ``env`` (set before SGLang starts), ``steps``:
a list of ``{"generate": [[token ids], ...]}`` (greedy, ``max_tokens`` each, one request after
the other), ``{"wait_file": path}`` (waits until the file exists: the test does something
meanwhile), ``{"mark": path}`` (creates a file: tells the test a point was reached),
``{"sleep": s}``, ``{"generate_pd": [{"ids": [...], "room": r, "port": p}, ...]}`` (P/D: the
requests at once, each with its bootstrap room and the bootstrap port of its prefill engine on
127.0.0.1; a request that fails is recorded with its ``error``). Result: ``steps`` with, per
generated prompt, ``output_ids``, ``cached_tokens``, ``cached_tokens_details`` and
``finish_reason``.
"""

import asyncio
import json
import os
import sys
import time

# The fork server (tests/zygote.py) imports these once; its children, and through
# :func:`zygote_child` the engines' scheduler and detokenizer processes, skip them.
ZYGOTE_PREIMPORT = (
    "torch", "transformers", "sglang", "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.models.llama", "sglang.srt.model_executor.model_runner",
    "sglang.srt.mem_cache.hiradix_cache", "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode", "safetensors.torch",
)
# SGLang reads its own variables when it uses them (sglang.srt.environ), not at import time.
ZYGOTE_IMPORT_TIME_ENV = ()


def zygote_child() -> None:
    """In an engine forked by the fork server: SGLang starts its scheduler and detokenizer
    processes with multiprocessing's ``spawn`` (``_set_envs_and_config``), and each of them
    would import torch and SGLang again (about 30 s of CPU each); they are forked from this
    process instead, which has imported everything and run no torch operation when it starts
    them. Everything else about them is SGLang's own (same targets, arguments and pipes)."""
    import multiprocessing as mp

    import sglang.srt.entrypoints.engine as engine

    original = engine._set_envs_and_config

    def _set_envs_and_config(*args, **kwargs):
        original(*args, **kwargs)
        mp.set_start_method("fork", force=True)

    engine._set_envs_and_config = _set_envs_and_config


def _record(o):
    mi = o.get("meta_info", {})
    return dict(output_ids=o.get("output_ids"), cached_tokens=mi.get("cached_tokens"),
                cached_tokens_details=mi.get("cached_tokens_details"), finish_reason=str(mi.get("finish_reason")))


def generate_pd(llm, reqs, sp):
    """Sends every request at once (the prefill and the decode engine of a pair must both have
    it); returns one record per request, in order."""

    async def one(r):
        t0 = time.time()
        try:
            o = await llm.async_generate(input_ids=list(r["ids"]), sampling_params=sp, bootstrap_host="127.0.0.1",
                                         bootstrap_port=int(r["port"]), bootstrap_room=int(r["room"]))
            return dict(_record(o), elapsed_s=round(time.time() - t0, 1))
        except Exception as e:  # a failed request is a result, not a crash of the runner
            return dict(error=f"{type(e).__name__}: {e}", elapsed_s=round(time.time() - t0, 1))

    async def all_of():
        return await asyncio.gather(*(one(r) for r in reqs))

    return llm.loop.run_until_complete(all_of())


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    out_path = sys.argv[2]
    os.environ.update(spec.get("env", {}))
    import sglang as sgl

    kw = dict(model_path=spec["model"], tokenizer_path=spec["model"], device="cpu", dtype="float32",
              attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
              page_size=16, max_total_tokens=2048, max_running_requests=4, chunked_prefill_size=512,
              context_length=1024, random_seed=0, log_level="info", skip_server_warmup=True)
    kw.update(spec.get("engine", {}))
    t0 = time.time()
    llm = sgl.Engine(**kw)
    res = dict(engine_start_s=round(time.time() - t0, 1), steps=[])
    sp = dict(temperature=0.0, max_new_tokens=int(spec.get("max_tokens", 8)), ignore_eos=True)
    try:
        for step in spec["steps"]:
            if "generate" in step:
                outs = []
                for ids in step["generate"]:
                    outs.append(_record(llm.generate(input_ids=list(ids), sampling_params=sp)))
                    time.sleep(float(spec.get("pause_s", 1.0)))  # let write-through reach L2/L3
                res["steps"].append(dict(outputs=outs))
            elif "generate_pd" in step:
                res["steps"].append(dict(outputs=generate_pd(llm, step["generate_pd"], sp)))
            elif "wait_file" in step:
                deadline = time.time() + 1500
                while not os.path.exists(step["wait_file"]) and time.time() < deadline:
                    time.sleep(0.2)
                res["steps"].append({})
            elif "mark" in step:
                open(step["mark"], "w").close()
                res["steps"].append({})
            elif "sleep" in step:
                time.sleep(float(step["sleep"]))
                res["steps"].append({})
    finally:
        tmp = out_path + ".tmp"
        json.dump(res, open(tmp, "w"))
        os.replace(tmp, out_path)
        llm.shutdown()


if __name__ == "__main__":
    main()
