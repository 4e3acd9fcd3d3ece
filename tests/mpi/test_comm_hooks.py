"""Gradient communication hooks: each built-in against an independent reference, their state
saved and restored, and the combinations that make no sense refused."""

import numpy as np
import pytest
import torch

import hororing as hnp
import hororing.torch as hvd
from hororing import comm_hooks
from hororing.optim import SGD, DistributedOptimizer

from reference import assert_identical_on_every_rank

SHAPES = {"w1": (24, 7), "b1": (7,), "w2": (7, 5), "w3": (5, 3, 2)}  # 7 and 5: no size divides


def needs_peers():
    """At one rank the optimizers reduce nothing: no hook is called."""
    if hnp.size() == 1:
        pytest.skip("one rank reduces nothing: the hook is not called")


def local_grads(rank, step=0, dtype=np.float64):
    rng = np.random.default_rng([rank, step])
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in SHAPES.items()}


def average(step=0, dtype=np.float64):
    grads = [local_grads(rank, step, dtype) for rank in range(hnp.size())]
    return {name: np.mean([np.asarray(g[name], np.float64) for g in grads], axis=0)
            for name in SHAPES}


def numpy_optimizer(hook, dtype=np.float64):
    params = {name: np.zeros(shape, dtype) for name, shape in SHAPES.items()}
    return DistributedOptimizer(SGD(params, lr=1.0), comm_hook=hook)


def numpy_step(optimizer, step, dtype=np.float64):
    """One step with this rank's gradients; returns what the step applied (-delta)."""
    before = {name: param.copy() for name, param in optimizer.params.items()}
    for name, grad in local_grads(hnp.rank(), step, dtype).items():
        optimizer.grads[name][...] = grad
    optimizer.step()
    return {name: before[name] - optimizer.params[name] for name in SHAPES}


@pytest.mark.parametrize("kind,tolerance", [("allreduce", 1e-6), ("fp16", 2e-3),
                                            ("bf16", 2e-2)])
def test_numpy_hooks_average_the_gradients(kind, tolerance, reduced_buffers):
    dtype = np.float32
    optimizer = numpy_optimizer(getattr(comm_hooks, kind), dtype)
    del reduced_buffers[:]
    applied = numpy_step(optimizer, 0, dtype)
    expected = average(0, dtype)
    for name in SHAPES:
        np.testing.assert_allclose(applied[name], expected[name], atol=tolerance,
                                   rtol=tolerance)
        assert_identical_on_every_rank(optimizer.params[name])
    wire = {"allreduce": "float32", "fp16": "float16", "bf16": "bfloat16"}[kind]
    if hnp.size() > 1:
        assert {dtype for _, dtype, _ in reduced_buffers} == {wire}


def test_powersgd_of_full_rank_is_the_average():
    """With as many columns as the smaller side, P Qᵀ spans every matrix: the average,
    exactly up to float64 rounding."""
    needs_peers()
    hook = comm_hooks.powersgd(rank=24, start_iter=0, min_compression_rate=0,
                               use_error_feedback=False)
    applied = numpy_step(numpy_optimizer(hook), 0)
    for name, expected in average(0).items():
        np.testing.assert_allclose(applied[name], expected, atol=1e-12, rtol=1e-10)
    assert hook.sent["p"] == 24 * 7 + 7 * 5 + 5 * 5  # rows x rank per matrix (rank capped)


def test_powersgd_sends_its_factors_and_keeps_what_it_left_out():
    """Rank 1 after 2 plain steps: the plain steps are the average; then only P and Q
    travel for the matrices ((n + m) x rank), and with error feedback the updates applied
    over the steps add up to the averages' sum less the ranks' mean remaining error."""
    needs_peers()
    hook = comm_hooks.powersgd(rank=1, start_iter=2)
    optimizer = numpy_optimizer(hook)
    steps = 6
    total_applied = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    total_average = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    for step in range(steps):
        applied = numpy_step(optimizer, step)
        expected = average(step)
        if step < 2:
            for name in SHAPES:
                np.testing.assert_allclose(applied[name], expected[name], atol=1e-12)
            assert hook.sent["plain"] > 0 and hook.sent["p"] == 0
        for name in SHAPES:
            total_applied[name] += applied[name]
            total_average[name] += expected[name]
    # w1 24x7, w2 7x5, w3 5x6 are compressed at rank 1 (n m > 2 (n + m)); b1 is not
    assert hook.sent == {"plain": 0, "p": 24 + 7 + 5, "q": 7 + 5 + 6, "uncompressed": 7}
    assert hook.iter == steps
    (bucket_error,) = optimizer.state_dict()["comm_hook"]["errors"].values()  # one bucket
    mean_error = hnp.allgather(bucket_error[None]).mean(axis=0)
    # the bucket holds the gradients back to back in the optimizer's order
    flat_applied = np.concatenate([total_applied[name].reshape(-1) for name in SHAPES])
    flat_average = np.concatenate([total_average[name].reshape(-1) for name in SHAPES])
    np.testing.assert_allclose(flat_applied, flat_average - mean_error, atol=1e-10)
    if hnp.size() > 1:
        assert np.abs(mean_error).max() > 1e-3  # rank 1 does leave something out
    for name in SHAPES:
        assert_identical_on_every_rank(optimizer.params[name])


def _powersgd_on(make, steps, hook=None, first=0):
    """``steps`` PowerSGD steps on one bucket of this rank's gradients held as ``make``
    (numpy, or torch tensors as CUDA gradients are); the reduced vectors on the host."""
    from hororing.comm_hooks import GradBucket, Reduction
    from hororing.powersgd.arrays import on_host
    hook = hook or comm_hooks.powersgd(rank=2, start_iter=1)
    reduced = []
    for step in range(first, first + steps):
        grads = local_grads(hnp.rank(), step)
        array = make(np.concatenate([grads[name].reshape(-1) for name in SHAPES]))
        bucket = GradBucket(0, "powersgd.kinds", array, array, list(SHAPES.values()),
                            list(SHAPES), Reduction(hnp.Average), None)
        reduced.append(np.array(on_host(hook(None, bucket).wait())))
    return hook, reduced


def test_powersgd_on_torch_tensors_reduces_as_on_numpy_arrays():
    """The one algorithm on torch tensors (how it takes CUDA gradients; CPU ones here):
    the same vectors as on numpy arrays, and state saved from one restores into the other."""
    on_numpy, expected = _powersgd_on(lambda flat: flat, 4)
    on_torch, reduced = _powersgd_on(torch.from_numpy, 4)
    for got, want in zip(reduced, expected):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    state = on_torch.state_dict()
    assert all(isinstance(error, torch.Tensor) for error in state["errors"].values())
    continued_hook = comm_hooks.powersgd(rank=2, start_iter=1)
    continued_hook.load_state_dict(state)  # torch tensors into a run on numpy arrays
    _, continued = _powersgd_on(lambda flat: flat, 1, continued_hook, first=4)
    _, reference = _powersgd_on(lambda flat: flat, 1, on_numpy, first=4)
    np.testing.assert_allclose(continued[0], reference[0], rtol=1e-9, atol=1e-12)
    assert_identical_on_every_rank(continued[0])


def test_powersgd_state_restores_to_the_same_next_step():
    needs_peers()
    hook = comm_hooks.powersgd(rank=2, start_iter=1)
    optimizer = numpy_optimizer(hook)
    for step in range(3):
        numpy_step(optimizer, step)
    saved = optimizer.state_dict()
    params = {name: param.copy() for name, param in optimizer.params.items()}
    continued = numpy_step(optimizer, 3)
    fresh_hook = comm_hooks.powersgd(rank=2, start_iter=1)
    fresh = DistributedOptimizer(SGD(params, lr=1.0), comm_hook=fresh_hook)
    fresh.load_state_dict(saved)
    assert fresh_hook.iter == 3
    restored = numpy_step(fresh, 3)
    for name in SHAPES:
        np.testing.assert_array_equal(restored[name], continued[name])


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 33), torch.nn.ReLU(),
                               torch.nn.Linear(33, 10)).double()


def torch_batch(rank):
    generator = torch.Generator().manual_seed(rank)
    return (torch.randn(16, 20, generator=generator, dtype=torch.float64),
            torch.randint(0, 10, (16,), generator=generator))


def torch_average_grads():
    """Every rank's gradients of the same model, averaged: the reference."""
    grads = []
    for rank in range(hvd.size()):
        model = make_model()
        inputs, labels = torch_batch(rank)
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        grads.append([parameter.grad for parameter in model.parameters()])
    return [sum(each) / hvd.size() for each in zip(*grads)]


def torch_reduced_grads(hook=None, **options):
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model.named_parameters(), comm_hook=hook, **options)
    inputs, labels = torch_batch(hvd.rank())
    torch.nn.functional.cross_entropy(model(inputs), labels).backward()
    optimizer.synchronize()
    return [parameter.grad.clone() for parameter in model.parameters()], optimizer


@pytest.mark.parametrize("name,hook,tolerance", [
    ("allreduce", hvd.comm_hooks.allreduce, 1e-12),
    ("fp16", hvd.comm_hooks.fp16, 2e-3),
    ("bf16", hvd.comm_hooks.bf16, 2e-2),
    # a classifier's last layer is rank-deficient (its rows sum to zero): QR keeps it exact
    ("powersgd full rank", hvd.comm_hooks.powersgd(rank=64, start_iter=0, min_compression_rate=0,
                                                   use_error_feedback=False), 1e-12),
])
def test_torch_hooks_average_the_gradients(name, hook, tolerance):
    got, _ = torch_reduced_grads(hook)
    for grad, expected in zip(got, torch_average_grads()):
        torch.testing.assert_close(grad, expected, atol=tolerance, rtol=tolerance)
        assert_identical_on_every_rank(grad.numpy())


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_16_bit_hooks_give_compressions_bits_casting_into_the_bucket_and_a_kept_payload(
        kind, monkeypatch):
    """The hooks cast each bucket into a 16-bit payload made once and kept from step to step,
    and cast the reduced payload back into the bucket itself: the same bits as Compression's
    casts of each gradient."""
    compression = getattr(hvd.Compression, kind)
    made = []
    payload_for = compression.payload_for

    def counted(tensor):
        made.append(tensor.numel())
        return payload_for(tensor)
    monkeypatch.setattr(compression, "payload_for", counted)
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         model.named_parameters(),
                                         comm_hook=hvd.comm_hooks.compressed(kind))
    inputs, labels = torch_batch(hvd.rank())
    for step in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.synchronize()
        got = [parameter.grad.clone() for parameter in model.parameters()]
        with optimizer.skip_synchronize():
            optimizer.step()
    plain = make_model()
    torch.nn.functional.cross_entropy(plain(inputs), labels).backward()
    alone = hvd.size() == 1  # one rank: the optimizer reduces nothing, as Horovod's
    for parameter, grad in zip(plain.parameters(), got):
        expected = parameter.grad if alone else hvd.allreduce(
            parameter.grad, compression=compression,
            name=f"hookbits.{kind}.{tuple(parameter.shape)}")
        assert torch.equal(grad, expected)
    # one payload per bucket, made at the first step only
    assert sum(made) == (0 if alone else sum(parameter.numel()
                                             for parameter in model.parameters()))


def test_a_hook_of_ones_own_returning_a_torch_future():
    seen = []

    def doubled_sum(state, bucket):
        seen.append((state, bucket.name, len(bucket.parameters())))
        flat = bucket.buffer()
        reduced = hvd.allreduce(flat, op=hvd.Sum, name=f"mine.{bucket.name}") * 2
        future = torch.futures.Future()
        future.set_result(reduced)
        return future

    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model.named_parameters())
    optimizer.register_comm_hook("my state", doubled_sum)
    inputs, labels = torch_batch(hvd.rank())
    torch.nn.functional.cross_entropy(model(inputs), labels).backward()
    optimizer.synchronize()
    if hvd.size() > 1:
        assert seen and all(state == "my state" and count == 4 for state, _, count in seen)
        for parameter, expected in zip(model.parameters(), torch_average_grads()):
            torch.testing.assert_close(parameter.grad, expected * 2 * hvd.size())


def test_hooked_buckets_hold_at_most_the_hook_bucket_size():
    """With a comm hook the optimizer's buckets hold at most Route.hook_bucket_bytes
    (HORORING_HOOK_BUCKET_BYTES): a parameter larger than that is a bucket of its own;
    the gradients are the average all the same."""
    from hororing.context import current

    pipeline = current().engine.allreduce
    before = pipeline.route
    seen = []

    def recording(state, bucket):
        seen.append([tuple(parameter.shape) for parameter in bucket.parameters()])
        return hvd.comm_hooks.allreduce(state, bucket)

    # float64 Linear(20, 33), Linear(33, 10): w1 5280 bytes, b1 264, w2 2640, b2 80
    pipeline.reroute(hook_bucket_bytes=3000)
    try:
        model = make_model()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             model.named_parameters(), comm_hook=recording)
        inputs, labels = torch_batch(hvd.rank())
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.synchronize()
    finally:
        pipeline.reroute(hook_bucket_bytes=before.hook_bucket_bytes)
    if hvd.size() == 1:
        return  # nothing is reduced at one rank
    assert sorted(seen) == sorted([[(10,), (10, 33), (33,)], [(33, 20)]])
    for parameter, expected in zip(model.parameters(), torch_average_grads()):
        torch.testing.assert_close(parameter.grad, expected)


def test_powersgd_state_travels_with_the_torch_optimizers_state_dict():
    hook = hvd.comm_hooks.powersgd(rank=1, start_iter=0)
    _, optimizer = torch_reduced_grads(hook)
    optimizer.step()
    state = optimizer.state_dict()
    if hvd.size() == 1:  # nothing is reduced at one rank: the hook never ran
        assert state["comm_hook"]["iter"] == 0
        return
    assert state["comm_hook"]["iter"] == 1 and state["comm_hook"]["errors"]
    other = hvd.comm_hooks.powersgd(rank=1, start_iter=0)
    model = make_model()
    fresh = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     model.named_parameters(), comm_hook=other)
    fresh.load_state_dict(state)
    assert other.iter == 1
    for name, error in state["comm_hook"]["errors"].items():
        np.testing.assert_array_equal(other.state_dict()["errors"][name], error)


def test_combinations_that_make_no_sense_are_refused():
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="PowerSGD's low-rank factors"):
        hvd.DistributedOptimizer(sgd, model.named_parameters(), sharded=True,
                                 comm_hook=hvd.comm_hooks.powersgd(rank=2))
    with pytest.raises(ValueError, match="either compression= or comm_hook="):
        hvd.DistributedOptimizer(sgd, model.named_parameters(),
                                 compression=hvd.Compression.fp16,
                                 comm_hook=hvd.comm_hooks.fp16)
    with pytest.raises(ValueError, match="Adasum combines each tensor on its own"):
        hvd.DistributedOptimizer(sgd, model.named_parameters(), op=hvd.Adasum,
                                 comm_hook=hvd.comm_hooks.allreduce)
    with pytest.raises(ValueError, match="powersgd rank must be an int >= 1"):
        hvd.comm_hooks.powersgd(rank=0)
    with pytest.raises(ValueError, match="sharded=True reduce-scatters its gradients"):
        DistributedOptimizer(SGD({"w": np.zeros(3)}, lr=0.1), sharded=True,
                             comm_hook=comm_hooks.allreduce)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    for ddp_hook in (default_hooks.fp16_compress_hook, powerSGD_hook.powerSGD_hook):
        with pytest.raises(TypeError, match=r"one of DDP's hooks.*init_process_group"):
            hvd.DistributedOptimizer(sgd, model.named_parameters(), comm_hook=ddp_hook)
        optimizer = hvd.DistributedOptimizer(sgd, model.named_parameters())
        with pytest.raises(TypeError, match="register_comm_hook\\(state, hook\\)"):
            optimizer.register_comm_hook(None, ddp_hook)


def test_sharded_takes_16_bit_hooks_as_its_compression():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model.named_parameters(), sharded=True,
                                         comm_hook=hvd.comm_hooks.bf16)
    assert optimizer._compression is hvd.Compression.bf16


def test_powersgd_refuses_16_bit_gradients_naming_the_alternative():
    if hvd.size() == 1:
        pytest.skip("at one rank no bucket is reduced")
    model = make_model().half()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model.named_parameters(),
                                         comm_hook=hvd.comm_hooks.powersgd(rank=1))
    inputs, labels = torch_batch(hvd.rank())
    with pytest.raises(TypeError, match="use comm_hooks.fp16 or .bf16 for 16-bit gradients"):
        torch.nn.functional.cross_entropy(model(inputs.half()).float(), labels).backward()
    del optimizer


def test_powersgd_keeps_state_only_for_the_buckets_in_use_after_a_new_layout():
    """The autotuner moves the fusion threshold: the optimizer lays its buckets out again
    under new names; PowerSGD's saved state then holds the new buckets only."""
    from hororing.context import current

    needs_peers()
    pipeline = current().engine.allreduce
    before = pipeline.route
    hook = hvd.comm_hooks.powersgd(rank=1, start_iter=0)
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         model.named_parameters(), comm_hook=hook)

    def step():
        optimizer.zero_grad()
        inputs, labels = torch_batch(hvd.rank())
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    try:
        step()
        first = set(hook.state_dict()["errors"])
        assert len(first) == 1  # 1033 float64 parameters: one bucket
        pipeline.reroute(fusion_threshold=3000)  # w1 alone, then [w2, b1, b2] or so
        step()  # reduced in the old bucket, then laid out again
        step()
        names = set(hook.state_dict()["errors"])
        assert len(names) > 1 and not names & first, names
        assert set(hook.state_dict()["qs"]) <= names
    finally:
        pipeline.reroute(fusion_threshold=before.fusion_threshold)
