"""vLLM 0.33 serving a bf16 Qwen3 checkpoint with --quantization fp8_per_tensor / fp8_per_channel /
fp8_per_block: the FP8 image vLLM holds after loading, read by the worker extension (rc_fp8_image),
against the image `rolloutcore model fp8-digest` computes from the checkpoint alone (docs/fp8.md).
Per vLLM parameter: the E4M3 bytes' digest and the scale grid's digest must be equal; the layouts vLLM
keeps (strides, the scale tensor's name and shape) are printed and written to $OUT for the receiver's
FP8 install. Labels gpu, vllm (scripts/gpu/run_vllm.sh with VLLM_KIT=0.33).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from test_vllm import figure  # noqa: E402  (skips without a GPU, vLLM or the CUDA build)
from vllm_harness import OUT, VLLM_SITE, Trainer, Vllm, manifest_digests, site_version  # noqa: E402

from rolloutcore.cluster import Server, find_binary  # noqa: E402

if not (site_version(VLLM_SITE) or "").startswith("0.33."):
    pytest.skip(f"vLLM 0.33's online fp8 methods: {VLLM_SITE} holds {site_version(VLLM_SITE) or '(none)'}",
                allow_module_level=True)

SCHEMES = [("fp8_per_tensor", "per_tensor"), ("fp8_per_channel", "per_channel"), ("fp8_per_block", "block")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    work = tmp_path_factory.mktemp("fp8img")
    folder = str(work / "tiny")
    subprocess.run([sys.executable, os.environ["MAKE_TINY"], folder, "--seed", "0"], check=True,
                   stdout=subprocess.DEVNULL)
    return folder


def fp8_digest(folder: str, scheme: str) -> dict:
    """`rolloutcore model fp8-digest --json` of a bf16 folder: the image computed on the CPU."""
    r = subprocess.run([find_binary(), "model", "fp8-digest", "--json", "--scheme", scheme, folder], check=True,
                       capture_output=True, text=True)
    return json.loads(r.stdout)


def differing_parameters(image: dict, want: dict) -> list:
    """The parameters of `want` (fp8_digest's "parameters") whose bytes or scales digest differ in
    `image` (rc_fp8_image's "parameters"), or that it lacks."""
    return [n for n, w in want.items() if (image.get(n, {}).get("bytes_digest"), image.get(n, {}).get("scales_digest"))
            != (w["bytes_digest"], w["scales_digest"])]


def fresh_greedy(folder: str, port: int, name: str, quantization: str, prompt) -> str:
    """The greedy text of a fresh vLLM started on `folder` with --quantization `quantization`."""
    fresh = Vllm(folder, port, name, extra=["--quantization", quantization])
    try:
        fresh.wait_healthy()
        return fresh.complete(prompt, max_tokens=16)["choices"][0]["text"]
    finally:
        fresh.stop()


@pytest.mark.parametrize("quantization,scheme", SCHEMES)
def test_vllm_fp8_image_is_the_image_computed_from_the_checkpoint(tiny, quantization, scheme):
    want = fp8_digest(tiny, scheme)["parameters"]
    v = Vllm(tiny, 8400 + [q for q, _ in SCHEMES].index(quantization), f"fp8_{scheme}",
             extra=["--quantization", quantization])
    try:
        v.wait_healthy()
        got = v.rpc1("rc_fp8_image")
        assert got["ok"], got
        desc = v.rpc1("rc_describe")
        assert desc["ok"] and desc["quantization"] == quantization, {k: desc.get(k) for k in ("ok", "quantization")}
        greedy = v.complete(list(range(100, 140)), max_tokens=16, temperature=0)
    finally:
        v.stop()
    params = got["parameters"]
    layouts = {n: {k: p.get(k) for k in ("weight", "transposed", "scale", "scales_shape")} for n, p in params.items()}
    (OUT / f"fp8_layout_{scheme}.json").write_text(json.dumps({"vllm": got, "checkpoint": want}, indent=1))
    first = sorted(params)[0] if params else None
    if first:
        print(f"fp8 {quantization}: {len(params)} FP8 parameters; {first}: {json.dumps(layouts[first])}")
    figure(f"fp8_image_{scheme}_params", len(params))
    figure(f"fp8_image_{scheme}_greedy", greedy["choices"][0].get("token_ids") or greedy["choices"][0]["text"])
    assert set(params) == set(want), (sorted(set(params) ^ set(want)))
    bad = []
    for name, w in want.items():
        p = params[name]
        if p.get("bytes_digest") != w["bytes_digest"] or p.get("scales_digest") != w["scales_digest"]:
            bad.append({"param": name, "vllm": {k: p.get(k) for k in ("bytes_digest", "scales_digest", "scales_shape")},
                        "expected": {k: w[k] for k in ("bytes_digest", "scales_digest", "scales_shape")},
                        "layout": layouts[name]})
    print(f"fp8 {quantization}: {len(want) - len(bad)} of {len(want)} parameters equal to model fp8-digest "
          f"(bytes and scales)")
    assert not bad, json.dumps(bad[:4], indent=1)


@pytest.mark.parametrize("quantization,scheme", SCHEMES)
def test_refit_into_fp8_vllm_installs_the_quantization_of_the_published_version(tmp_path, tiny, quantization,
                                                                                 scheme):
    """Refit into vLLM serving FP8 (docs/fp8.md): a torch trainer publishes v1 (bf16, fsdp:2 over
    cuda_ipc); rc_stage stages it into bf16 shadows of the fused parameters (and the bf16 params),
    rc_install installs and proves the bf16 (content digest == the manifest's), then quantizes
    every shadow into vLLM's FP8 parameter and scales with rolloutcore's GPU quantizer. The FP8
    image vLLM then holds must be the image `model fp8-digest` computes from v1 exported, for every
    parameter, and its greedy tokens those of a fresh vLLM started on the export with the same
    --quantization."""
    i = [q for q, _ in SCHEMES].index(quantization)
    d = Server("directory", ["directory", "serve", "--store", "memory", "--port", "0"],
               OUT / f"directory_fp8_{scheme}.log", find_binary())
    durl = d.wait_url(30)
    trainer = Trainer(tiny, durl, "tiny")
    prompt = list(range(100, 140))
    v = Vllm(tiny, 8410 + i, f"fp8_refit_{scheme}", extra=["--quantization", quantization])
    try:
        v.wait_healthy()
        before = v.complete(prompt, max_tokens=16)["choices"][0]["text"]
        # Before any install the bf16 shadows take the checkpoint vLLM loaded from (rc_digest's rule
        # since 3beefbe, which test_fp8_vllm_controller.py also holds), and vLLM's own quantization of
        # it is proven to be the image the rule computes from that checkpoint.
        pre = v.rpc1("rc_digest")
        assert pre["ok"] and pre["fp8"]["match"] is True and pre["fp8"]["bf16_from"] == tiny, pre
        assert pre["fp8"]["live_digest"] == fp8_digest(tiny, scheme)["combined"], pre["fp8"]
        trainer.make("v1", seed=1)
        trainer.publish("v1")
        ev = v.rpc1("rc_stage", model="tiny", version="v1", directory=durl, timeout_ms=60000)
        assert ev["ok"], ev
        st, body = v.post("/pause?mode=wait&clear_cache=false")
        assert st == 200, body
        inst = v.rpc1("rc_install", version="v1")
        assert inst["ok"] and inst["outcome"] == "installed", inst
        assert inst["verified"], inst
        assert not inst["fallback_tensors"] and not inst["not_loaded"], inst
        want_digest, _ = manifest_digests(durl, "tiny", "v1")
        assert inst["content_digest"] == want_digest, (inst["content_digest"], want_digest)
        # rc_install's "fp8": the quantizer's report under the proof of the image (per parameter).
        assert inst["fp8"]["scheme"] == scheme and len(inst["fp8"]["parameters"]) == 16, inst["fp8"]
        assert inst["fp8"]["match"] is True, inst["fp8"]
        st, body = v.post("/reset_prefix_cache")
        assert st == 200, body
        st, body = v.post("/resume")
        assert st == 200, body
        again = v.rpc1("rc_digest", fresh=True)
        assert again["ok"] and again["content_digest"] == want_digest, again
        img = v.rpc1("rc_fp8_image")
        assert img["ok"], img
        after = v.complete(prompt, max_tokens=16)["choices"][0]["text"]
    finally:
        v.stop()
    export = trainer.export("v1", str(tmp_path / "v1"))
    want = fp8_digest(export, scheme)["parameters"]
    bad = differing_parameters(img["parameters"], want)
    print(f"fp8 refit {quantization}: install {inst['install_ms']:.1f} ms ({inst['install_path']}), quantize "
          f"{inst['fp8']['quantize_ms']:.1f} ms; {len(want) - len(bad)} of {len(want)} parameters equal to "
          f"model fp8-digest of v1")
    figure(f"fp8_refit_{scheme}_quantize_ms", round(inst["fp8"]["quantize_ms"], 2))
    assert not bad, bad[:4]
    expect = fresh_greedy(export, 8420 + i, f"fp8_fresh_{scheme}", quantization, prompt)
    trainer.close()
    d.stop()
    print(f"fp8 refit {quantization}: greedy after refit == fresh vLLM on the export: {after == expect}; "
          f"changed from before: {after != before}")
    assert after == expect, (after, expect)
