"""Runs one real SGLang engine (offline ``sglang.Engine``, CPU) from a JSON spec and writes a JSON
result. Usage: ``python run_engine.py SPEC.json OUT.json``.

Spec: ``model``, ``engine`` (extra Engine kwargs), ``env`` (set before SGLang starts), ``steps``:
a list of ``{"generate": [[token ids], ...]}`` (greedy, ``max_tokens`` each, one request after
the other), ``{"wait_file": path}`` (waits until the file exists: the test does something
meanwhile), ``{"mark": path}`` (creates a file: tells the test a point was reached),
``{"sleep": s}``. Result: ``steps`` with, per generated prompt, ``output_ids``,
``cached_tokens`` and ``cached_tokens_details``.
"""

import json
import os
import sys
import time


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
                    o = llm.generate(input_ids=list(ids), sampling_params=sp)
                    mi = o.get("meta_info", {})
                    outs.append(dict(output_ids=o.get("output_ids"), cached_tokens=mi.get("cached_tokens"),
                                     cached_tokens_details=mi.get("cached_tokens_details"),
                                     finish_reason=str(mi.get("finish_reason"))))
                    time.sleep(float(spec.get("pause_s", 1.0)))  # let write-through reach L2/L3
                res["steps"].append(dict(outputs=outs))
            elif "wait_file" in step:
                deadline = time.time() + 600
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
