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
