"""CPU kernels against plain numpy references."""

import numpy as np
import pytest

from hororing.kernels import (divide_trunc, from_bf16, from_fp16, pack, reduce_into,
                              round_to_fp16, scale_into, to_bf16, to_fp16, unpack)

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


def test_fp16_compression_prescales_before_the_cast():
    # 4 ranks' worth of 30000 each would overflow float16 (max 65504) unless divided first
    source = np.full(5, 30000.0, dtype=np.float32)
    wire = np.empty(5, dtype=np.float16)
    to_fp16(source, wire, prescale=0.25)
    np.testing.assert_array_equal(wire, np.float16(7500.0))
    total = wire.astype(np.float32) * 4  # what the sum of 4 such ranks would be
    back = np.empty(5, dtype=np.float32)
    from_fp16(wire, back, postscale=4.0)
    np.testing.assert_array_equal(back, total)


def test_bf16_rounds_like_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 1e3,
                             np.array([0.0, -0.0, 1.0, 65504.0, 3.4e38, -3.4e38, np.inf, -np.inf,
                                       1.00390625, 1.01171875, 1e-40], dtype=np.float32)])
    bits = np.empty(values.size, dtype=np.uint16)
    to_bf16(values, bits)
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, expected)
    widened = np.empty(values.size, dtype=np.float32)
    from_bf16(bits, widened, postscale=2.0)
    reference = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy() * 2
    np.testing.assert_array_equal(widened, reference)


def test_bf16_keeps_nan_a_nan():
    bits = np.empty(2, dtype=np.uint16)
    to_bf16(np.array([np.nan, -np.nan], dtype=np.float32), bits)
    widened = np.empty(2, dtype=np.float32)
    from_bf16(bits, widened)
    assert np.isnan(widened).all()


def test_compression_rejects_wrong_dtypes():
    with pytest.raises(TypeError, match="to_fp16 output must be float16, got float32"):
        to_fp16(np.ones(2, np.float32), np.ones(2, np.float32))
    with pytest.raises(TypeError, match="to_bf16 source must be float32, got float64"):
        to_bf16(np.ones(2), np.ones(2, np.uint16))


def test_round_to_fp16_keeps_float32_storage_at_float16_precision():
    values = np.array([1.0, 1 + 2**-11, 1 + 2**-10, 65504.0, 1e-8, -3.14159], np.float32)
    rounded = values.copy()
    round_to_fp16(rounded)
    assert rounded.dtype == np.float32
    np.testing.assert_array_equal(rounded, values.astype(np.float16).astype(np.float32))
    with pytest.raises(TypeError, match="round_to_fp16 buffer must be float32"):
        round_to_fp16(np.ones(2))
