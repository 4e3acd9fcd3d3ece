"""op=hvd.Adasum against an independent reference of the pairwise tree, at any job size."""

import numpy as np
import pytest

import hororing as hvd
from reference import adasum_tree, assert_identical_on_every_rank, rank_input


def inputs(count, dtype, seed):
    return [rank_input(rank, (count,), dtype, seed) for rank in range(hvd.size())]


@pytest.mark.parametrize("count", [1, 2, 7, 1001, 150_001])
@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-12), ("float32", 1e-6),
                                              ("float16", 2e-3)])
def test_adasum_matches_the_pairwise_tree(count, dtype, tolerance):
    mine = inputs(count, dtype, seed=count)
    result = hvd.allreduce(mine[hvd.rank()], op=hvd.Adasum, name=f"adasum.{dtype}.{count}")
    expected = adasum_tree(mine)
    assert result.dtype == np.dtype(dtype) and result.shape == (count,)
    np.testing.assert_allclose(result.astype(np.float64), expected,
                               rtol=tolerance, atol=tolerance * np.abs(expected).max())
    assert_identical_on_every_rank(result)


def test_a_fused_bucket_keeps_each_tensors_own_dot_products():
    shapes = [(3, 5), (1,), (40, 7), (1000,)]
    per_tensor = [[rank_input(rank, shape, "float64", seed=index) for rank in range(hvd.size())]
                  for index, shape in enumerate(shapes)]
    handles = [hvd.allreduce_async(values[hvd.rank()], op=hvd.Adasum, name=f"adasum.fused.{i}")
               for i, values in enumerate(per_tensor)]
    for handle, values, shape in zip(handles, per_tensor, shapes):
        result = hvd.synchronize(handle)
        assert result.shape == shape
        np.testing.assert_allclose(result.ravel(), adasum_tree(values), rtol=1e-12, atol=1e-12)


def test_parallel_gradients_average_and_orthogonal_ones_add():
    size, rank = hvd.size(), hvd.rank()
    direction = np.linspace(-1.0, 1.0, 33)
    parallel = hvd.allreduce(direction * (rank + 1), op=hvd.Adasum, name="adasum.parallel")
    np.testing.assert_allclose(parallel, direction * (size + 1) / 2, rtol=1e-12)
    orthogonal = hvd.allreduce(np.eye(size)[rank] * (rank + 2), op=hvd.Adasum,
                               name="adasum.orthogonal")
    np.testing.assert_allclose(orthogonal, np.arange(2, size + 2, dtype=float), rtol=1e-12)


def test_grouped_and_scaled_adasum_and_zero_vectors():
    first = rank_input(hvd.rank(), (9,), "float32", seed=3)
    zeros = np.zeros(4)
    a, b = hvd.grouped_allreduce([first, zeros], op=hvd.Adasum, prescale_factor=2.0,
                                 postscale_factor=0.5, name="adasum.grouped")
    expected = adasum_tree([rank_input(rank, (9,), "float32", seed=3) * 2.0
                            for rank in range(hvd.size())]) * 0.5
    np.testing.assert_allclose(a, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(b, zeros)


def test_adasum_refuses_integers_and_reducescatter_on_every_rank():
    with pytest.raises(TypeError, match="op=Adasum reduces floating-point tensors.*int32"):
        hvd.allreduce(np.ones(3, dtype=np.int32), op=hvd.Adasum)
    with pytest.raises(ValueError, match="op=Adasum is supported by allreduce"):
        hvd.reducescatter(np.ones(hvd.size()), op=hvd.Adasum)


def test_the_numpy_optimizer_steps_with_the_adasum_of_the_gradients():
    params = {"w": np.zeros(6)}
    optimizer = hvd.DistributedOptimizer(hvd.SGD(params, lr=1.0), op=hvd.Adasum)
    grads = [rank_input(rank, (6,), "float64", seed=8) for rank in range(hvd.size())]
    optimizer.grads["w"][...] = grads[hvd.rank()]
    optimizer.step()
    np.testing.assert_allclose(params["w"], -adasum_tree(grads), rtol=1e-12, atol=1e-12)
