"""Replay validation on an FP8 vLLM (labels gpu, vllm; vLLM 0.33: scripts/gpu/run_vllm.sh with
VLLM_KIT=0.33 -k fp8_vllm_replay). docs/fp8.md, "Replay validation".

The trainer computes its probes under the quantization the engine serves: a Transformers Qwen3 in
f32 on the FP8 image dequantized (each fused projection quantized by formats/fp8.h's rule, the bits
vLLM holds, then E4M3 * scale in f32). vLLM computes with those weights too, but with FP8 GEMMs that
also quantize the activations (W8A8), so its log-probabilities differ from the reference by more
than bf16's. Per method:
- the bound: 3 versions x 4 prompts x 16 greedy steps (top-5), the reference's logprobs against
  vLLM's through rc_replay (paused), as CompareReplay compares them; beside it, the gap to probes
  computed on the bf16 weights (what a trainer that ignores the quantization would send);
- the negative control: one version's probes replayed on another version's weights;
- through the controller, at the vLLM adapter's FP8 default bound (VllmOptions::fp8_replay_tolerance,
  2.5x the worst measured here, the rule the bf16 bound follows; this run's worst must stay under
  it): a version whose FP8 probes carry `quantization` commits with the replay matched, and the wrong
  weights' probes fail.
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from test_vllm import compare, figure, replay_paused, update  # noqa: E402  (skips without a GPU, vLLM or the CUDA build)
from test_fp8_vllm_image import tiny  # noqa: E402,F401  (skips without vLLM 0.33)
from vllm_harness import OUT, Trainer, Vllm  # noqa: E402

from rolloutcore.cluster import Server, find_binary  # noqa: E402

MODEL = "tiny"
SCHEMES = [("fp8_per_block", "block"), ("fp8_per_tensor", "per_tensor")]
ORDER = ["q", "k", "v", "o", "gate", "up", "down"]
FP8_DEFAULT_TOLERANCE = 1.15  # VllmOptions::fp8_replay_tolerance


def dequantized(weights, scheme):
    """The weights as the FP8 engine holds them, in f32: each fused projection quantized by our rule
    (formats/fp8.h, the bits vLLM 0.33 holds) and dequantized; the other tensors as published."""
    import numpy as np
    import torch

    from rolloutcore import _core
    from rolloutcore.refit import fp8_parameter_of

    out = {k: v.float() for k, v in weights.items()}
    fused = {}
    for name in weights:
        of = fp8_parameter_of(name)
        if of:
            fused.setdefault(of[0], {})[of[1]] = name
    for param, parts in fused.items():
        names = [parts[p] for p in ORDER if p in parts]
        bits = np.ascontiguousarray(np.concatenate(
            [weights[n].contiguous().view(torch.int16).cpu().numpy().view(np.uint16) for n in names], axis=0))
        q, s = _core.quantize_fp8(bits, scheme)
        deq = torch.from_numpy(np.asarray(_core.dequantize_fp8(q, s, scheme), dtype=np.float32))
        row = 0
        for n in names:
            rows = weights[n].shape[0]
            out[n] = deq[row:row + rows].to(weights[n].device)
            row += rows
    return out


def reference_probes(folder, weights, prompts, steps, top_k, quantization=""):
    """make_probes of a Transformers Qwen3 in f32 on `weights` (already f32 or bf16)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from rolloutcore.probes import make_probes

    ref = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    probes = make_probes(ref, prompts, steps=steps, top_k=top_k)
    del ref
    torch.cuda.empty_cache()
    if quantization:
        for p in probes:
            p["quantization"] = quantization
    return probes


def _stats(diffs):
    diffs = sorted(diffs)
    return {"worst": round(diffs[-1], 6), "p99": round(diffs[int(0.99 * (len(diffs) - 1))], 6),
            "median": round(diffs[len(diffs) // 2], 6), "compared_logprobs": len(diffs)}


@pytest.mark.parametrize("quantization,scheme", SCHEMES)
def test_fp8_replay_bound_measured_and_enforced_through_the_controller(tmp_path, tiny, quantization, scheme):
    i = [q for q, _ in SCHEMES].index(quantization)
    d = Server("directory", ["directory", "serve", "--store", "memory", "--port", "0"],
               OUT / f"directory_fp8replay_{scheme}.log", find_binary())
    durl = d.wait_url(30)
    trainer = Trainer(tiny, durl, MODEL)
    v = Vllm(tiny, 8450 + i, f"fp8_replay_{scheme}", extra=["--quantization", quantization])
    ctl = ctl2 = None
    try:
        v.wait_healthy()
        # This controller only commits the three versions the bound is measured on; between them the
        # test pauses vLLM itself for its replays (replay_paused), behind the controller's back. The
        # periodic identity check would rightly taint a READY engine it finds paused (every rollout
        # admitted would hang), so it is off for this controller; ctl2 below runs with the default.
        ctl = Server("controller", ["controller", "serve", "--engine", "vllm+" + v.base, "--directory", durl,
                                    "--model", MODEL, "--state-dir", str(tmp_path / "ctl"), "--port", "0",
                                    "--install-deadline-ms", "5000", "--stage-deadline-ms", "20000",
                                    "--verify-interval-ms", "0"],
                     OUT / f"controller_fp8replay_{scheme}.log", find_binary())
        curl = ctl.wait_url(120)
        rng = random.Random(7)
        prompts = [[rng.randrange(16, 2000) for _ in range(n)] for n in (8, 24, 40, 64)]
        fp8_diffs, bf16_diffs, diverged, bf16_diverged, probes_of, weights_of = [], [], [], [], {}, {}
        for k, seed in enumerate((31, 32, 33)):
            ver = f"v-fp8b{k}"
            w = trainer.make(ver, seed=seed)
            trainer.publish(ver)
            eng = update(curl, ver)
            assert eng["outcome"] == "committed", eng
            probes = reference_probes(tiny, dequantized(w, scheme), prompts, 16, 5, quantization)
            probes_of[ver], weights_of[ver] = probes, w
            dd, div = compare(probes, replay_paused(v, probes))
            fp8_diffs.extend(dd)
            diverged.extend(div)
            bf = reference_probes(tiny, w, prompts, 16, 5)
            dd, div = compare(bf, replay_paused(v, bf))
            bf16_diffs.extend(dd)
            bf16_diverged.extend(div)
        bound = _stats(fp8_diffs)
        bound["greedy_divergences"] = diverged
        gap = _stats(bf16_diffs)
        gap["greedy_divergences"] = len(bf16_diverged)
        # Negative control: v-fp8b0's probes on v-fp8b2's weights (live now).
        dd, div = compare(probes_of["v-fp8b0"], replay_paused(v, probes_of["v-fp8b0"]))
        wrong = {"worst_before_divergence": round(max(dd), 4) if dd else None, "divergences": len(div),
                 "first_steps": [x["step"] for x in div]}
        tol = round(max(0.15, 2.5 * bound["worst"]), 3)
        print(f"fp8 replay {quantization}: FP8-reference probes vs vLLM {json.dumps(bound)}; bf16-reference probes "
              f"vs the FP8 vLLM {json.dumps(gap)}; wrong weights {json.dumps(wrong)}; bound 2.5 x worst = {tol}")
        figure(f"fp8_replay_{scheme}_bound", bound)
        figure(f"fp8_replay_{scheme}_bf16_reference_gap", gap)
        figure(f"fp8_replay_{scheme}_wrong_weights", wrong)
        ctl.stop()
        ctl = None

        assert bound["worst"] <= FP8_DEFAULT_TOLERANCE, (bound, FP8_DEFAULT_TOLERANCE)
        # Through the controller at the adapter's FP8 default: probes computed under the quantization
        # are replayed.
        ctl2 = Server("controller", ["controller", "serve", "--engine", "vllm+" + v.base, "--directory", durl,
                                     "--model", MODEL, "--state-dir", str(tmp_path / "ctl2"), "--port", "0",
                                     "--install-deadline-ms", "5000", "--stage-deadline-ms", "20000"],
                      OUT / f"controller_fp8replay2_{scheme}.log", find_binary())
        curl = ctl2.wait_url(120)
        w = trainer.make("v-fp8probed", seed=41)
        probes = reference_probes(tiny, dequantized(w, scheme), prompts[:2], 8, 5, quantization)
        trainer.pubs[0].attach_probes("v-fp8probed", probes)
        trainer.publish("v-fp8probed")
        eng = update(curl, "v-fp8probed")
        assert eng["outcome"] == "committed", json.dumps({"reason": eng.get("reason"),
                                                          "validated": eng.get("evidence", {}).get("validated")})
        replay = eng["evidence"]["validated"]["replay"]
        figure(f"fp8_replay_{scheme}_controller", replay)
        assert replay["skipped"] is False and replay["match"] is True and replay["probes"] == 2, replay
        assert replay["tolerance"] == FP8_DEFAULT_TOLERANCE, replay
        # The wrong weights' probes (v-fp8b0's, labelled for this version) fail at this bound.
        w2 = trainer.make("v-fp8wrong", seed=42)
        del w2
        wrong_probes = [dict(p) for p in probes_of["v-fp8b0"][:2]]
        trainer.pubs[0].attach_probes("v-fp8wrong", wrong_probes)
        trainer.publish("v-fp8wrong")
        eng = update(curl, "v-fp8wrong")
        assert eng["outcome"] != "committed", eng
        assert "replay" in json.dumps(eng), eng
        print(f"fp8 replay {quantization}: controller at the FP8 default {FP8_DEFAULT_TOLERANCE}: committed with "
              f"{replay['probes']} FP8 probes, worst {replay['worst_logprob_diff']:.4f}; wrong weights' probes "
              f"failed validation")
    finally:
        for c in (ctl, ctl2):
            if c is not None:
                c.stop()
        v.stop()
        trainer.close()
        d.stop()
