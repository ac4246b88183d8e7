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


def test_gpu_quantizer_is_the_cpu_quantizer_bit_for_bit_on_both_kernel_paths():
    """rolloutcore._core.quantize_fp8_device (the CUDA quantizer the vLLM extension installs with)
    against _core.quantize_fp8 (the CPU one, checked against vLLM above): the same bytes and scales
    on the vectorized kernels (cols % 8 == 0, aligned) and on the per-segment ones (odd columns,
    a misaligned start), for every scheme; a non-finite weight is refused naming its place and
    leaves the output untouched. Also the GPU FP8 image digest against the CPU one."""
    sys.path.insert(0, RC_PYTHONPATH)
    import numpy as np

    from rolloutcore import _core

    torch.manual_seed(3)
    dev = torch.device("cuda:0")
    shapes = [(4096, 1536), (1024, 1024), (3072, 4096), (200, 336), (7, 4099), (130, 1000), (1, 8)]
    cases = []
    for scheme in ("per_tensor", "per_channel", "block"):
        for rows, cols in shapes:
            for offset in (0, 1):  # 1: the bf16 start is 2 bytes past 16-byte alignment
                if offset and (rows, cols) != (200, 336):
                    continue
                base = (torch.randn(rows * cols + offset, device=dev) * 0.02).to(torch.bfloat16)
                base[offset + 5] = 3.5  # an outlier: a scale far from the rest
                w = base[offset:].view(rows, cols)
                q = torch.zeros((rows, cols), dtype=torch.uint8, device=dev)
                grid = {"per_tensor": (1,), "per_channel": (rows, 1),
                        "block": (-(-rows // 128), -(-cols // 128))}[scheme]
                s = torch.zeros(grid, dtype=torch.float32, device=dev)
                _core.quantize_fp8_device(0, w.data_ptr(), rows, cols, scheme, q.data_ptr(), s.data_ptr())
                bits = w.cpu().view(torch.int16).numpy().view(np.uint16)
                cq, cs = _core.quantize_fp8(bits, scheme=scheme)
                dq = int((q.cpu().numpy() != cq).sum())
                ds = int((s.cpu().numpy().reshape(cs.shape) != cs).sum())
                cases.append((scheme, rows, cols, offset, dq, ds))
                print(f"gpu fp8 {scheme:11} [{rows}, {cols}] offset {offset}: {dq} bytes, {ds} scales differ")
    assert all(dq == 0 and ds == 0 for *_, dq, ds in cases), [c for c in cases if c[-1] or c[-2]]
    # Refusal: nothing written, the place named.
    w = (torch.randn(256, 512, device=dev) * 0.02).to(torch.bfloat16)
    w[17, 300] = float("nan")
    q = torch.full((256, 512), 7, dtype=torch.uint8, device=dev)
    s = torch.full((2, 4), 9.0, dtype=torch.float32, device=dev)
    with pytest.raises(Exception, match=r"w\[17, 300\] is NaN"):
        _core.quantize_fp8_device(0, w.data_ptr(), 256, 512, "block", q.data_ptr(), s.data_ptr(), name="w")
    assert int((q != 7).sum()) == 0 and int((s != 9.0).sum()) == 0
    # The FP8 image digest on the GPU is the CPU's (`model fp8-digest`'s rule).
    w = (torch.randn(384, 640, device=dev) * 0.02).to(torch.bfloat16)
    q = torch.empty((384, 640), dtype=torch.uint8, device=dev)
    s = torch.empty((3, 5), dtype=torch.float32, device=dev)
    _core.quantize_fp8_device(0, w.data_ptr(), 384, 640, "block", q.data_ptr(), s.data_ptr())
    got = _core.fp8_image_digest_device(0, [("p", q.data_ptr(), 384, 640, s.data_ptr(), 3, 5)])
    assert got["parameters"]["p"]["bytes_digest"] == _core.tensor_digest(q.cpu().numpy(), dtype="f8_e4m3")
    assert got["parameters"]["p"]["scales_digest"] == _core.tensor_digest(s.cpu().numpy(), dtype="f32")
