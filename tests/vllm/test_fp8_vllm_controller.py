"""FP8 rollouts from a bf16 trainer through rolloutcore's controller (labels gpu, vllm; vLLM 0.33:
scripts/gpu/run_vllm.sh with VLLM_KIT=0.33 -k fp8_vllm_controller). docs/fp8.md, "vLLM".

vLLM 0.33 serves the tiny random Qwen3 with --quantization fp8_per_block / fp8_per_tensor (online
quantization of the bf16 checkpoint). `rolloutcore controller serve --engine vllm+http://...` drives
every update: the extension stages the trainer's bf16 into shadows of vLLM's fused parameters,
installs and proves them (content digest == the manifest's), quantizes them on the GPU into vLLM's
FP8 weights and scales, and proves the FP8 image (the FP8 image digest of what vLLM computes with ==
the digest of the quantization of the proven bf16), all while paused; the controller commits only
when both hold and journals both.

Per method:
- the controller starts on the FP8 vLLM: the shadows take the checkpoint vLLM quantized at load, and
  vLLM's own quantization of it must be the image our rule computes (else the controller refuses);
- an update is committed; per parameter the live FP8 image equals the expected one and the one
  `rolloutcore model fp8-digest` computes on the CPU from the exported version; greedy tokens equal
  those of a fresh vLLM started with the same --quantization on the exported checkpoint;
- the trainer's ranks publish their parts of the FP8 image (docs/fp8.md, "The expected image, from
  the trainer"): the live image must equal their sum too, and the journal says so;
- the negative controls (rc_fault fp8_install: wrong_scale, stale_scales, swizzled_scales,
  stale_image, and self_consistent_wrong_scale, whose wrong image the extension's own check
  accepts: only the trainer's image catches it) each fail validation and taint, naming the FP8
  image (the version is marked failed); a recovery to v1 then proves v1's image again.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from test_vllm import figure, journal, status, update  # noqa: E402  (skips without a GPU, vLLM or the CUDA build)
# Skips without vLLM 0.33; its `tiny` fixture (a module-scoped checkpoint) serves this module too.
from test_fp8_vllm_image import differing_parameters, fp8_digest, fresh_greedy, tiny  # noqa: E402,F401
from vllm_harness import OUT, Trainer, Vllm, http, manifest_digests  # noqa: E402

from rolloutcore.cluster import Server, find_binary  # noqa: E402

MODEL = "tiny"
SCHEMES = [("fp8_per_block", "block"), ("fp8_per_tensor", "per_tensor")]
FAULTS = ["wrong_scale", "stale_scales", "swizzled_scales", "stale_image", "self_consistent_wrong_scale"]


def _wait_state(url: str, want: str, timeout_s: float) -> dict:
    deadline = time.time() + timeout_s
    s = status(url)
    while time.time() < deadline and s["state"] != want:
        time.sleep(0.05)
        s = status(url)
    return s


def _quantized(records) -> list:
    """Every quantized-image evidence object the journal records hold (at any depth)."""
    out = []

    def walk(x):
        if isinstance(x, dict):
            if "quantization" in x and "live" in x and "expected" in x:
                out.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(records)
    return out


@pytest.mark.parametrize("quantization,scheme", SCHEMES)
def test_controller_commits_fp8_vllm_and_every_negative_control_taints(tmp_path, tiny, quantization, scheme):
    i = [q for q, _ in SCHEMES].index(quantization)
    d = Server("directory", ["directory", "serve", "--store", "memory", "--port", "0"],
               OUT / f"directory_fp8ctl_{scheme}.log", find_binary())
    durl = d.wait_url(30)
    # The trainer publishes its parts of the FP8 image (fsdp:2 rows, amaxes merged over its ranks).
    trainer = Trainer(tiny, durl, MODEL, fp8=[quantization])
    prompt = list(range(100, 140))
    v = Vllm(tiny, 8430 + i, f"fp8_ctl_{scheme}", extra=["--quantization", quantization])
    ctl = None
    try:
        v.wait_healthy()
        # Before any install: the shadows take the checkpoint vLLM loaded, and vLLM's own quantization
        # of it is the image our rule computes.
        pre = v.rpc1("rc_digest")
        assert pre["ok"], pre
        assert pre["fp8"]["match"] is True and pre["fp8"]["bf16_from"] == tiny, pre["fp8"]
        assert len(pre["fp8"]["parameters"]) == 16, sorted(pre["fp8"]["parameters"])
        want0 = fp8_digest(tiny, scheme)
        assert pre["fp8"]["live_digest"] == want0["combined"], (pre["fp8"]["live_digest"], want0["combined"])

        ctl = Server("controller", ["controller", "serve", "--engine", "vllm+" + v.base, "--directory", durl,
                                    "--model", MODEL, "--state-dir", str(tmp_path / "ctl"), "--port", "0",
                                    "--install-deadline-ms", "5000", "--stage-deadline-ms", "20000"],
                     OUT / f"controller_fp8_{scheme}.log", find_binary())
        curl = ctl.wait_url(120)
        s = _wait_state(curl, "READY", 60)
        assert s["state"] == "READY", s

        # One committed update.
        trainer.make("v1", seed=1)
        trainer.publish("v1")
        eng = update(curl, "v1")
        assert eng["outcome"] == "committed", eng
        recs = journal(curl)
        ev = [q for q in _quantized(recs) if q.get("quantization") == quantization]
        assert ev and ev[-1]["match"] is True and ev[-1]["live"] == ev[-1]["expected"], ev
        # Held to the trainer's own image too: the parts its ranks published add up to the live image.
        assert ev[-1]["expected_from"] == "trainer" and ev[-1]["published"] == ev[-1]["live"], ev[-1]
        dig = v.rpc1("rc_digest", fresh=True)
        assert dig["ok"] and dig["content_digest"] == manifest_digests(durl, MODEL, "v1")[0], dig
        per = dig["fp8"]["parameters"]
        assert len(per) == 16 and all(p["live"] == p["expected"] for p in per.values()), per
        print(f"fp8 controller {quantization}: v1 committed; FP8 image {dig['fp8']['live_digest']} == expected, "
              f"16 of 16 parameters; proof {dig['fp8']['ms']:.1f} ms")

        # The negative controls: each taints, naming the FP8 image; a recovery then commits.
        tainted = {}
        for k, fault in enumerate(FAULTS):
            if fault == "swizzled_scales" and scheme == "per_tensor":
                r = v.rpc1("rc_fault", fp8_install=fault)  # one scale: nothing to re-lay out
                assert not r["ok"] and r["code"] == "InvalidArgument", r
                continue
            ver = f"bad{k}"
            trainer.make(ver, seed=10 + k)
            trainer.publish(ver)
            r = v.rpc1("rc_fault", fp8_install=fault)
            assert r["ok"], r
            since = max([x["seq"] for x in journal(curl)] or [0])
            t0 = time.time()
            eng = update(curl, ver)
            assert eng["outcome"] != "committed", (fault, eng)
            s = _wait_state(curl, "TAINTED", 10)
            tainted[fault] = round(time.time() - t0, 3)
            assert s["state"] == "TAINTED", (fault, s)
            text = json.dumps(journal(curl, since))
            want_text = ("not the image the trainer published" if fault == "self_consistent_wrong_scale"
                         else "is not the quantization")
            assert want_text in text and quantization in text, (fault, text[-2000:])
            # The version whose image failed is marked failed; the recovery goes back to v1.
            st, body = http("POST", curl + "/v1/recover", {"model": MODEL, "version": "v1"})
            assert st == 202, body
            s = _wait_state(curl, "READY", 120)
            assert s["state"] == "READY" and s["label"] == "v1", (fault, s)
            good = v.rpc1("rc_digest", fresh=True)
            assert good["ok"] and good["fp8"]["match"] is True, (fault, good)
        print(f"fp8 controller {quantization}: negative controls tainted (update -> TAINTED s): {tainted}")
        figure(f"fp8_controller_{scheme}_negative_controls", tainted)

        # A last committed update: its image against the CPU's, its greedy tokens against a fresh vLLM.
        trainer.make("v2", seed=2)
        trainer.publish("v2")
        eng = update(curl, "v2")
        assert eng["outcome"] == "committed", eng
        img = v.rpc1("rc_fp8_image")
        assert img["ok"], img
        after = v.complete(prompt, max_tokens=16)["choices"][0]["text"]
    finally:
        if ctl is not None:
            ctl.stop()
        v.stop()
    export = trainer.export("v2", str(tmp_path / "v2"))
    want = fp8_digest(export, scheme)["parameters"]
    bad = differing_parameters(img["parameters"], want)
    assert not bad, bad[:4]
    expect = fresh_greedy(export, 8440 + i, f"fp8_ctl_fresh_{scheme}", quantization, prompt)
    trainer.close()
    d.stop()
    print(f"fp8 controller {quantization}: v2 committed; image == model fp8-digest of the export, "
          f"{len(want) - len(bad)} of {len(want)}; greedy == fresh vLLM on the export: {after == expect}")
    assert after == expect, (after, expect)
