#!/usr/bin/env python3
"""A small but real RL loop on rolloutcore: GRPO-style policy gradient on a tiny Qwen3 model.

The task is verifiable: the prompt is a digit string and "=" as byte tokens (the engine's
tokenizer is byte-level, so token id = byte), and the answer must be the digits reversed.
Reward per rollout = the fraction of answer positions holding the right digit (with --format-bonus
b: b * [a digit] + (1 - b) * [the right digit]). Chance level is 1/256 per position (vocab 256).

Each step:
  1. sample prompts; generate a group of rollouts per prompt with the rolloutcore engine through
     the controller (every rollout is admitted under, and bound to, the version being served);
  2. check every binding label and the engine's per-choice weight_version == the version;
  3. group-baseline advantages (reward - group mean) / (group std + eps), policy-gradient loss
     on the sampled tokens (plus a small entropy bonus) with the trainer's PyTorch
     Qwen3ForCausalLM (transformers), one Adam step; the engine's sampling logprobs are compared
     with the trainer's for the same tokens (the gap is small only if the engine really serves
     the trainer's weights);
  4. publish the new weights through rolloutcore.Publisher (bf16, shared memory) as a delta refit
     on the previous version (only the elements whose bf16 bits changed move; --no-delta: full),
     ask the controller to update, wait for it, and check the engine's live content digest equals
     the published manifest's. The fraction of bf16 elements the Adam step changed is measured on
     the trainer's device (rolloutcore.refit.changed_elements on the bf16 casts before and after
     the step) and reported per step beside the delta's size.
Rewards, timings and checks per step go to OUT/rl_loop.json and a plot to OUT/rewards.png.

Runs on a GPU machine (--device cuda, the default when available) or slowly on CPU
(--device cpu --steps 3). Needs torch, transformers, numpy, the rolloutcore package with its
compiled core (Publisher) and the rolloutcore binary (ROLLOUTCORE_BIN or next to the package);
matplotlib for the plot (skipped with a warning when missing). docs/python.md says how to run it.
Exit code 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

import rolloutcore
from rolloutcore import torch_utils
from rolloutcore.cluster import run_binary
from rolloutcore.refit import changed_elements, core

EQUALS = ord("=")
DIGITS = [ord(str(d)) for d in range(10)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="rl_loop_out")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="rollouts per prompt (the GRPO group)")
    p.add_argument("--digits", type=int, default=3, help="length of the digit string to reverse")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--format-bonus", type=float, default=0.0,
                   help="reward share for answering with digits at all (shaping; 0: only right digits count)")
    p.add_argument("--entropy-coef", type=float, default=0.01, help="entropy bonus (keeps the policy exploring)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny", help="rolloutcore model preset (a Qwen3 shape)")
    p.add_argument("--engine-tp", type=int, default=1)
    p.add_argument("--transport", default="shm", help="shm (default) or ucx")
    p.add_argument("--concurrency", type=int, default=32, help="rollouts in flight")
    p.add_argument("--keep", type=int, default=2, help="versions kept published (older ones are released)")
    p.add_argument("--no-delta", action="store_true",
                   help="publish every version in full (default: delta refit, docs/refit.md \"Delta refit\")")
    return p.parse_args()


# ---- the model ----------------------------------------------------------------------------------


def load_trainer_model(model_dir: Path, device: str) -> torch.nn.Module:
    """Qwen3ForCausalLM from the config.json + model.safetensors that `rolloutcore model init` wrote."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    config.use_cache = False
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except TypeError:  # older transformers
        config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(config)
    state = load_file(str(model_dir / "model.safetensors"))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    # Non-persistent buffers (rotary inv_freq) are not in a checkpoint; every parameter must be.
    params = {n for n, _ in model.named_parameters()}
    if set(missing) & params or unexpected:
        raise RuntimeError(f"checkpoint does not match Qwen3ForCausalLM: missing {sorted(set(missing) & params)}, "
                           f"unexpected {sorted(unexpected)}")
    return model.to(device=device, dtype=torch.float32)


def check_names(model: torch.nn.Module, model_spec: str) -> None:
    """The trainer's parameter names and shapes must be exactly the HF tensors rolloutcore expects."""
    want = {t["name"]: t["shape"] for t in rolloutcore.model_tensors(model_spec)}
    have = {n: list(p.shape) for n, p in model.named_parameters()}
    if want != have:
        raise RuntimeError(f"parameter names/shapes differ from rolloutcore's {model_spec}: "
                           f"only trainer {sorted(set(have) - set(want))}, only rolloutcore "
                           f"{sorted(set(want) - set(have))}, shapes {[(n, have[n], want[n]) for n in want if n in have and have[n] != want[n]]}")


def sequence_logprobs(model: torch.nn.Module, prompts: List[List[int]], completions: List[List[int]],
                      device: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of each completion given its prompt [N, T], the policy's entropy
    at those positions [N, T], and a mask [N, T]."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    T = max(len(c) for c in completions)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    ids, attn = ids.to(device), attn.to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    logp = F.log_softmax(logits, dim=-1)
    out = torch.zeros(len(seqs), T, device=device)
    ent = torch.zeros(len(seqs), T, device=device)
    mask = torch.zeros(len(seqs), T, device=device)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n = len(c)
        if n == 0:
            continue
        pos = torch.arange(len(p) - 1, len(p) - 1 + n, device=device)  # logits at t predict token t+1
        tok = torch.tensor(c, device=device)
        out[i, :n] = logp[i, pos, tok]
        ent[i, :n] = -(logp[i, pos].exp() * logp[i, pos]).sum(-1)
        mask[i, :n] = 1
    return out, ent, mask


# ---- the task -------------------------------------------------------------------------------------


def make_prompt(rng: random.Random, digits: int) -> Tuple[List[int], List[int]]:
    s = [rng.choice(DIGITS) for _ in range(digits)]
    return s + [EQUALS], list(reversed(s))


def reward(completion: List[int], target: List[int], format_bonus: float) -> float:
    """Mean over answer positions of format_bonus * [a digit] + (1 - format_bonus) * [the right digit]."""
    score = 0.0
    for i, want in enumerate(target):
        got = completion[i] if i < len(completion) else -1
        score += format_bonus * (got in DIGITS) + (1.0 - format_bonus) * (got == want)
    return score / len(target)


# ---- the loop -------------------------------------------------------------------------------------


class Checks:
    def __init__(self) -> None:
        self.failed: List[str] = []
        self.passed = 0

    def check(self, ok: bool, what: str) -> bool:
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
            print(f"CHECK FAILED: {what}", file=sys.stderr, flush=True)
        return ok


def publish_and_update(cluster: rolloutcore.LocalCluster, pub: rolloutcore.Publisher, model: torch.nn.Module,
                       model_name: str, version: str, checks: Checks) -> Dict[str, Any]:
    t0 = time.perf_counter()
    with torch.no_grad():
        report = torch_utils.publish_module(pub, version, model, dtype="bf16")
    t1 = time.perf_counter()
    delta = {k: report.get(k) for k in ("delta_base", "delta_changed", "delta_bytes", "delta_shards") if k in report}
    checks.check(report["state"] == "COMMITTED", f"{version}: publish state {report['state']}")
    rec = cluster.controller.update_to(model_name, version, timeout_s=300)
    t2 = time.perf_counter()
    live = cluster.engine.weights_digest()
    checks.check(live["weight_version"] == version, f"{version}: engine serves {live['weight_version']}")
    checks.check(live["content_digest"] == report["content_digest"],
                 f"{version}: live digest {live['content_digest']} != published {report['content_digest']}")
    manifest_digest = cluster.directory.info(model_name, version)["content_digest"]
    checks.check(manifest_digest == report["content_digest"], f"{version}: directory digest {manifest_digest}")
    phases = rec["engines"][0].get("phases_ms", {})
    staged = ((rec["engines"][0].get("evidence") or {}).get("staged") or {})
    return {"publish_ms": (t1 - t0) * 1e3, "update_ms": (t2 - t1) * 1e3, "content_digest": report["content_digest"],
            "live_digest_ok": live["content_digest"] == report["content_digest"], "update_phases_ms": phases,
            "bytes": report["bytes"], "stage_mode": staged.get("mode") or (staged.get("engine") or {}).get("mode"),
            **delta}


def bf16_snapshot(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The bf16 cast of every parameter, where it lives (what the next publish will send)."""
    with torch.no_grad():
        return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def changed_fraction(before: Dict[str, torch.Tensor], model: torch.nn.Module) -> Tuple[int, int]:
    """(changed, total) bf16 elements between `before` and the model now, computed on its device."""
    changed = total = 0
    with torch.no_grad():
        for n, p in model.named_parameters():
            offsets, _ = changed_elements(before[n], p.detach().to(torch.bfloat16))
            changed += int(offsets.numel())
            total += p.numel()
    return changed, total


def generate(cluster: rolloutcore.LocalCluster, pool: ThreadPoolExecutor, prompts: List[List[int]], group: int,
             max_tokens: int, temperature: float, step: int) -> List[Dict[str, Any]]:
    def one(i: int, j: int) -> Dict[str, Any]:
        rid = f"s{step}-p{i}-g{j}"
        out = cluster.controller.rollout(prompts[i], max_tokens=max_tokens, temperature=temperature,
                                         seed=step * 100_000 + i * 100 + j, logprobs=1, return_token_ids=True,
                                         ignore_eos=True, rollout_id=rid)
        choice = out["choices"][0]
        lp = (choice.get("logprobs") or {}).get("token_logprobs") or []
        return {"id": rid, "prompt": i, "tokens": choice["token_ids"], "engine_logprobs": lp,
                "label": out["binding"]["label"], "engine_label": choice.get("weight_version")}

    futures = [pool.submit(one, i, j) for i in range(len(prompts)) for j in range(group)]
    return [f.result() for f in futures]


def main() -> int:
    args = parse_args()
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    core()  # raises ImportError saying how to get the compiled core when it is missing

    model_dir, work_dir = out_dir / "model", out_dir / "work"
    shutil.rmtree(work_dir, ignore_errors=True)  # a fresh directory, engine and controller journal
    run_binary(["model", "init", "--preset", args.preset, "--seed", str(args.seed), "--out", str(model_dir)])
    model = load_trainer_model(model_dir, args.device)
    check_names(model, str(model_dir))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    model_name = args.preset
    checks = Checks()
    steps: List[Dict[str, Any]] = []
    bindings: Dict[str, str] = {}

    print(f"starting directory, engine ({model_dir}) and controller in {out_dir / 'work'}", flush=True)
    with rolloutcore.LocalCluster(model=model_name, engine_model=str(model_dir), workdir=str(work_dir),
                                  engine_version="init", engine_tp=args.engine_tp) as cluster, \
            ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        pub = rolloutcore.Publisher(cluster.directory_url, model_name, transport=args.transport,
                                    delta=not args.no_delta)
        # v0: the trainer's initial weights; proves names, layout and digests line up before training.
        v0 = publish_and_update(cluster, pub, model, model_name, "v0", checks)
        print(f"v0 published and installed: digest {v0['content_digest']}, {v0['bytes']} bytes, "
              f"update {v0['update_ms']:.0f} ms", flush=True)
        version = "v0"
        published = ["v0"]
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            batch = [make_prompt(rng, args.digits) for _ in range(args.prompts)]
            prompts = [p for p, _ in batch]
            rollouts = generate(cluster, pool, prompts, args.group, args.digits, args.temperature, step)
            t1 = time.perf_counter()
            bad = [r["id"] for r in rollouts if r["label"] != version or r["engine_label"] not in (None, version)]
            checks.check(not bad, f"step {step}: rollouts not bound to {version}: {bad[:5]}")
            for r in rollouts:
                bindings[r["id"]] = r["label"]

            rewards = torch.tensor([reward(r["tokens"], batch[r["prompt"]][1], args.format_bonus) for r in rollouts])
            grouped = rewards.view(args.prompts, args.group)
            adv = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
            adv = adv.view(-1).to(args.device)

            model.train()
            logp, entropy, mask = sequence_logprobs(model, [prompts[r["prompt"]] for r in rollouts],
                                                    [r["tokens"] for r in rollouts], args.device)
            mean_entropy = (entropy * mask).sum() / mask.sum()
            loss = -(adv[:, None] * logp * mask).sum() / mask.sum() - args.entropy_coef * mean_entropy
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            before = bf16_snapshot(model)
            opt.step()
            n_changed, n_total = changed_fraction(before, model)
            del before
            # The engine sampled with the weights the trainer had before this step (in bf16).
            gaps = []
            trainer_lp, lengths = logp.detach().cpu().tolist(), mask.sum(dim=1).long().cpu().tolist()
            for i, r in enumerate(rollouts):
                for t in range(min(len(r["engine_logprobs"]), lengths[i])):
                    if r["engine_logprobs"][t] is not None:
                        gaps.append(abs(trainer_lp[i][t] - float(r["engine_logprobs"][t])))
            gap = sum(gaps) / len(gaps) if gaps else float("nan")
            t2 = time.perf_counter()

            version = f"v{step}"
            upd = publish_and_update(cluster, pub, model, model_name, version, checks)
            published.append(version)
            while len(published) > args.keep:
                pub.release(published.pop(0))
            t3 = time.perf_counter()
            row = {"step": step, "version_sampled": f"v{step - 1}", "version_published": version,
                   "reward_mean": float(rewards.mean()), "reward_max": float(rewards.max()),
                   "exact_match": float(sum(r["tokens"][: args.digits] == batch[r["prompt"]][1] for r in rollouts)
                                        / len(rollouts)),
                   "loss": loss.item(), "entropy": mean_entropy.item(), "grad_norm": grad_norm, "engine_trainer_logprob_gap": gap,
                   "rollouts": len(rollouts), "rollout_ms": (t1 - t0) * 1e3, "train_ms": (t2 - t1) * 1e3,
                   "step_ms": (t3 - t0) * 1e3, "bf16_changed": n_changed, "bf16_elements": n_total,
                   "bf16_changed_fraction": n_changed / n_total, **upd}
            steps.append(row)
            print(f"step {step:4d}  reward {row['reward_mean']:.3f}  exact {row['exact_match']:.2f}  "
                  f"entropy {row['entropy']:.2f}  "
                  f"gap {gap:.4f}  rollouts {row['rollout_ms']:.0f} ms  publish {upd['publish_ms']:.0f} ms  "
                  f"update {upd['update_ms']:.0f} ms  changed {row['bf16_changed_fraction']:.4f} "
                  f"({upd.get('stage_mode')}, delta {upd.get('delta_bytes')} of {upd['bytes']} B)  "
                  f"-> {version} digest ok={upd['live_digest_ok']}", flush=True)
            if not args.no_delta:
                checks.check(upd.get("delta_changed") == n_changed,
                             f"{version}: the delta carries {upd.get('delta_changed')} changed elements, the trainer "
                             f"measured {n_changed} on its device")

        # Every recorded trajectory carries the version that produced it.
        rows = cluster.controller.trajectories()
        recorded = {t["binding"]["rollout_id"]: t["binding"]["label"] for t in rows}
        mismatched = [rid for rid, label in bindings.items() if recorded.get(rid) != label]
        checks.check(not mismatched, f"trajectories whose recorded label differs: {mismatched[:5]}")
        checks.check(len(recorded.keys() & bindings.keys()) == len(bindings),
                     f"{len(bindings) - len(recorded.keys() & bindings.keys())} rollouts missing from the trajectory store")
        pub.close()

    result = {"args": vars(args), "v0": v0, "steps": steps, "checks_passed": checks.passed,
              "checks_failed": checks.failed, "trajectories_checked": len(bindings)}
    (out_dir / "rl_loop.json").write_text(json.dumps(result, indent=2))
    plot(steps, out_dir / "rewards.png")
    if steps:
        fr = sorted(s["bf16_changed_fraction"] for s in steps)
        result["bf16_changed_fraction"] = {"min": fr[0], "median": fr[len(fr) // 2], "max": fr[-1], "lr": args.lr}
        (out_dir / "rl_loop.json").write_text(json.dumps(result, indent=2))
        print(f"bf16 elements changed per step at lr {args.lr}: min {fr[0]:.4f}, median {fr[len(fr) // 2]:.4f}, "
              f"max {fr[-1]:.4f}")
    first = steps[0]["reward_mean"] if steps else math.nan
    last = sum(s["reward_mean"] for s in steps[-10:]) / max(1, len(steps[-10:]))
    print(f"reward: first step {first:.3f}, mean of the last 10 steps {last:.3f}")
    print(f"checks: {checks.passed} passed, {len(checks.failed)} failed; {len(bindings)} trajectories bound; "
          f"results in {out_dir}")
    return 0 if not checks.failed else 1


def plot(steps: List[Dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    xs = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [s["reward_mean"] for s in steps], label="mean reward")
    ax.plot(xs, [s["exact_match"] for s in steps], label="exact match")
    ax.set_xlabel("step (one published version each)")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("GRPO on digit reversal: rollouts from the rolloutcore engine")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
