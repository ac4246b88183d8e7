#!/usr/bin/env python3
"""Builds the Transformers parity fixtures of the embedded engine.

For each of Qwen3, Qwen2 and Llama this makes a small random model (bf16 weights, tiny sizes so
all fixtures together stay well under 2 MB), saves it with save_pretrained (safetensors) into
tests/engine/fixtures/<arch>/, and records in expected.json, for several token-id prompts of
different lengths, Transformers' greedy continuation (24 new tokens) and the top-5 logprobs of
every step, computed in float32 on the CPU, plus the top-1/top-2 logprob margin of every step (the
C++ test compares steps only up to the first margin under 1e-3).

Usage: python3 tests/engine/make_parity_fixture.py [--out tests/engine/fixtures] [--seed 0]
Needs: torch, transformers (any recent version with Qwen3 support, >= 4.51).
The C++ side is tests/engine/parity_test.cc (ctest label e2e, binary engine_e2e_test).
"""
import argparse
import json
import math
import os

import torch
import transformers

NEW_TOKENS = 24
PROMPT_LENGTHS = [1, 5, 17, 40]
VOCAB = 512


def configs():
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return {
        "qwen3": transformers.Qwen3Config(head_dim=16, rope_theta=1000000.0, tie_word_embeddings=False, **common),
        # Qwen2 always has q/k/v biases; tied like Qwen2.5-0.5B.
        "qwen2": transformers.Qwen2Config(rope_theta=10000.0, tie_word_embeddings=True, **common),
        "llama": transformers.LlamaConfig(head_dim=16, rope_theta=500000.0, tie_word_embeddings=False,
                                          attention_bias=False, mlp_bias=False, **common),
    }


def model_class(arch):
    return {
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "llama": transformers.LlamaForCausalLM,
    }[arch]


def reinit(model, gen):
    """Weights with O(1) logits so greedy steps have clear margins (HF's 0.02 init is near uniform)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def greedy(model, prompt):
    ids = torch.tensor([prompt], dtype=torch.long)
    tokens, top5, margins = [], [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=ids).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            vals, idx = torch.topk(lp, 5)
            nxt = int(idx[0])
            tokens.append(nxt)
            top5.append([[int(i), float(v)] for v, i in zip(vals, idx)])
            margins.append(float(vals[0] - vals[1]))
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tokens, top5, margins


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for k, (arch, cfg) in enumerate(configs().items()):
        gen = torch.Generator().manual_seed(args.seed * 1000 + k)
        cfg.torch_dtype = torch.float32
        model = model_class(arch)(cfg).eval()
        reinit(model, gen)
        out = os.path.join(args.out, arch)
        os.makedirs(out, exist_ok=True)
        # Stored as bf16; the reference then runs on exactly those bf16 values, in float32.
        model = model.to(torch.bfloat16)
        model.generation_config.eos_token_id = None
        model.save_pretrained(out, safe_serialization=True)
        ref = model_class(arch).from_pretrained(out, torch_dtype=torch.float32, attn_implementation="eager").eval()
        prompt_gen = torch.Generator().manual_seed(args.seed * 1000 + 100 + k)
        cases = []
        for n in PROMPT_LENGTHS:
            prompt = [int(t) for t in torch.randint(0, VOCAB, (n,), generator=prompt_gen)]
            tokens, top5, margins = greedy(ref, prompt)
            cases.append({"prompt": prompt, "tokens": tokens, "top5": top5, "margins": margins})
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump({"arch": arch, "transformers_version": transformers.__version__,
                       "torch_version": torch.__version__, "dtype_stored": "bfloat16", "compute": "float32 cpu eager",
                       "new_tokens": NEW_TOKENS, "cases": cases}, f, indent=1)
        size = sum(os.path.getsize(os.path.join(out, x)) for x in os.listdir(out))
        print(f"{arch}: {out} ({size / 1024:.0f} KiB), min margin "
              f"{min(min(c['margins']) for c in cases):.2e}")


if __name__ == "__main__":
    main()
