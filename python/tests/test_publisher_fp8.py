"""FP8 expected images from the trainer (docs/fp8.md, "The expected image, from the trainer"): two
ranks split every projection by rows (cutting through scale groups), exchange their amaxes and
publish their parts; the parts in the committed manifest add up, per fused parameter, to the
digests of the whole parameter quantized by the CPU quantizer (the image vLLM serves)."""

from __future__ import annotations

import numpy as np
import pytest

import rolloutcore
from rolloutcore.publisher import torch_amax_exchange  # noqa: F401  (importable without torch)
from rolloutcore.refit import core, fp8_parameter_of
from conftest import MODEL, shared_copy, tiny_weights

SCHEMES = {"fp8_per_tensor": "per_tensor", "fp8_per_channel": "per_channel", "fp8_per_block": "block"}
ORDER = ["q", "k", "v", "o", "gate", "up", "down"]


def _split(weights, cut):
    """Rank 0 gets rows [0, cut * rows), rank 1 the rest, of every 2-D tensor; 1-D ones go whole to rank 0."""
    ranks = [{}, {}]
    for name, a in weights.items():
        if a.ndim == 1:
            buf = rolloutcore.Publisher.allocate(a.shape, "bf16")
            buf[...] = a
            ranks[0][name] = (buf, [0])
            continue
        k = max(1, int(a.shape[0] * cut))
        for r, (lo, hi) in enumerate([(0, k), (k, a.shape[0])]):
            buf = rolloutcore.Publisher.allocate((hi - lo, a.shape[1]), "bf16")
            buf[...] = a[lo:hi]
            ranks[r][name] = (buf, [lo, 0])
    return ranks


def _whole_image(weights, scheme):
    """Per fused parameter: (bytes digest, scales digest) of the whole parameter quantized at once."""
    fused = {}
    for name, a in weights.items():
        of = fp8_parameter_of(name)
        if of:
            fused.setdefault(of[0], {})[of[1]] = a
    out = {}
    for param, parts in fused.items():
        bits = np.ascontiguousarray(np.concatenate([parts[p] for p in ORDER if p in parts], axis=0))
        q, s = core().quantize_fp8(bits, scheme)
        grid = s.reshape(s.shape[0], -1) if s.ndim == 2 else s.reshape(-1, 1) if scheme == "per_channel" else s.reshape(1, 1)
        out[param] = (int(rolloutcore.tensor_digest(q, dtype="f8_e4m3"), 16),
                      int(rolloutcore.tensor_digest(np.ascontiguousarray(grid, dtype=np.float32), dtype="f32"), 16))
    return out


def _published(manifest, quantization):
    sums = {}
    for t in manifest["tensors"]:
        of = fp8_parameter_of(t["name"])
        for sh in t["shards"]:
            part = sh.get("fp8", {}).get(quantization)
            assert (part is not None) == (of is not None), (t["name"], sh)
            if part:
                b, s = sums.get(of[0], (0, 0))
                sums[of[0]] = ((b + int(part["bytes"], 16)) % 2**64, (s + int(part["scales"], 16)) % 2**64)
    return sums


@pytest.mark.parametrize("quantization", sorted(SCHEMES))
def test_two_ranks_publish_parts_that_add_up_to_the_whole_image(cluster, version, quantization):
    weights = tiny_weights(seed=41)
    ranks = _split(weights, 0.37)
    pubs = [rolloutcore.Publisher(cluster.directory_url, MODEL, rank=r, world_size=2) for r in range(2)]
    try:
        for pub, shards in zip(pubs, ranks):
            for name, (buf, offset) in shards.items():
                pub.add_shard(version, name, buf, offset=offset, global_shape=list(weights[name].shape), dtype="bf16")
        local = [pub.fp8_amax(version, quantization) for pub in pubs]
        if quantization != "fp8_per_channel":
            # The row split cuts through scale groups: rank 0 alone cannot know their scales.
            assert "only in part" in local[0][1], local[0][1]
            with pytest.raises(ValueError, match="fp8_exchange"):
                pubs[0].publish(version, fp8=[quantization])
        else:
            assert local[0][1] == "" and local[1][1] == ""
        merged = {}
        for amax, _ in local:
            for k, v in amax.items():
                merged[k] = v if k not in merged else np.maximum(merged[k], v)
        reports = []
        for pub in pubs:
            assert pub.attach_fp8(version, quantization, merged) > 0
            reports.append(pub.publish(version))
        assert reports[-1]["state"] == "COMMITTED", reports
        manifest = cluster.directory.get(MODEL, version)
        got = _published(manifest, quantization)
        want = _whole_image(weights, SCHEMES[quantization])
        assert sorted(got) == sorted(want)
        assert got == want
    finally:
        for pub in pubs:
            pub.close()


def test_fp8_exchange_callable_is_used_by_publish(cluster, version):
    weights = shared_copy(tiny_weights(seed=42))
    pub = rolloutcore.Publisher(cluster.directory_url, MODEL)
    calls = []

    def exchange(q, amax):
        calls.append(q)
        return amax  # one rank: nothing to merge

    try:
        pub.add_tensors(version, weights, dtype="bf16")
        report = pub.publish(version, fp8=["fp8_per_block", "fp8_per_tensor"], fp8_exchange=exchange)
        assert report["state"] == "COMMITTED"
        assert calls == ["fp8_per_block", "fp8_per_tensor"]
        manifest = cluster.directory.get(MODEL, version)
        assert _published(manifest, "fp8_per_block") == _whole_image(weights, "block")
        assert _published(manifest, "fp8_per_tensor") == _whole_image(weights, "per_tensor")
    finally:
        pub.close()


def test_a_rank_without_a_shard_of_k_proj_needs_the_model_shapes(cluster, version):
    """Rows in chunks of 24: the third rank holds rows 48..64 of q_proj but none of k_proj (32 rows):
    it cannot place its q rows in qkv_proj without the model's shapes (fp8_model)."""
    weights = tiny_weights(seed=43)
    ranks = [{}, {}, {}]
    for name, a in weights.items():
        for r in range(3):
            lo, hi = 24 * r, (24 * (r + 1) if r < 2 else a.shape[0])
            if a.ndim == 1:
                lo, hi = (0, a.shape[0]) if r == 0 else (0, 0)
            if hi <= lo or lo >= a.shape[0]:
                continue
            buf = rolloutcore.Publisher.allocate((min(hi, a.shape[0]) - lo,) + a.shape[1:], "bf16")
            buf[...] = a[lo:hi]
            ranks[r][name] = (buf, [lo] + [0] * (a.ndim - 1))
    assert "model.layers.0.self_attn.k_proj.weight" not in ranks[2]
    assert "model.layers.0.self_attn.q_proj.weight" in ranks[2]
    pubs = [rolloutcore.Publisher(cluster.directory_url, MODEL, rank=r, world_size=3) for r in range(3)]
    model = {n: list(a.shape) for n, a in weights.items()}
    try:
        for pub, shards in zip(pubs, ranks):
            for name, (buf, offset) in shards.items():
                pub.add_shard(version, name, buf, offset=offset, global_shape=list(weights[name].shape), dtype="bf16")
        with pytest.raises(rolloutcore.errors.InvalidArgumentError, match="fp8_model"):
            pubs[2].fp8_amax(version, "fp8_per_channel")
        reports = [pub.publish(version, fp8=["fp8_per_channel"], fp8_model=model) for pub in pubs]
        assert reports[-1]["state"] == "COMMITTED", reports
        got = _published(cluster.directory.get(MODEL, version), "fp8_per_channel")
        assert got == _whole_image(weights, "per_channel")
    finally:
        for pub in pubs:
            pub.close()
