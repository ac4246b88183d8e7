"""vLLM's own fp8 quantization of bf16 weights against rolloutcore's (formats/fp8.h), bit for bit.

Run by test_fp8_vllm.py in a child process whose PYTHONPATH holds the vLLM kit and rolloutcore's
package (vLLM is imported, not served). For each scheme vLLM 0.33 quantizes a bf16 checkpoint with
(--quantization fp8_per_tensor, fp8_per_channel, fp8_per_block), the weights are quantized on the GPU
by vLLM's own functions - the ones its online linear methods call in process_weights_after_loading
(online/fp8.py: weight_amax + _fp8_scale + ops.scaled_fp8_quant; _fp8_channel_scale +
_fp8_quant_per_channel; utils/deep_gemm.per_block_cast_to_fp8) - and on the CPU by
rolloutcore._core.quantize_fp8. Prints one JSON line: per scheme and shape, the elements and scales
compared and how many differ, with the first differences.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from rolloutcore import _core


def weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    bits = w.view(torch.int16).numpy().view(np.uint16).copy()
    rng = np.random.default_rng(seed)
    n = bits.size
    flat = bits.reshape(-1)
    # Edges: bf16 subnormals, zeros, powers of two, and a walk over every finite bf16 code.
    flat[rng.integers(0, n, n // 50)] = rng.integers(1, 0x7F, n // 50).astype(np.uint16)
    flat[rng.integers(0, n, n // 50)] = 0
    walk = np.arange(0, 0x10000, dtype=np.uint32).astype(np.uint16)
    walk = walk[(walk & 0x7F80) != 0x7F80]
    k = min(n // 4, walk.size)
    flat[rng.choice(n, k, replace=False)] = rng.choice(walk, k, replace=False)
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def compare(ours_q, ours_s, theirs_q, theirs_s, w_bits):
    tq = theirs_q.view(torch.uint8).cpu().numpy().reshape(ours_q.shape)
    ts = theirs_s.float().cpu().numpy().reshape(-1)
    os_ = np.asarray(ours_s, dtype=np.float32).reshape(-1)
    dq = np.nonzero(tq != ours_q)
    ds = np.nonzero(ts.view(np.uint32) != os_.view(np.uint32))[0]
    first = [
        {"at": [int(r), int(c)], "bf16": f"0x{int(w_bits[r, c]):04x}", "vllm": f"0x{int(tq[r, c]):02x}",
         "ours": f"0x{int(ours_q[r, c]):02x}"}
        for r, c in list(zip(*dq))[:5]
    ]
    return {"elements": int(ours_q.size), "elements_differ": int(dq[0].size), "scales": int(os_.size),
            "scales_differ": int(ds.size), "first_scale_diffs": [[float(ts[i]), float(os_[i])] for i in ds[:3]],
            "first_element_diffs": first}


def main() -> int:
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.online import fp8 as online
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    dev = torch.device("cuda")
    out = {"vllm": __import__("vllm").__version__, "isa": _core.fp8_quantize_isa, "cases": []}
    shapes = [(1024, 1024), (4096, 1536), (200, 333), (128, 128), (7, 4099)]
    for i, (rows, cols) in enumerate(shapes):
        w = weights(rows, cols, 100 + i)
        bits = w.view(torch.int16).numpy().view(np.uint16)
        wd = w.to(dev)
        # per tensor: online.Fp8PerTensorOnlineLinearMethod.process_weights_after_loading (TP 1)
        scale = online._fp8_scale(weight_amax(wd).reshape(1))
        q, _ = ops.scaled_fp8_quant(wd, scale=scale)
        oq, osc = _core.quantize_fp8(bits, "per_tensor")
        out["cases"].append({"scheme": "per_tensor", "shape": [rows, cols], **compare(oq, osc, q, scale, bits)})
        # per channel: Fp8PtpcOnlineLinearMethod
        cscale = online._fp8_channel_scale(weight_amax(wd, dim=-1, keepdim=True))
        cq = online._fp8_quant_per_channel(wd, cscale)
        oq, osc = _core.quantize_fp8(bits, "per_channel")
        out["cases"].append({"scheme": "per_channel", "shape": [rows, cols], **compare(oq, osc, cq, cscale, bits)})
        # block: Fp8PerBlockOnlineLinearMethod
        bq, bs = per_block_cast_to_fp8(wd, block_size=[128, 128], use_ue8m0=False)
        oq, osc = _core.quantize_fp8(bits, "block", (128, 128))
        out["cases"].append({"scheme": "block", "shape": [rows, cols], **compare(oq, osc, bq, bs, bits)})
    # An all-zero weight per tensor (scale 0: vLLM's kernel writes 448 for 0 * inf = NaN).
    z = torch.zeros(64, 256, dtype=torch.bfloat16)
    zb = z.view(torch.int16).numpy().view(np.uint16)
    zd = z.to(dev)
    zs = online._fp8_scale(weight_amax(zd).reshape(1))
    zq, _ = ops.scaled_fp8_quant(zd, scale=zs)
    oq, osc = _core.quantize_fp8(zb, "per_tensor")
    out["cases"].append({"scheme": "per_tensor", "shape": [64, 256], "zeros": True, **compare(oq, osc, zq, zs, zb)})
    print("FP8_BITS " + json.dumps(out), flush=True)
    return 0 if all(c["elements_differ"] == 0 and c["scales_differ"] == 0 for c in out["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
