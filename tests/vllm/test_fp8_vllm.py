"""rolloutcore's fp8 quantizer (formats/fp8.h) against vLLM's own quantization of the same bf16
weights, bit for bit: E4M3 bytes and scales for fp8_per_tensor, fp8_per_channel and fp8_per_block
(labels gpu, vllm; scripts/gpu/run_vllm.sh with VLLM_KIT=0.33). The comparison runs in a child
process (fp8_vllm_bits.py) that imports vLLM from the kit; no server is started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from vllm_harness import RC_PYTHONPATH, VLLM_SITE, site_version  # noqa: E402

if not (site_version(VLLM_SITE) or "").startswith("0.33."):
    pytest.skip(f"vLLM 0.33's online fp8 methods: {VLLM_SITE} holds {site_version(VLLM_SITE) or '(none)'}",
                allow_module_level=True)


def test_fp8_quantizer_matches_vllm_bit_for_bit():
    env = dict(os.environ)
    env["PYTHONPATH"] = ":".join(p for p in (RC_PYTHONPATH, VLLM_SITE, env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "fp8_vllm_bits.py")],
                       env=env, capture_output=True, text=True, timeout=600)
    line = next((l for l in r.stdout.splitlines() if l.startswith("FP8_BITS ")), None)
    assert line is not None, f"no result (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    got = json.loads(line[len("FP8_BITS "):])
    for c in got["cases"]:
        print(f"fp8 {c['scheme']:11} {c['shape']}: {c['elements_differ']} of {c['elements']} bytes and "
              f"{c['scales_differ']} of {c['scales']} scales differ from vLLM {got['vllm']}"
              + (f"; first: {c['first_element_diffs']} {c['first_scale_diffs']}" if c["elements_differ"]
                 or c["scales_differ"] else ""))
    bad = [c for c in got["cases"] if c["elements_differ"] or c["scales_differ"]]
    assert not bad, json.dumps(bad, indent=1)
