"""Builds tiny random-weight hybrid models (several vLLM KV cache groups) for the connector's
engine tests, without the Hugging Face hub: the tiny Llama of ``build_tiny_model.py`` (same
tokenizer and weights) with a different ``config.json``, or a Mamba2 hybrid.

Usage: python build_tiny_hybrid.py OUT_DIR --kind sliding|granite [--window TOKENS] [--base TINY_LLAMA_DIR]

* ``sliding``: the tiny Llama with ``layer_types`` ``[sliding_attention, full_attention]`` and
  ``sliding_window`` (vLLM's Llama reads both, ``vllm/model_executor/models/llama.py``): a
  sliding-window group and a full-attention group.
* ``granite``: a 2-layer ``GraniteMoeHybridForCausalLM`` (granite-4.0-h style, dense: Mamba2
  layer 0, attention layer 1): a Mamba state group and a full-attention group. (vLLM 0.32
  dropped ``BambaForCausalLM``.)

Deterministic (seeded); weights N(0, 0.2).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--kind", choices=["sliding", "granite"], required=True)
    ap.add_argument("--window", type=int, default=48)
    ap.add_argument("--base", help="a tiny model built by build_tiny_model.py with --layers 2 --max-len 4096, "
                                   "copied instead of building one")
    a = ap.parse_args()
    # Built in a scratch directory renamed into place at the end: an interrupted build never
    # leaves a directory that looks like a model (the tiny Llama's files under a hybrid's name).
    final, a.out = a.out, a.out.rstrip("/") + ".partial"
    shutil.rmtree(a.out, ignore_errors=True)
    if a.base and os.path.exists(os.path.join(a.base, "config.json")):
        shutil.copytree(a.base, a.out)
    else:
        subprocess.run([sys.executable, os.path.join(HERE, "build_tiny_model.py"), a.out, "--layers", "2",
                        "--max-len", "4096"], check=True)
    build(a)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(a.out, final)
    print(f"-> {final}")


def build(a) -> None:
    """Turns the tiny Llama in ``a.out`` into the ``a.kind`` model."""
    path = os.path.join(a.out, "config.json")
    cfg = json.load(open(path))
    if a.kind == "sliding":
        cfg["layer_types"] = ["sliding_attention", "full_attention"]
        cfg["sliding_window"] = a.window
        json.dump(cfg, open(path, "w"), indent=1)
        print(f"sliding-window model in {a.out}: window {a.window}")
        return
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    # granite-4.0-h-micro style (dense: no routed experts, a shared MLP), scaled down.
    bc = GraniteMoeHybridConfig(vocab_size=cfg["vocab_size"], hidden_size=128, intermediate_size=256,
                                shared_intermediate_size=256, num_local_experts=0, num_experts_per_tok=0,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=64,
                                mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                                mamba_chunk_size=64, position_embedding_type="rope", max_position_embeddings=4096,
                                bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"],
                                pad_token_id=cfg["pad_token_id"], tie_word_embeddings=False, torch_dtype="float32")
    model = GraniteMoeHybridForCausalLM(bc)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    for f in os.listdir(a.out):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(a.out, f))
    model.save_pretrained(a.out, safe_serialization=True)
    print(f"granite-4.0-h style hybrid in {a.out}")


if __name__ == "__main__":
    main()
