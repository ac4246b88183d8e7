"""The view geometry of the vLLM worker extension's capture (rolloutcore.vllm._View), against numpy.

Each test applies the same chain of view operations to a numpy array whose elements are their own
flat indices and to a _View of the same shape, and checks that the _View's box and dim order name
exactly the elements numpy selected, in the same order. Runs without torch or vLLM; the capture
itself (a TorchFunctionMode over vLLM's real load_weights) is tested on the GPU machine
(tests/vllm/test_vllm.py).
"""

import itertools

import numpy as np
import pytest

from rolloutcore.vllm import _getitem, _View


def indices_of(v: _View) -> np.ndarray:
    """The source flat indices a view walks, as an array of the view's shape."""
    src = np.arange(int(np.prod(v.source_shape))).reshape(v.source_shape)
    box = src[tuple(slice(s, s + e) for s, e in zip(v.start, v.extent))]
    walked = [s for s in v.v2s if s >= 0]
    selected = [d for d in range(len(v.source_shape)) if d not in walked]
    for d in selected:
        assert v.extent[d] == 1, f"source dim {d} not walked but extent {v.extent[d]}"
    order = walked + selected
    out = np.transpose(box, order)
    out = out.reshape([v.extent[s] for s in walked])
    # Insert unit dims where the view has them.
    shape = v.shape()
    return out.reshape(shape)


def check(v: _View, expected: np.ndarray) -> None:
    assert not v.reason, v.reason
    got = indices_of(v)
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def base(shape):
    return _View("t", "bf16", shape), np.arange(int(np.prod(shape))).reshape(shape)


def test_narrow_then_transpose_like_a_row_parallel_shard():
    v, a = base([6, 8])
    check(v.narrow(1, 2, 4).transpose(0, 1), a[:, 2:6].T)


def test_qkv_style_narrows_compose():
    v, a = base([12, 4])
    check(v.narrow(0, 4, 6).narrow(0, 2, 2), a[4:10][2:4])


def test_select_unsqueeze_squeeze():
    v, a = base([3, 4, 5])
    check(v.select(1, 2), a[:, 2])
    check(v.select(-1, -1).unsqueeze(0), a[..., -1][None])
    check(v.narrow(1, 1, 1).squeeze([1]), a[:, 1:2].squeeze(1))


def test_getitem_slices_ints_ellipsis_and_none():
    v, a = base([4, 6, 2])
    for idx in [(slice(1, 3),), (Ellipsis, 1), (2, slice(None), None), (slice(None), slice(-4, None), 0),
                (None, Ellipsis, slice(0, 1))]:
        check(_getitem(v, idx), a[idx])


def test_permute_and_unit_reshape():
    v, a = base([2, 3, 4])
    check(v.permute([2, 0, 1]), np.transpose(a, [2, 0, 1]))
    check(v.narrow(0, 1, 1).reshape([3, 4]), a[1:2].reshape(3, 4))
    check(v.reshape([1, 2, 3, 4, 1]), a.reshape(1, 2, 3, 4, 1))


def test_chunks_cover_the_tensor():
    v, a = base([10, 3])
    sizes = [4, 4, 2]  # torch.chunk(10, 3) pieces
    off = 0
    for n in sizes:
        check(v.narrow(0, off, n), a[off:off + n])
        off += n


@pytest.mark.parametrize("op", ["reshape merges", "step slice", "bad narrow"])
def test_what_is_not_a_view_is_unsupported_and_sticky(op):
    v, _ = base([4, 6])
    if op == "reshape merges":
        u = v.reshape([24])
    elif op == "step slice":
        u = _getitem(v, (slice(None, None, 2),))
    else:
        u = v.narrow(0, 3, 2)
    assert u.reason
    assert u.narrow(0, 0, 1).reason == u.reason  # sticky through later views


def test_random_chains_match_numpy():
    rng = np.random.default_rng(7)
    for _ in range(300):
        shape = [int(x) for x in rng.integers(1, 5, size=int(rng.integers(1, 4)))]
        v, a = base(shape)
        for _ in range(int(rng.integers(1, 5))):
            nd = a.ndim
            op = rng.integers(0, 4)
            if op == 0 and nd > 0:
                d = int(rng.integers(0, nd))
                size = a.shape[d]
                if size == 0:
                    continue
                start = int(rng.integers(0, size))
                length = int(rng.integers(0, size - start + 1))
                v = v.narrow(d, start, length)
                a = a[(slice(None),) * d + (slice(start, start + length),)]
            elif op == 1 and nd > 1:
                order = [int(x) for x in rng.permutation(nd)]
                v = v.permute(order)
                a = np.transpose(a, order)
            elif op == 2 and nd > 1:
                d = int(rng.integers(0, nd))
                if a.shape[d] == 0:
                    continue
                i = int(rng.integers(0, a.shape[d]))
                v = v.select(d, i)
                a = np.take(a, i, axis=d)
            elif op == 3:
                d = int(rng.integers(0, nd + 1))
                v = v.unsqueeze(d)
                a = np.expand_dims(a, d)
        if a.size:
            check(v, a)


def test_itertools_product_of_small_boxes():
    v, a = base([3, 3])
    for (r0, r1), (c0, c1) in itertools.product([(0, 1), (1, 3), (0, 3)], repeat=2):
        check(v.narrow(0, r0, r1 - r0).narrow(1, c0, c1 - c0), a[r0:r1, c0:c1])
