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
from vllm_harness import OUT, VLLM_SITE, Vllm, site_version  # noqa: E402

from rolloutcore.cluster import find_binary  # noqa: E402

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


@pytest.mark.parametrize("quantization,scheme", SCHEMES)
def test_vllm_fp8_image_is_the_image_computed_from_the_checkpoint(tiny, quantization, scheme):
    r = subprocess.run([find_binary(), "model", "fp8-digest", "--json", "--scheme", scheme, tiny], check=True,
                       capture_output=True, text=True)
    want = json.loads(r.stdout)["parameters"]
    v = Vllm(tiny, 8400 + [q for q, _ in SCHEMES].index(quantization), f"fp8_{scheme}",
             extra=["--quantization", quantization])
    try:
        v.wait_healthy()
        got = v.rpc1("rc_fp8_image")
        assert got["ok"], got
        # Refit into FP8 parameters is not built yet: the stage is refused before anything is
        # fetched (the directory URL is never contacted) or touched.
        refused = v.rpc1("rc_stage", model="m", version="v1", directory="http://127.0.0.1:9")
        assert not refused["ok"] and refused["code"] == "FailedPrecondition", refused
        assert "FP8" in refused["error"], refused
        digest = v.rpc1("rc_digest")
        assert not digest["ok"] and digest["code"] == "FailedPrecondition", digest
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
