"""Replay probes from a torch model (docs/lifecycle.md, "Replay validation").

A probe is a prompt plus the trainer's own greedy continuation on the weights it publishes: per
step the argmax token, its log-probability and the top-k alternatives. Attach them to a version
with :meth:`rolloutcore.Publisher.attach_probes` (rank 0); the controller has the engine replay
them in VALIDATING, still paused, and refuses to resume (TAINTED) when the engine's numbers
differ beyond the tolerance — which catches install mappings the content digest cannot (a fused
qkv split in the wrong order, a transposed shard, a missed tied embedding).

Compute them on exactly the weights you publish, in eval mode, in float32 log-softmax (what
engines report as raw logprobs). The records follow the directory's bounds: at most 16 probes,
prompts of 1..512 tokens, 1..64 steps, top_k 0..20.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

MAX_PROBES = 16
MAX_PROMPT_TOKENS = 512
MAX_STEPS = 64
MAX_TOP_K = 20


def _logits_of(output: Any) -> Any:
    """The logits tensor of a model call: a tensor, a tuple whose first item is one, or an object
    with ``.logits`` (Hugging Face ``CausalLMOutput``)."""
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        return output[0]
    return output


def make_probes(
    model: Any,
    prompts: Sequence[Sequence[int]],
    steps: int,
    top_k: int,
    names: Optional[Sequence[str]] = None,
) -> List[Dict[str, Any]]:
    """Runs ``model`` (a torch module mapping ``[1, seq]`` int64 token ids to ``[1, seq, vocab]``
    logits) greedily for ``steps`` tokens after each prompt and returns the probe records, in the
    JSON form the directory stores: ``{name, prompt, top_k, steps: [{token, logprob, top:
    [[id, logprob], ...]}]}``. The whole sequence is re-run every step (no KV cache), so any
    causal LM works; probes are short. Ties go to the lowest token id, as engines break them.
    """
    import torch

    if not 0 < len(prompts) <= MAX_PROBES:
        raise ValueError(f"prompts: 1..{MAX_PROBES} prompts, got {len(prompts)}")
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps: must be in 1..{MAX_STEPS}, got {steps}")
    if not 0 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k: must be in 0..{MAX_TOP_K}, got {top_k}")
    if names is not None and len(names) != len(prompts):
        raise ValueError(f"names: {len(names)} names for {len(prompts)} prompts")
    try:
        device = next(model.parameters()).device
    except (AttributeError, StopIteration):
        device = torch.device("cpu")
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    probes: List[Dict[str, Any]] = []
    try:
        with torch.no_grad():
            for i, prompt in enumerate(prompts):
                prompt = [int(t) for t in prompt]
                if not 1 <= len(prompt) <= MAX_PROMPT_TOKENS:
                    raise ValueError(f"prompts[{i}]: 1..{MAX_PROMPT_TOKENS} tokens, got {len(prompt)}")
                if any(t < 0 for t in prompt):
                    raise ValueError(f"prompts[{i}]: token ids must be >= 0")
                tokens = list(prompt)
                records = []
                for _ in range(steps):
                    ids = torch.tensor([tokens], dtype=torch.long, device=device)
                    logits = _logits_of(model(ids))[0, -1].to(torch.float64)
                    logprobs = torch.log_softmax(logits, dim=-1).to(torch.float32).cpu()
                    # argmax with the lowest id winning ties (torch.argmax returns the first max).
                    token = int(torch.argmax(logprobs).item())
                    top: List[List[Any]] = []
                    if top_k > 0:
                        vals, idx = torch.topk(logprobs, min(top_k, logprobs.numel()))
                        # Best first; equal logprobs by token id ascending.
                        pairs = sorted(zip(idx.tolist(), vals.tolist()), key=lambda e: (-e[1], e[0]))
                        top = [[int(t), float(v)] for t, v in pairs]
                    records.append({"token": token, "logprob": float(logprobs[token]), "top": top})
                    tokens.append(token)
                probes.append(
                    {
                        "name": names[i] if names is not None else f"p{i}",
                        "prompt": prompt,
                        "top_k": int(top_k),
                        "steps": records,
                    }
                )
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return probes
