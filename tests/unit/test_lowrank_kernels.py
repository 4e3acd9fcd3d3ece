"""PowerSGD's products (kernels/lowrank.py), through torch and through numpy, against a
float64 reference computed here."""

import sys

import numpy as np
import pytest
import torch  # noqa: F401 - imported, so the kernels may use it

from hororing.kernels import lowrank


@pytest.fixture(params=["torch", "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":  # as in a process that never imported torch
        monkeypatch.setitem(sys.modules, "torch", None)
    return request.param


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(7, 5, 1), (64, 33, 4), (300, 1000, 2), (1, 9, 1)])
def test_each_product_is_the_float64_product(path, dtype, shape):
    n, m, r = shape
    rng = np.random.default_rng(n * m * r)
    matrix = rng.standard_normal((n, m)).astype(dtype)
    q = rng.standard_normal((m, r)).astype(dtype)
    p = rng.standard_normal((n, r)).astype(dtype)
    tolerance = dict(rtol=1e-4, atol=1e-4 * np.sqrt(m)) if dtype == np.float32 else \
        dict(rtol=1e-10, atol=1e-10)
    wide = matrix.astype(np.float64)

    out = np.full((n, r), np.nan, dtype)
    assert lowrank.project(matrix, q, out) is out
    np.testing.assert_allclose(out, wide @ q.astype(np.float64), **tolerance)

    out = np.full((m, r), np.nan, dtype)
    assert lowrank.project_back(matrix, p, out) is out
    np.testing.assert_allclose(out, wide.T @ p.astype(np.float64), **tolerance)

    out = np.full((n, m), np.nan, dtype)
    assert lowrank.expand(p, q, out) is out
    np.testing.assert_allclose(out, p.astype(np.float64) @ q.astype(np.float64).T,
                               **tolerance)


def test_views_that_torch_cannot_take_go_through_numpy():
    """A transposed (not C-contiguous) matrix or a mix of dtypes still gives the product."""
    rng = np.random.default_rng(3)
    matrix = rng.standard_normal((40, 30)).astype(np.float32).T  # 30 x 40, F-ordered
    q = rng.standard_normal((40, 3)).astype(np.float32)
    out = np.empty((30, 3), np.float32)
    lowrank.project(matrix, q, out)
    np.testing.assert_allclose(out, matrix.astype(np.float64) @ q, rtol=1e-4, atol=1e-4)
    q64 = q.astype(np.float64)
    out64 = np.empty((30, 3), np.float64)
    lowrank.project(matrix, q64, out64)  # float32 matrix, float64 factor
    np.testing.assert_allclose(out64, matrix.astype(np.float64) @ q64, rtol=1e-5, atol=1e-5)
