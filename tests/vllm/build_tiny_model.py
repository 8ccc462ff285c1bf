"""Builds a tiny random-weight Llama and a byte-level BPE tokenizer trained on local text, for
engine tests without the Hugging Face hub.

Usage: python build_tiny_model.py OUT_DIR [--layers N] [--max-len TOKENS] [--hidden H --heads Q
       --kv-heads K --head-dim D --intermediate I]

Shape constraints of vLLM's CPU attention backend (``docs/plugins-and-engines.md``, "vLLM CPU
backend: KV cache shape and model constraints"):
head size in {32, 64, 80, ...} and blocks a multiple of 32 tokens; this model has 2 KV heads of 32
and 4 query heads by default. Weights are N(0, 0.2) so greedy output is not constant. Deterministic (seeded).
"""

import argparse
import glob
import os


def corpus():
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:50]
    for f in files:
        with open(f, encoding="utf-8", errors="ignore") as fh:
            yield fh.read()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=4096, help="max_position_embeddings")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=256)
    a = ap.parse_args()
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            model_max_length=a.max_len).save_pretrained(a.out)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.head_dim,
                      max_position_embeddings=a.max_len, rms_norm_eps=1e-5, bos_token_id=bos,
                      eos_token_id=tok.token_to_id("</s>"), pad_token_id=tok.token_to_id("<pad>"),
                      tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2 * (128 / a.hidden) ** 0.5)
    model.save_pretrained(a.out, safe_serialization=True)
    print(f"tiny model in {a.out}: {a.layers} layers, vocab {tok.get_vocab_size()}, max_len {a.max_len}")


if __name__ == "__main__":
    main()
