"""hororing.DistributedOptimizer over numpy parameters, against a locally computed step."""

import numpy as np
import pytest

import hororing as hvd
from reference import rank_input


def make_params():
    return {"w": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.ones(3)}


def rank_grads(rank, seed=0):
    return {"w": rank_input(rank, (2, 3), "float64", seed), "b": rank_input(rank, (3,), "float64", seed + 1)}


@pytest.mark.parametrize("compression", [None, "fp16", hvd.Compression.none, hvd.Compression.fp16])
def test_one_step_uses_the_average_gradient(compression):
    optimizer = hvd.DistributedOptimizer(hvd.SGD(make_params(), lr=0.5), compression=compression)
    for name, grad in rank_grads(hvd.rank()).items():
        optimizer.grads[name][...] = grad
    optimizer.grad_ready("b")
    assert optimizer.step()
    tolerance = 1e-12 if compression in (None, hvd.Compression.none) else 2e-2
    for name, start in make_params().items():
        mean = np.mean([rank_grads(rank)[name] for rank in range(hvd.size())], axis=0)
        np.testing.assert_allclose(optimizer.params[name], start - 0.5 * mean, atol=tolerance)


def test_bf16_compression_averages_within_a_few_bfloat16_units():
    """bfloat16 on the wire: each gradient rounded, divided, and every hop's float32 sum
    rounded to bfloat16 (8 significant bits) again."""
    optimizer = hvd.DistributedOptimizer(hvd.SGD(make_params(), lr=0.5),
                                         compression=hvd.Compression.bf16)
    for name, grad in rank_grads(hvd.rank()).items():
        optimizer.grads[name][...] = grad
    assert optimizer.step()
    size = hvd.size()
    for name, start in make_params().items():
        grads = [rank_grads(rank)[name].astype(np.float64) for rank in range(size)]
        mean = np.sum(grads, axis=0) / size
        if size == 1:  # nothing to exchange: the gradient is used as it is, unrounded
            np.testing.assert_allclose(optimizer.params[name], start - 0.5 * mean, rtol=1e-6)
            continue
        # a half unit of 2 ** -7 per rounding: the inputs, their division, every hop, the end
        roundings = 2 * size + 2
        bound = 0.5 * roundings * 0.5 * 2.0 ** -7 * np.sum(np.abs(grads), axis=0) / size
        error = np.abs(optimizer.params[name] - (start - 0.5 * mean))
        assert np.all(error <= bound + 1e-6), (error, bound)


def test_backward_passes_are_summed_locally_then_averaged():
    optimizer = hvd.DistributedOptimizer(hvd.SGD(make_params(), lr=1.0), backward_passes_per_step=2)
    for seed in (0, 10):
        for name, grad in rank_grads(hvd.rank(), seed).items():
            optimizer.grads[name][...] = grad
        if seed == 10:
            optimizer.grad_ready("w")
        stepped = optimizer.step()
        assert stepped == (seed == 10)
    for name, start in make_params().items():
        total = sum(rank_grads(rank, seed)[name] for rank in range(hvd.size()) for seed in (0, 10))
        np.testing.assert_allclose(optimizer.params[name], start - total / hvd.size(), atol=1e-12)


def test_momentum_and_bad_arguments():
    with pytest.raises(ValueError, match="lr must be > 0, got 0"):
        hvd.SGD(make_params(), lr=0)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\), got 1.5"):
        hvd.SGD(make_params(), lr=0.1, momentum=1.5)
    with pytest.raises(TypeError, match="optimizer must have .params, .grads and .step"):
        hvd.DistributedOptimizer(object())
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1, got 0"):
        hvd.DistributedOptimizer(hvd.SGD(make_params(), lr=0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match=r"compression must be hvd.Compression.none, .fp16 or "
                                         r".bf16 .*got 'int8'"):
        hvd.DistributedOptimizer(hvd.SGD(make_params(), lr=0.1), compression="int8")


def test_after_the_first_step_gradients_live_in_one_bucket_in_the_engines_order():
    from hororing.context import current
    params = {"w": np.zeros((40, 30)), "b": np.zeros(30), "v": np.zeros(7)}
    optimizer = hvd.DistributedOptimizer(hvd.SGD(params, lr=1.0))
    for step in range(4):
        grads = {name: rank_input(hvd.rank(), value.shape, "float64", seed=10 * step + index)
                 for index, (name, value) in enumerate(params.items())}
        for name, grad in grads.items():
            optimizer.grads[name][...] = grad
        optimizer.grad_ready("v")
        optimizer.grad_ready("b")
        before = {name: value.copy() for name, value in optimizer.params.items()}
        assert optimizer.step()
        for index, name in enumerate(params):
            mean = np.mean([rank_input(rank, params[name].shape, "float64",
                                       seed=10 * step + index)
                            for rank in range(hvd.size())], axis=0)
            np.testing.assert_allclose(before[name] - optimizer.params[name], mean,
                                       atol=1e-12)
    if hvd.size() == 1:
        return
    flat = optimizer.grads["v"].base
    assert flat is not None and all(grad.base is flat for grad in optimizer.grads.values())
    # laid out back to back in the order the executor lists a fused bucket's members, so a
    # fused bucket of them is a span of the flat array (which buffers fuse is up to the
    # timing: the span itself is tested in test_allreduce.py)
    order = current().engine.reduction_order([f"grad.{name}" for name in params])
    starts = [optimizer.grads[name[len("grad."):]].__array_interface__["data"][0]
              for name in order]
    sizes = [optimizer.grads[name[len("grad."):]].nbytes for name in order]
    assert starts == [starts[0] + sum(sizes[:index]) for index in range(len(order))]


# ---- sharded=True ---------------------------------------------------------------------------

def sharded_params():
    # sizes not divisible by most rank counts, two dtypes, one parameter smaller than the ranks
    return {"w": np.linspace(-1.0, 1.0, 15).reshape(5, 3), "b": np.arange(7, dtype=np.float32),
            "c": np.array([0.5])}


def sharded_grads(rank, step):
    return {name: rank_input(rank, value.shape, value.dtype.name, seed=10 * step + index)
            for index, (name, value) in enumerate(sharded_params().items())}


def reference_momentum_sgd(steps, lr, momentum, passes=1):
    """The unsharded step, computed here: every rank's gradients averaged, momentum SGD."""
    params = {name: value.astype(np.float64) for name, value in sharded_params().items()}
    velocity = {name: np.zeros_like(value) for name, value in params.items()}
    for step in range(steps):
        for name in params:
            grad = np.mean([sum(sharded_grads(rank, step * passes + p)[name].astype(np.float64)
                                for p in range(passes)) for rank in range(hvd.size())], axis=0)
            velocity[name] = momentum * velocity[name] + grad
            params[name] = params[name] - lr * velocity[name]
    return params


def assert_same_on_every_rank(params):
    for name, value in params.items():
        everyone = hvd.allgather(value.reshape(1, -1), name=f"check.{name}")
        for row in everyone:
            assert row.tobytes() == value.reshape(-1).tobytes(), name


@pytest.mark.parametrize("passes", [1, 2])
def test_sharded_momentum_sgd_steps_as_the_unsharded_average(passes):
    params = sharded_params()
    optimizer = hvd.DistributedOptimizer(hvd.SGD(params, lr=0.1, momentum=0.9), sharded=True,
                                         backward_passes_per_step=passes)
    assert isinstance(optimizer, hvd.optim.ShardedOptimizer)
    for step in range(3 * passes):
        for name, grad in sharded_grads(hvd.rank(), step).items():
            optimizer.grads[name][...] = grad
        optimizer.grad_ready("w")
        assert optimizer.step() == ((step + 1) % passes == 0)
    assert optimizer.params is params  # the caller's arrays, updated in place
    expected = reference_momentum_sgd(3, 0.1, 0.9, passes)
    for name, value in params.items():
        tolerance = 1e-5 if value.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(value, expected[name], rtol=tolerance, atol=tolerance)
    assert_same_on_every_rank(params)


def test_sharded_state_covers_this_ranks_slice_only():
    params = sharded_params()
    optimizer = hvd.DistributedOptimizer(hvd.SGD(params, lr=0.1, momentum=0.9), sharded=True)
    state = {name: velocity.size for name, velocity in optimizer.optimizer._velocity.items()}
    for dtype in ("float64", "float32"):
        total = sum(value.size for value in sharded_params().values() if value.dtype == dtype)
        sizes = hvd.allgather(np.array([state[f"shard.{dtype}"]]), name=f"state.{dtype}")
        assert sizes.sum() == total
        assert sizes.max() - sizes.min() <= 1  # split as reducescatter splits


def test_sharded_refuses_what_it_cannot_do():
    class NoDefaults:
        params, grads = {"w": np.zeros(3)}, {"w": np.zeros(3)}

        def step(self):
            pass
    with pytest.raises(TypeError, match="defaults"):
        hvd.DistributedOptimizer(NoDefaults(), sharded=True)
    with pytest.raises(ValueError, match="Average or Sum"):
        hvd.DistributedOptimizer(hvd.SGD(sharded_params(), lr=0.1), sharded=True, op=hvd.Adasum)
    with pytest.raises(ValueError, match="compress"):
        hvd.DistributedOptimizer(hvd.SGD(sharded_params(), lr=0.1), sharded=True,
                                 compression="fp16")
    with pytest.raises(ValueError, match="C-contiguous"):
        hvd.DistributedOptimizer(hvd.SGD({"w": np.zeros((3, 4)).T}, lr=0.1), sharded=True)


def test_sharded_parameters_that_differ_across_ranks_fail_on_every_rank():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    params = {"w": np.zeros(4 + (hvd.rank() == 1))}
    with pytest.raises(ValueError, match="every rank must wrap the same model"):
        hvd.DistributedOptimizer(hvd.SGD(params, lr=0.1), sharded=True)
