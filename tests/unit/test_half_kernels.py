"""float16 (and bfloat16 additions) through torch's kernels give numpy's bits,
subnormal values included (kernels/half.py)."""

import numpy as np
import pytest

from hororing.kernels import half, reduce_into, scale_into

torch = pytest.importorskip("torch")  # the fast path exists only where torch is imported
# 3e4 overflows float16 to infinities, whose bits must agree too
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


@pytest.mark.parametrize("magnitude", [1e-7, 1e-5, 1.0, 3e4], ids=str)
def test_float16_sum_and_scale_are_numpys_bits(magnitude):
    rng = np.random.default_rng(7)
    a = (rng.standard_normal(50_001) * magnitude).astype(np.float16)  # subnormal at 1e-7
    b = (rng.standard_normal(50_001) * magnitude).astype(np.float16)
    assert half.tensor(a) is not None  # torch's kernels, not numpy's, compute what follows
    summed = a.copy()
    reduce_into(summed, b, "sum")
    np.testing.assert_array_equal(summed.view(np.uint16), np.add(a, b).view(np.uint16))
    for factor in (0.5, 1 / 3, 0.125, 3.7):
        scaled = a.copy()
        scale_into(scaled, factor)
        expected = np.multiply(a, np.float16(factor))
        np.testing.assert_array_equal(scaled.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("magnitude", [1e-40, 1e-3, 1.0, 2e38], ids=str)
def test_bfloat16_sums_and_scales_are_ml_dtypes_bits(magnitude):
    from hororing.ops import BFLOAT16

    rng = np.random.default_rng(9)
    a = (rng.standard_normal(50_001) * magnitude).astype(BFLOAT16)  # subnormal at 1e-40
    b = (rng.standard_normal(50_001) * magnitude).astype(BFLOAT16)
    a[:4] = np.array([np.inf, -np.inf, 0.0, -0.0]).astype(BFLOAT16)
    assert half.tensor(a, bfloat16=True) is not None and half.tensor(a) is None
    summed = a.copy()
    reduce_into(summed[1:], b[1:], "sum")  # an offset view, as the ring's pieces are
    expected = a.copy()
    expected[1:] = np.add(a[1:], b[1:])
    # inf + -inf: both give a NaN, with a different sign bit (torch 0x7fc0, ml_dtypes 0xffc0)
    nan = np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(summed.astype(np.float32)), nan)
    np.testing.assert_array_equal(summed.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])
    for factor in (0.5, 1 / 3, 0.125, 3.7):
        scaled = a.copy()
        scale_into(scaled, factor)
        expected = np.multiply(a, BFLOAT16.type(factor))
        np.testing.assert_array_equal(scaled.view(np.uint16), expected.view(np.uint16))


def test_strided_float16_pieces_reduce_in_place():
    rng = np.random.default_rng(8)
    buffer = rng.standard_normal(1000).astype(np.float16)
    source = rng.standard_normal(1000).astype(np.float16)
    expected = buffer.copy()
    expected[100:900] = np.add(buffer[100:900], source[100:900])
    reduce_into(buffer[100:900], source[100:900], "sum")
    np.testing.assert_array_equal(buffer.view(np.uint16), expected.view(np.uint16))


def test_casts_between_float32_and_float16_through_torch_give_numpy_s_bits():
    """half.cast_into: float32 -> float16 rounds as numpy's cast does (normal, subnormal,
    overflowing, infinite, signed zero, NaN), float16 -> float32 is exact for every
    non-NaN pattern and keeps NaNs NaN; anything else is left to numpy."""
    rng = np.random.default_rng(3)
    wide = np.concatenate([rng.standard_normal(20_000) * scale for scale in
                           (1e-8, 3e-6, 6e-5, 1.0, 1e3, 7e4, 1e6)] +
                          [np.array([np.inf, -np.inf, -0.0, 0.0, np.nan, 65504, 65520,
                                     65519.99, 5.96e-8, 2.98e-8, 2.99e-8])]).astype(np.float32)
    narrow = np.empty(wide.shape, np.float16)
    assert half.cast_into(narrow, wide)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(narrow.view(np.uint16), wide.astype(np.float16).view(np.uint16))
    patterns = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    back = np.empty(patterns.shape, np.float32)
    assert half.cast_into(back, patterns)
    nan = np.isnan(patterns)
    np.testing.assert_array_equal(back.view(np.uint32)[~nan],
                                  patterns.astype(np.float32).view(np.uint32)[~nan])
    assert np.isnan(back[nan]).all()
    # strided views are fine; reversed ones, other dtypes and read-only targets are not taken
    assert half.cast_into(narrow[::2], wide[::2])
    assert not half.cast_into(narrow[::-1], wide)
    assert not half.cast_into(np.empty(3, np.float64), np.zeros(3, np.float16))
    frozen = np.zeros(3, np.float16)
    frozen.flags.writeable = False
    assert not half.cast_into(frozen, np.zeros(3, np.float32))
