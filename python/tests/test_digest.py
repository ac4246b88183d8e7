"""rc-digest-2 (include/rolloutcore/refit/digest.h) written out in numpy, independently of the
compiled core, against rolloutcore.tensor_digest: whole tensors, shards at offsets, every dtype width
the digest zero-extends, and the properties the design relies on (shards sum to the whole; any
single-element change changes the digest)."""

from __future__ import annotations

import numpy as np
import pytest

import rolloutcore

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def reference_digest(bits: np.ndarray, global_shape, offset=None) -> int:
    """Sum over the box's elements of ((b ^ A) * B) mod 2**64 (numpy uint64 arithmetic wraps)."""
    offset = [0] * bits.ndim if offset is None else list(offset)
    idx = np.indices(bits.shape).reshape(bits.ndim, -1) + np.array(offset).reshape(-1, 1)
    i = np.ravel_multi_index(tuple(idx), tuple(global_shape)).astype(np.uint64) if bits.ndim else np.zeros(1, np.uint64)
    b = bits.reshape(-1).astype(np.uint64)
    key = _mix64((i >> np.uint64(6)) + _GOLDEN)
    j = i & np.uint64(63)
    a = (key >> np.uint64(32)) ^ ((j * np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF))
    m = (key + j * np.uint64(0xD1B54A32D192ED03)) | np.uint64(1)
    return int(((b ^ a) * m).sum(dtype=np.uint64))


def _hex(v: int) -> str:
    return f"{v:016x}"


def test_golden_term_of_the_header() -> None:
    # f32 1.0 alone: the C++ test pins the same value (digest_test.cc).
    assert reference_digest(np.array([0x3F800000], np.uint32), [1]) == 0x642FBCD4AE096D72
    assert rolloutcore.tensor_digest(np.array([1.0], np.float32)) == "642fbcd4ae096d72"


@pytest.mark.parametrize("dtype,np_dtype", [("bf16", np.uint16), ("f32", np.float32), ("i8", np.int8),
                                             ("i64", np.int64)])
def test_compiled_digest_equals_the_numpy_reference(dtype: str, np_dtype) -> None:
    rng = np.random.default_rng(7)
    shape = (37, 129)  # rows not a multiple of 64: blocks straddle rows
    raw = rng.integers(0, 2**63, size=shape, dtype=np.int64).astype(np_dtype)
    bits = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[raw.itemsize])
    kw = {"dtype": dtype} if dtype == "bf16" else {}  # the others follow the numpy dtype
    assert rolloutcore.tensor_digest(raw, **kw) == _hex(reference_digest(bits, shape))
    # A shard at an offset (global indices, not local ones) and the shards' sum.
    total = 0
    for r0, r1 in ((0, 10), (10, 37)):
        for c0, c1 in ((0, 70), (70, 129)):
            part = np.ascontiguousarray(raw[r0:r1, c0:c1])
            got = rolloutcore.tensor_digest(part, global_shape=shape, offset=(r0, c0), **kw)
            assert got == _hex(reference_digest(bits[r0:r1, c0:c1], shape, (r0, c0)))
            total = (total + int(got, 16)) % 2**64
    assert _hex(total) == rolloutcore.tensor_digest(raw, **kw)


def test_every_single_element_change_changes_it() -> None:
    rng = np.random.default_rng(3)
    v = rng.integers(0, 2**16, size=150, dtype=np.uint16)
    d = reference_digest(v, [150])
    assert rolloutcore.tensor_digest(v, dtype="bf16") == _hex(d)
    for e in range(v.size):
        for bit in range(16):
            w = v.copy()
            w[e] ^= np.uint16(1 << bit)
            assert reference_digest(w, [150]) != d, (e, bit)
