"""CPU kernels against plain numpy references."""

import numpy as np
import pytest

from hororing.kernels import divide_trunc, pack, reduce_into, scale_into, unpack

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,reference", [("sum", lambda a, b: a + b), ("min", np.minimum),
                                          ("max", np.maximum), ("product", lambda a, b: a * b)])
def test_reduce_into_matches_numpy(dtype, op, reference):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 5, 1001).astype(dtype)
    b = rng.integers(0, 5, 1001).astype(dtype)
    expected = reference(a.copy(), b)
    reduce_into(a, b, op)
    np.testing.assert_array_equal(a, expected)


def test_reduce_into_rejects_unknown_op():
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        reduce_into(np.ones(2), np.ones(2), "avg")


def test_divide_trunc_rounds_toward_zero():
    values = np.array([7, -7, 6, -6, 1, -1, 0, np.iinfo(np.int64).max], dtype=np.int64)
    expected = np.array([int(v / 3) if abs(v) < 2**52 else v // 3 for v in values.tolist()])
    divide_trunc(values, 3)
    np.testing.assert_array_equal(values, expected)
    unsigned = np.array([7, 8, 255], dtype=np.uint8)
    divide_trunc(unsigned, 2)
    np.testing.assert_array_equal(unsigned, [3, 4, 127])


def test_scale_into_floats_and_integers():
    floats = np.array([1.0, -2.0], dtype=np.float32)
    scale_into(floats, 0.5)
    np.testing.assert_array_equal(floats, [0.5, -1.0])
    ints = np.array([5, -5], dtype=np.int32)
    scale_into(ints, 0.5)
    np.testing.assert_array_equal(ints, [2, -2])


def test_pack_unpack_roundtrip():
    arrays = [np.arange(6.0).reshape(2, 3), np.array([9.0]), np.zeros((0, 4))]
    buffer = np.empty(10)
    ranges = pack(arrays, buffer)
    assert ranges == [(0, 6), (6, 7), (7, 7)]
    outputs = [np.empty_like(array) for array in arrays]
    unpack(buffer, ranges, outputs)
    for array, output in zip(arrays, outputs):
        np.testing.assert_array_equal(array, output)
