"""rolloutcore._core.quantize_fp8 against an independent numpy statement of docs/fp8.md's rule:
scales and E4M3 bytes equal for every scheme, over edge values; refusals; dequantization."""

from __future__ import annotations

import numpy as np
import pytest

from rolloutcore import _core
from rolloutcore.errors import InvalidArgumentError as InvalidArgument

F32 = np.float32


def e4m3_values() -> np.ndarray:
    """The 127 non-negative finite E4M3FN values, by code 0x00..0x7E (increasing)."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out, dtype=np.float64)


VALUES = e4m3_values()


def encode(v: np.ndarray) -> np.ndarray:
    """Nearest E4M3 code to each (already clamped, finite) float32, ties to the even code."""
    a = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(VALUES, a), 1, 0x7E)
    lo = hi - 1
    dlo, dhi = a - VALUES[lo], VALUES[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= VALUES[0x7E], 0x7E, code)
    return (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def reference(bits: np.ndarray, scheme: str, block=(128, 128)):
    x = (bits.astype(np.uint32) << 16).view(F32)
    rows, cols = bits.shape
    mag = np.abs(x)
    if scheme == "per_tensor":
        s = np.array([F32(mag.max()) / F32(448)], dtype=F32)
        with np.errstate(divide="ignore", invalid="ignore"):  # a zero scale: 0 * inf is NaN, clamped to 448
            v = x * (F32(1) / s[0])
        scales = s
    elif scheme == "per_channel":
        s = np.maximum(mag.max(axis=1) / F32(448), F32(1) / F32(229376)).astype(F32)
        v = x / s[:, None]
        scales = s.reshape(rows, 1)
    else:
        br, bc = block
        gr, gc = -(-rows // br), -(-cols // bc)
        s = np.zeros((gr, gc), dtype=F32)
        v = np.zeros_like(x)
        for i in range(gr):
            for j in range(gc):
                blk = mag[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
                s[i, j] = np.maximum(blk.max(), F32(1e-4)) * (F32(1) / F32(448))
                v[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc] * (F32(1) / s[i, j])
        scales = s
    with np.errstate(invalid="ignore"):
        v = np.fmax(F32(-448), np.fmin(v, F32(448)))
    return encode(v), scales


def edge_bits(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 0.02).astype(F32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    flat = bits.reshape(-1)
    n = flat.size
    flat[rng.integers(0, n, max(1, n // 20))] = rng.integers(1, 0x7F, max(1, n // 20)).astype(np.uint16)
    flat[rng.integers(0, n, max(1, n // 20))] = 0x8000
    walk = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
    walk = walk[(walk & 0x7F80) != 0x7F80]
    k = min(n // 3, walk.size)
    flat[rng.choice(n, k, replace=False)] = rng.choice(walk, k, replace=False)
    return bits


@pytest.mark.parametrize("scheme", ["per_tensor", "per_channel", "block"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (130, 257), (256, 384)])
def test_quantize_fp8_follows_the_rule(scheme, shape):
    bits = edge_bits(*shape, seed=shape[0] * 7 + shape[1])
    q, s = _core.quantize_fp8(bits, scheme, threads=2)
    rq, rs = reference(bits, scheme)
    assert s.shape == rs.shape
    assert s.view(np.uint32).tolist() == rs.view(np.uint32).tolist()
    diff = np.nonzero(q != rq)
    assert diff[0].size == 0, [(int(r), int(c), hex(int(bits[r, c])), hex(int(q[r, c])), hex(int(rq[r, c])))
                               for r, c in list(zip(*diff))[:5]]
    back = _core.dequantize_fp8(q, s, scheme)
    assert back.shape == bits.shape and np.all(np.isfinite(back))


def test_zero_weight_per_tensor_is_vllms_degenerate_case():
    bits = np.zeros((4, 64), dtype=np.uint16)
    q, s = _core.quantize_fp8(bits, "per_tensor")
    assert s.tolist() == [0.0] and (q == 0x7E).all()
    assert (_core.dequantize_fp8(q, s) == 0).all()


def test_non_finite_weights_and_bad_arguments_are_refused():
    bits = edge_bits(8, 40, 1)
    bits[3, 17] = 0x7FC0
    with pytest.raises(InvalidArgument, match=r"layer\.w\[3, 17\] is NaN"):
        _core.quantize_fp8(bits, "block", name="layer.w")
    with pytest.raises(InvalidArgument, match="unknown fp8 scaling 'per_row'"):
        _core.quantize_fp8(edge_bits(2, 2, 1), "per_row")
    with pytest.raises(InvalidArgument, match="uint16"):
        _core.quantize_fp8(np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(InvalidArgument, match="2-D"):
        _core.quantize_fp8(np.zeros(4, dtype=np.uint16))


def _read_safetensors(path):
    import json
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        assert e["dtype"] in ("BF16", "F32"), e["dtype"]
        dt = np.uint16 if e["dtype"] == "BF16" else np.float32
        out[name] = np.frombuffer(data[b:end], dtype=dt).reshape(e["shape"])
    return out


@pytest.mark.parametrize("scheme", ["per_tensor", "per_channel", "block"])
def test_model_fp8_digest_is_what_anyone_computes_from_the_checkpoint(tmp_path, scheme):
    """`rolloutcore model fp8-digest` against the same image built here from the checkpoint's bytes:
    q, k, v fused (and gate, up) as vLLM fuses them, quantized, digested as tensors."""
    import json
    import subprocess

    from rolloutcore.cluster import find_binary

    binary = find_binary()
    folder = tmp_path / "m"
    subprocess.run([binary, "model", "init", "--preset", "tiny", "--out", str(folder)], check=True,
                   capture_output=True)
    r = subprocess.run([binary, "model", "fp8-digest", "--json", "--scheme", scheme, str(folder)], check=True,
                       capture_output=True, text=True)
    report = json.loads(r.stdout)
    tensors = _read_safetensors(folder / "model.safetensors")
    params = report["parameters"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in params and "model.layers.1.mlp.gate_up_proj.weight" in params
    assert "model.embed_tokens.weight" in report["not_quantized"]
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight",
                 "model.layers.1.mlp.down_proj.weight"):
        p = params[name]
        fused = np.concatenate([tensors[part] for part in p["from"]], axis=0)
        assert list(fused.shape) == p["shape"]
        q, s = _core.quantize_fp8(np.ascontiguousarray(fused), scheme)
        grid = p["scales_shape"]
        assert _core.tensor_digest(q, dtype="f8_e4m3") == p["bytes_digest"], name
        assert _core.tensor_digest(np.ascontiguousarray(s.reshape(grid)), dtype="f32") == p["scales_digest"], name
    assert [t for t in params["model.layers.0.self_attn.qkv_proj.weight"]["from"]] == [
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight"]


@pytest.mark.parametrize("quantization,scheme,tp", [("fp8_per_tensor", "per_tensor", 2), ("fp8_per_channel", "per_channel", 2),
                                                    ("fp8_per_block", "block", 1)])
def test_engine_serving_fp8_holds_the_image_model_fp8_digest_computes(tmp_path, quantization, scheme, tp):
    """`engine serve --quantization` (docs/fp8.md, "The embedded engine") on a bf16 checkpoint: the FP8
    image its kernels read (live) and the one it expects are both the image `model fp8-digest`
    computes from the checkpoint alone, at any tensor-parallel size."""
    import json
    import re
    import subprocess
    import urllib.request

    from rolloutcore.cluster import find_binary

    binary = find_binary()
    folder = tmp_path / "m"
    subprocess.run([binary, "model", "init", "--preset", "tiny", "--seed", "9", "--out", str(folder)], check=True,
                   capture_output=True)
    r = subprocess.run([binary, "model", "fp8-digest", "--json", "--scheme", scheme, str(folder)], check=True,
                       capture_output=True, text=True)
    want = json.loads(r.stdout)
    proc = subprocess.Popen([binary, "engine", "serve", "--model", str(folder), "--port", "0", "--threads", "1",
                             "--tensor-parallel-size", str(tp), "--quantization", quantization],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        for line in proc.stdout:
            m = re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "engine serve printed no address"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/rc/weights/digest", timeout=60) as resp:
            got = json.load(resp)["fp8"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert got["quantization"] == quantization
    assert got["match"] is True, got
    assert got["live_digest"] == got["expected_digest"] == want["combined"]
    for name, p in want["parameters"].items():
        assert got["parameters"][name]["live"] == p["digest"], name
