#!/usr/bin/env python3
"""Create a tiny random Qwen3ForCausalLM folder that vLLM can serve fully offline.

Writes into OUT_DIR:
  config.json, generation_config.json, model.safetensors (bf16),
  tokenizer.json + tokenizer_config.json + special_tokens_map.json
  (a byte-level BPE trained locally on a few sentences; no hub access).

Usage: python3 -m rolloutcore.vllm_models OUT_DIR [--seed 0] [--tie] [--shape tiny|0.6b|8b] [--no-weights]
Needs only torch, transformers (5.x), tokenizers, safetensors.

rolloutcore's copy of ../shared/vllm/make_tiny_qwen3.py, plus --shape: the real Qwen3-0.6B /
Qwen3-8B dimensions (random weights, the same local tokenizer; model vocab as the real model), and
--no-weights: config and tokenizer only (for `vllm serve --load-format dummy`, when the weights
come from the trainer through a refit anyway).
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

VOCAB = 2048
# Dimensions: "tiny" (the kit's), and the real Qwen3-0.6B and Qwen3-8B configurations.
SHAPES = {
    "tiny": dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for a tiny random Qwen3 model.",
    "vLLM serves language models with paged attention and prefix caching.",
    "Reinforcement learning updates the policy weights between rollouts.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "0123456789 +-*/=()[]{}<>!?.,;:'\"@#$%^&_|~`\\",
    "Pause the engine, reset the prefix cache, then resume generation.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def build_tokenizer(out_dir: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 64,  # leave headroom; model vocab stays VOCAB
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    # make the wrapper class explicit and generic
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.setdefault("chat_template", CHAT_TEMPLATE)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return fast


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tie", action="store_true", help="tie lm_head to embeddings")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="model dimensions")
    ap.add_argument("--no-weights", action="store_true", help="write config and tokenizer only")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    torch.manual_seed(a.seed)

    tok = build_tokenizer(a.out_dir)
    eos_id = tok.convert_tokens_to_ids("<|endoftext|>")
    assert len(tok) <= SHAPES[a.shape]["vocab_size"], len(tok)

    dims = SHAPES[a.shape]
    config = Qwen3Config(
        **dims,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=a.tie,
        use_sliding_window=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    if a.no_weights:
        config.dtype = torch.bfloat16
        config.save_pretrained(a.out_dir)
        print(f"Qwen3 ({a.shape}) config and tokenizer written to {a.out_dir} (no weights)")
        return
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # small, well-conditioned random weights
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in name:
                p.fill_(1.0)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(a.out_dir, safe_serialization=True)
    if model.generation_config is not None:
        model.generation_config.bos_token_id = eos_id
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = eos_id
        model.generation_config.save_pretrained(a.out_dir)

    files = sorted(os.listdir(a.out_dir))
    n = sum(p.numel() for p in model.parameters())
    print(f"tiny Qwen3 written to {a.out_dir}: {n} params, tokenizer vocab {len(tok)}, eos {eos_id}")
    print("files:", files)
    ids = tok("Hello world!")["input_ids"]
    print("encode('Hello world!') ->", ids, "->", repr(tok.decode(ids)))


if __name__ == "__main__":
    main()
