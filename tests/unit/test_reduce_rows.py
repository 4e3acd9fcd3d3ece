"""Rows combined in rank order (``small.reduce_rows``): a 2-D array of rows gives the bits of
one row after another, as a list of rows does, at every row count and width (numpy reduces a
single column of 8 rows or more in interleaved partial sums, which is not rank order)."""

import numpy as np
import pytest

from hororing.algorithms.small import REDUCE_BY_NAME, reduce_rows


def one_after_another(ufunc, rows):
    out = rows[0].copy()
    for row in rows[1:]:
        out = ufunc(out, row)
    return out


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("ranks", [3, 8, 9, 16, 17])
@pytest.mark.parametrize("width", [1, 2, 7])
def test_a_2d_array_of_rows_gives_rank_orders_bits(dtype, ranks, width):
    with np.errstate(over="ignore", invalid="ignore"):  # float16 products overflow to inf
        check_every_op(dtype, ranks, width)


def check_every_op(dtype, ranks, width):
    rng = np.random.default_rng([ranks, width])
    for name in ("sum", "product", "max", "min"):
        ufunc = REDUCE_BY_NAME[name]
        for _ in range(40):
            # rows of very different sizes: any other order rounds differently
            scale = rng.choice([1e-2, 1.0, 3e3], (ranks, 1))
            values = (rng.standard_normal((ranks, width)) * scale).astype(dtype)
            wide = np.zeros((ranks, width + 5), dtype)  # a view with a row stride, as gathered
            wide[:, :width] = values
            rows = wide[:, :width]
            out = np.empty(width, dtype)
            reduce_rows(ufunc, rows, out)
            expected = one_after_another(ufunc, list(values))
            assert out.tobytes() == expected.tobytes(), (name, values)
            listed = np.empty(width, dtype)
            reduce_rows(ufunc, [row for row in values], listed)
            assert listed.tobytes() == expected.tobytes(), name
