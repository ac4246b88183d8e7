"""Delta refit from Python (docs/refit.md "Delta refit"): the change mask on numpy and torch
tensors (bf16, f16, f32; contiguous and DTensor-sharded, torch tests skipped without torch), and a
delta published by the Python Publisher round-tripped through a receiver."""

from __future__ import annotations

import numpy as np
import pytest

import rolloutcore
from rolloutcore.refit import changed_elements
from conftest import MODEL, expected_digest, shared_copy, tiny_weights


def _flip(bits: np.ndarray, every: int) -> np.ndarray:
    out = bits.copy()
    flat = out.reshape(-1)
    flat[::every] ^= 1  # the lowest mantissa bit of every `every`-th element
    return out


@pytest.mark.parametrize("dtype", [np.uint16, np.float16, np.float32])
def test_change_mask_numpy_finds_exactly_the_changed_bits(dtype):
    rng = np.random.default_rng(1)
    if dtype is np.uint16:  # bf16 bits
        old = rng.integers(0, 2**16, size=(37, 41), dtype=np.uint16)
        new = _flip(old, 11)
    else:
        old = rng.standard_normal((37, 41)).astype(dtype)
        width = {np.float16: np.uint16, np.float32: np.uint32}[dtype]
        new = _flip(old.view(width), 11).view(dtype)
    offsets, values = changed_elements(old, new)
    assert offsets.dtype == np.int64
    np.testing.assert_array_equal(offsets, np.arange(0, old.size, 11))
    np.testing.assert_array_equal(values.view(np.uint8), new.reshape(-1)[offsets].view(np.uint8))
    # -0.0 vs +0.0 differ in bits: a change (the digest sees bits, not values).
    if dtype is not np.uint16:
        z = np.zeros(4, dtype=dtype)
        nz = z.copy()
        nz[2] = -0.0
        assert changed_elements(z, nz)[0].tolist() == [2]
    with pytest.raises(ValueError):
        changed_elements(old, new[:5])


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed")


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_change_mask_torch_on_the_tensors_device(name):
    t = _torch()
    dtype = getattr(t, name)
    device = "cuda" if t.cuda.is_available() else "cpu"
    old = t.randn(33, 17, dtype=t.float32, device=device).to(dtype)
    new = old.clone()
    new.view(-1)[::7] = new.view(-1)[::7] * 2 + 1
    offsets, values = changed_elements(old, new)
    assert offsets.device == old.device, "the mask is computed where the tensor lives"
    want = t.nonzero((old.view(-1) != new.view(-1)), as_tuple=False).reshape(-1)
    assert t.equal(offsets, want)
    assert t.equal(values, new.view(-1)[want])


def test_change_mask_dtensor_uses_the_local_shard():
    t = _torch()
    dist = pytest.importorskip("torch.distributed", reason="torch.distributed is not available")
    try:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError:
        pytest.skip("DTensor is not available in this torch")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    full_old = t.randn(8, 6).to(t.bfloat16)
    full_new = full_old.clone()
    full_new[3, 2] = full_new[3, 2] + 1
    old = distribute_tensor(full_old, mesh, [Shard(0)])
    new = distribute_tensor(full_new, mesh, [Shard(0)])
    offsets, values = changed_elements(old, new)
    assert offsets.tolist() == [3 * 6 + 2]
    assert values.tolist() == [full_new[3, 2].item()]


def test_delta_published_from_python_round_trips_through_a_receiver(cluster, version):
    base, nxt = version + "-base", version + "-next"  # never a label the fixture hands out later
    weights = shared_copy(tiny_weights(seed=41))
    pub = rolloutcore.Publisher(cluster.directory_url, MODEL, delta=True)
    with pytest.raises(ValueError):
        pub.publish("never", delta=False)
    pub.add_tensors(base, weights, dtype="bf16")
    r0 = pub.publish(base)
    assert r0["state"] == "COMMITTED" and r0["delta_base"] == ""
    assert cluster.controller.update_to(MODEL, base, timeout_s=120)["outcome"] == "committed"

    # The next version: about 1 % of the elements change (new buffers, as a trainer step makes).
    changed = {}
    nxt_weights = {}
    for name, bits in weights.items():
        buf = rolloutcore.Publisher.allocate(bits.shape, "bf16")
        buf[...] = _flip(np.asarray(bits), 97)
        nxt_weights[name] = buf
        changed[name] = changed_elements(np.asarray(bits), np.asarray(buf))[0].size
    pub.add_tensors(nxt, nxt_weights, dtype="bf16")
    r1 = pub.publish(nxt, delta=True)
    assert r1["delta_base"] == base
    assert r1["delta_changed"] == sum(changed.values())
    assert r1["delta_bytes"] < r1["bytes"] * 0.05

    staged = cluster.engine.stage(MODEL, nxt, cluster.directory_url)
    assert staged["mode"] == "delta", staged
    assert staged["delta_base"] == base
    assert staged["changed_published"] == r1["delta_changed"]
    rec = cluster.controller.update_to(MODEL, nxt, timeout_s=120)
    assert rec["outcome"] == "committed", rec
    live = cluster.engine.weights_digest()
    assert live["weight_version"] == nxt
    assert live["content_digest"] == r1["content_digest"] == expected_digest(nxt_weights)
    pub.close()


def test_encode_delta_from_changes_counts_and_refuses_bad_lists():
    """The encoder the Publisher uses for shards in device memory (the change list comes from the
    GPU mask): the payload holds exactly the changes; offsets out of order or out of the shard, or
    values of the wrong length, are refused naming the problem."""
    from rolloutcore.refit import core

    old = np.arange(64 * 300, dtype=np.uint16).reshape(64, 300)
    new = _flip(old, 97)
    offsets, values = changed_elements(old, new)
    payload, count = core().encode_delta_from_changes("bf16", [64, 300], offsets, values.view(np.uint8))
    assert count == offsets.size > 0
    assert payload.dtype == np.uint8 and bytes(payload[:4]) == b"RCDL"
    # Sparse: a few bytes per change plus the tile table, far below the shard's 38 400 bytes.
    assert payload.size < old.nbytes * 0.1
    with pytest.raises(rolloutcore.InvalidArgumentError):
        core().encode_delta_from_changes("bf16", [64, 300], offsets[::-1].copy(), values.view(np.uint8))
    with pytest.raises(rolloutcore.InvalidArgumentError):
        core().encode_delta_from_changes("bf16", [64, 300], np.array([64 * 300], dtype=np.int64),
                                         np.zeros(2, np.uint8))
    with pytest.raises(rolloutcore.InvalidArgumentError):
        core().encode_delta_from_changes("bf16", [64, 300], offsets, values.view(np.uint8)[:-1])
