"""Acceptance on a Qwen3-0.6B-shaped checkpoint (labels gpu, vllm; run by scripts/gpu/run_vllm.sh).

The real Qwen3-0.6B geometry (28 layers, hidden 1024, 16/8 heads, vocab 151936, tied embeddings)
with random bf16 weights and the kit's local tokenizer (rolloutcore/vllm_models.py --shape 0.6b),
served by vLLM at TP=1 from disk. The trainer stand-in publishes v1 from torch CUDA tensors as
fsdp:2-style row shards on the same GPU (cuda_ipc); `controller serve --engine vllm+http://...`
(with --vllm-pause-call sleep) updates vLLM; then rc_digest of the live weights equals the
manifest for every loaded tensor (and the CPU digest of the trainer's bytes for a few), and the
greedy tokens equal those of a fresh vLLM started on v1 exported to disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

try:
    from vllm_harness import require_gpu_vllm
except ImportError as e:  # pragma: no cover
    pytest.skip(f"rolloutcore not importable: {e}", allow_module_level=True)
torch = require_gpu_vllm()

from vllm_harness import OUT, Trainer, Vllm, http, manifest_digests, tokens_of  # noqa: E402

import rolloutcore  # noqa: E402
from rolloutcore.cluster import Server, find_binary  # noqa: E402

MODEL = "qwen3-0.6b-shaped"
PROMPTS = [list(range(1000, 1060)), list(range(20, 84)), [11, 12, 13, 14] * 12]


def test_qwen3_0_6b_shaped_update_through_the_controller_commits_and_matches_a_fresh_vllm(tmp_path):
    OUT.mkdir(parents=True, exist_ok=True)
    base = str(tmp_path / "q06b")
    subprocess.run([sys.executable, os.environ["MAKE_TINY"], base, "--shape", "0.6b", "--seed", "0", "--tie"], check=True,
                   stdout=subprocess.DEVNULL)
    d = Server("directory", ["directory", "serve", "--store", "memory", "--port", "0"], OUT / "directory_06b.log",
               find_binary())
    durl = d.wait_url(30)
    trainer = Trainer(base, durl, MODEL)
    figures = {"bytes": sum(t.numel() * t.element_size() for t in trainer.base.values())}
    v = Vllm(base, 8110, "q06b", gpu_util=0.25, max_len=1024)
    ctl = None
    try:
        figures["vllm_start_to_healthy_s"] = round(v.wait_healthy(), 1)
        ctl = Server("controller", ["controller", "serve", "--engine", "vllm+" + v.base, "--directory", durl,
                                    "--model", MODEL, "--state-dir", str(tmp_path / "controller"), "--port", "0",
                                    "--vllm-pause-call", "sleep"],
                     OUT / "controller_06b.log", find_binary())
        curl = ctl.wait_url(120)
        trainer.make("v1", seed=1, scale=0.01)
        reports = trainer.publish("v1")
        assert reports[-1]["state"] == "COMMITTED", reports
        want, per = manifest_digests(durl, MODEL, "v1")
        t0 = time.perf_counter()
        st, body = http("POST", curl + "/v1/updates", {"model": MODEL, "version": "v1"})
        assert st == 202, body
        st, upd = http("GET", f"{curl}/v1/updates/{body['id']}?wait_ms=120000", timeout=180)
        figures["update_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        eng = upd["engines"][0]
        assert eng["outcome"] == "committed", upd
        figures["phases_ms"] = eng.get("phases_ms")
        dg = v.rpc1("rc_digest", per_tensor=True, fresh=True)
        assert dg["ok"] and dg["label"] == "v1", dg
        assert dg["fallback_tensors"] == [], dg["fallback_tensors"]
        loaded = {n: h for n, h in per.items() if n not in dg["not_loaded"]}
        assert dg["tensors"] == loaded, "live digest != manifest for some tensor"
        figures["not_loaded"] = dg["not_loaded"]
        if not dg["not_loaded"]:
            assert dg["content_digest"] == want
        full = trainer.versions["v1"]
        for n in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"):
            if n in dg["tensors"]:
                assert rolloutcore.tensor_digest(full[n].detach().cpu().contiguous()) == dg["tensors"][n], n
        hot = [tokens_of(v.complete(p, max_tokens=16, cache_salt="q06b")) for p in PROMPTS]
        out = trainer.export("v1", str(tmp_path / "export_v1"))
    finally:
        if ctl is not None:
            ctl.stop()
        v.stop()
    fresh = Vllm(out, 8111, "q06b_fresh_v1", gpu_util=0.25, max_len=1024)
    try:
        figures["fresh_start_to_healthy_s"] = round(fresh.wait_healthy(), 1)
        ref = [tokens_of(fresh.complete(p, max_tokens=16)) for p in PROMPTS]
    finally:
        fresh.stop()
        trainer.close()
        d.stop()
    print("FIGURE qwen3_0_6b " + json.dumps(figures))
    (OUT / "vllm_figures_06b.json").write_text(json.dumps(figures, indent=1))
    assert hot == ref, (hot, ref)
