"""Sharded optimizer state (DistributedOptimizer(sharded=True), ZeroRedundancyOptimizer).

Each rank trains on its own data. The reference is computed on every rank alone: a plain
torch optimizer stepped with the mean of every rank's gradient (each rank can compute them
all, since the data are seeded by rank). The sharded optimizer must match it, leave the
parameters bitwise identical on every rank, and hold optimizer state for its slice only.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402
from reference import assert_identical_on_every_rank  # noqa: E402

STEPS = 4
CONFIGS = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    (torch.optim.Adagrad, {"lr": 0.1}),
]


def make_parameters():
    """The same on every rank: 35 + 5 float64 and 15 + 13 float32 elements (none divisible
    by 2, 3 or 4 ranks overall), a parameter that never gets a gradient, a frozen one."""
    generator = torch.Generator().manual_seed(7)

    def parameter(*shape, dtype=torch.float64, requires_grad=True):
        return torch.nn.Parameter(torch.randn(*shape, generator=generator, dtype=dtype),
                                  requires_grad=requires_grad)
    return [parameter(7, 5), parameter(5), parameter(5, 3, dtype=torch.float32),
            parameter(13, dtype=torch.float32), parameter(4, requires_grad=False)]


def groups_of(parameters):
    first, bias, second, unused, frozen = parameters
    return [{"params": [first, bias]}, {"params": [second, unused, frozen], "lr": 0.05}]


def loss_of(parameters, rank, step):
    first, bias, second, _, frozen = parameters
    data = torch.randn(6, 7, generator=torch.Generator().manual_seed(100 * step + rank),
                       dtype=torch.float64)
    hidden = torch.tanh(data @ first + bias + frozen.sum())
    return (hidden @ second.double()).pow(2).mean()  # float64 gradients stay float64


def reference_run(optimizer_class, options, steps=STEPS, passes=1, clip=None):
    """Every rank's gradient, averaged, into a plain optimizer: what large-batch training
    on one process does. ``passes``: backward passes accumulated per step; ``clip``:
    (max_norm, norm_type) for torch's clip_grad_norm_ on the averaged gradient (the norms it
    returned are kept in ``optimizer.norms``)."""
    norms = []
    parameters = make_parameters()
    optimizer = optimizer_class(groups_of(parameters), **options)
    for step in range(steps):
        grads = [torch.zeros_like(parameter) for parameter in parameters]
        for rank in range(hvd.size()):
            for parameter in parameters:
                parameter.grad = None
            for index in range(passes):
                (loss_of(parameters, rank, passes * step + index) / passes).backward()
            for total, parameter in zip(grads, parameters):
                if parameter.grad is not None:
                    total += parameter.grad
        for total, parameter in zip(grads, parameters):
            if parameter.requires_grad:
                parameter.grad = total / hvd.size()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(
                [parameter for parameter in parameters if parameter.requires_grad], *clip)))
        optimizer.step()
    optimizer.norms = norms
    return parameters, optimizer


def sharded_run(optimizer_class, options, steps=STEPS, make=None, passes=1, set_to_none=True,
                stage=True, clip=None):
    parameters = make_parameters()
    optimizer = make(parameters) if make else hvd.DistributedOptimizer(
        optimizer_class(groups_of(parameters), **options), sharded=stage,
        backward_passes_per_step=passes)
    norms = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=set_to_none)
        for index in range(passes):
            (loss_of(parameters, hvd.rank(), passes * step + index) / passes).backward()
        if clip is not None:
            norms.append(float(optimizer.clip_grad_norm_(*clip)))
        optimizer.step()
    optimizer.norms = norms
    return parameters, optimizer


# how each slice's gradients are cut into buckets, each reduce-scattered on its own as soon
# as its parameters' gradients are ready: one bucket per slice (the default's, for these
# sizes), or one per parameter (40 bytes: five float64 or ten float32 elements at most)
LAYOUTS = [("one_bucket", True, None), ("bucket_per_parameter", True, 40),
           ("stage_2", 2, 40)]


@pytest.fixture(params=LAYOUTS, ids=[name for name, _, _ in LAYOUTS])
def stage(request, monkeypatch):
    """The ``sharded=`` value of a layout, with the bucket size it sets."""
    _, stage, bucket_bytes = request.param
    if bucket_bytes is not None:
        from hororing.torch import sharded
        monkeypatch.setattr(sharded, "_BUCKET_BYTES", bucket_bytes)
    return stage


def assert_matches(parameters, expected):
    for parameter, reference in zip(parameters, expected):
        assert_identical_on_every_rank(parameter.detach().numpy())
        # the sums run in another order than the reference's; the float64 parameters see the
        # float32 one's rounding through the loss, hence 1e-7 and not float64's own precision
        tolerance = 1e-7 if parameter.dtype == torch.float64 else 1e-5
        np.testing.assert_allclose(parameter.detach().numpy(), reference.detach().numpy(),
                                   rtol=tolerance, atol=tolerance)  # parameters are O(1)


@pytest.mark.parametrize("optimizer_class,options", CONFIGS,
                         ids=[cls.__name__ for cls, _ in CONFIGS])
def test_sharded_steps_equal_large_batch_training_and_hold_a_slice_of_the_state(
        optimizer_class, options, stage):
    parameters, optimizer = sharded_run(optimizer_class, options, stage=stage)
    expected, reference = reference_run(optimizer_class, options)
    assert_matches(parameters, expected)
    assert not parameters[4].grad and torch.equal(parameters[4], expected[4])  # frozen
    # the state exists for this rank's slice only: over the ranks, once per element
    trained = sum(parameter.numel() for parameter in parameters if parameter.requires_grad)
    sliced = [value for state in optimizer.state.values() for key, value in state.items()
              if torch.is_tensor(value) and key != "step"]
    held = sum(value.numel() for value in sliced)
    kinds = len({key for state in reference.state.values() for key, value in state.items()
                 if torch.is_tensor(value) and key != "step"})
    from mpi4py import MPI
    assert MPI.COMM_WORLD.allreduce(held) == kinds * trained
    buckets = sum(len(piece.buckets) for slices in optimizer._slices for piece in slices)
    assert held <= kinds * (trained // hvd.size() + buckets)  # one more per bucket at most


@pytest.mark.parametrize("part", [None, 5], ids=["one_part", "parts_of_5"])
@pytest.mark.parametrize("optimizer_class,options", CONFIGS[:2],
                         ids=[cls.__name__ for cls, _ in CONFIGS[:2]])
def test_state_dict_is_the_full_state_and_loads_into_a_fresh_sharded_optimizer(
        optimizer_class, options, part, monkeypatch):
    if part is not None:  # a rank's slice stepped as several leaves, as a large model's is
        from hororing.torch import sharded
        monkeypatch.setattr(sharded, "_PART", part)
    parameters, optimizer = sharded_run(optimizer_class, options, steps=2)
    _, reference = reference_run(optimizer_class, options, steps=2)
    full, expected = optimizer.state_dict(), reference.state_dict()
    assert sorted(full["state"]) == sorted(expected["state"])
    for index, state in expected["state"].items():
        for key, value in state.items():
            np.testing.assert_allclose(np.asarray(full["state"][index][key]), np.asarray(value),
                                       rtol=1e-5, atol=1e-8)
    assert [group["params"] for group in full["param_groups"]] == \
        [group["params"] for group in expected["param_groups"]]
    # a fresh model and sharded optimizer, from the reference's (unsharded) state: the next
    # steps continue exactly as the reference does
    resumed = make_parameters()
    with torch.no_grad():
        for parameter, value in zip(resumed, reference.param_groups[0]["params"] +
                                    reference.param_groups[1]["params"]):
            parameter.copy_(value)
    again = hvd.DistributedOptimizer(optimizer_class(groups_of(resumed), **options), sharded=True)
    again.load_state_dict(expected)
    for step in (2, 3):
        again.zero_grad()
        loss_of(resumed, hvd.rank(), step).backward()
        again.step()
    final, _ = reference_run(optimizer_class, options, steps=4)
    assert_matches(resumed, final)


def test_zero_redundancy_optimizer_trains_and_consolidates_on_one_rank():
    options = {"lr": 0.01}

    def make(parameters):
        return hvd.ZeroRedundancyOptimizer(groups_of(parameters), torch.optim.Adam, **options)
    parameters, optimizer = sharded_run(torch.optim.Adam, options, make=make)
    expected, reference = reference_run(torch.optim.Adam, options)
    assert_matches(parameters, expected)
    optimizer.consolidate_state_dict(to=0)
    if hvd.rank() == 0:
        assert sorted(optimizer.state_dict()["state"]) == sorted(reference.state_dict()["state"])
    else:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            optimizer.state_dict()


def test_optimizers_that_need_whole_tensors_and_other_compressors_are_refused():
    parameters = make_parameters()
    with pytest.raises(ValueError, match="LBFGS is not one of them"):
        hvd.DistributedOptimizer(torch.optim.LBFGS(parameters[:2]), sharded=True)
    class TopK(hvd.Compression.none):  # a compressor of the user's own: not elementwise
        pass
    with pytest.raises(ValueError, match="compresses gradients with"):
        hvd.DistributedOptimizer(torch.optim.SGD(parameters[:2], lr=0.1), sharded=True,
                                 compression=TopK)
    with pytest.raises(ValueError, match="Average or Sum"):
        hvd.DistributedOptimizer(torch.optim.SGD(parameters[:2], lr=0.1), sharded=True,
                                 op=hvd.Adasum)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_gradients_step_as_the_unsharded_optimizer_compresses_them(compression):
    """The payload of each flat gradient vector travels as the unsharded optimizer sends it
    (float16: divided by the ranks, then summed in float16; bfloat16: rounded, summed in
    float32, rounded again); each rank decompresses its slice."""
    compressor = getattr(hvd.Compression, compression)
    options = {"lr": 0.1, "momentum": 0.9}

    def make(parameters):
        return hvd.DistributedOptimizer(torch.optim.SGD(groups_of(parameters), **options),
                                        sharded=True, compression=compressor)
    parameters, _ = sharded_run(None, None, make=make)
    expected = make_parameters()
    unsharded = hvd.DistributedOptimizer(
        torch.optim.SGD(groups_of(expected), **options), compression=compressor,
        named_parameters=[(f"unsharded.{compression}.{index}", parameter)
                          for index, parameter in enumerate(expected)])
    for step in range(STEPS):
        unsharded.zero_grad()
        loss_of(expected, hvd.rank(), step).backward()
        unsharded.step()
    uncompressed, _ = reference_run(torch.optim.SGD, options)
    for parameter, reference, plain in zip(parameters, expected, uncompressed):
        mine, theirs = parameter.detach().numpy(), reference.detach().numpy()
        assert_identical_on_every_rank(mine)
        if hvd.size() <= 2 or compression == "bf16":
            # one addition per element, or float32 sums that differ in their last bits only
            # (bfloat16 then rounds them alike): the unsharded optimizer's result
            np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)
        else:  # float16 sums in another order: an ulp of float16 per step at most
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-3)
    # the gradients were rounded: bfloat16's rounding shows against the uncompressed run
    if compression == "bf16" and hvd.size() > 1:
        assert max(float((p - q).detach().abs().max())
                   for p, q in zip(parameters, uncompressed)) > 1e-5


SIXTEEN_BIT_CONFIGS = [  # Adam's default eps (1e-8) is 0 in float16
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.01, "eps": 1e-4}),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("optimizer_class,options", SIXTEEN_BIT_CONFIGS,
                         ids=[cls.__name__ for cls, _ in SIXTEEN_BIT_CONFIGS])
def test_16_bit_parameters_step_as_the_unsharded_optimizer_steps_them(dtype, optimizer_class,
                                                                      options):
    """float16 and bfloat16 parameters (35 + 5 + 15 elements): gradients summed in float32
    and rounded back, as the engine reduces them for the unsharded optimizer."""
    def make():
        generator = torch.Generator().manual_seed(3)
        return [torch.nn.Parameter(torch.randn(*shape, generator=generator).to(dtype))
                for shape in ((7, 5), (5,), (5, 3))]

    def train(parameters, optimizer):
        for step in range(STEPS):
            optimizer.zero_grad()
            first, bias, second = (parameter.float() for parameter in parameters)
            data = torch.randn(6, 7, generator=torch.Generator().manual_seed(10 * step +
                                                                              hvd.rank()))
            (torch.tanh(data @ first + bias) @ second).pow(2).mean().backward()
            optimizer.step()

    parameters, expected = make(), make()
    train(parameters, hvd.DistributedOptimizer(optimizer_class(parameters, **options),
                                               sharded=True))
    name = f"sixteen.{dtype}.{optimizer_class.__name__}"
    train(expected, hvd.DistributedOptimizer(
        optimizer_class(expected, **options),
        named_parameters=[(f"{name}.{index}", p) for index, p in enumerate(expected)]))
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10  # at 1.0
    for parameter, reference in zip(parameters, expected):
        assert parameter.dtype == dtype
        mine, theirs = parameter.detach().float().numpy(), reference.detach().float().numpy()
        assert_identical_on_every_rank(mine)
        # torch's own 16-bit arithmetic on the CPU rounds an element differently by its place
        # in the tensor (vectorized body or scalar tail: measured, add_(alpha=) on 55 float16
        # elements whole and as two slices differs by an ulp in 3 places), and a slice puts
        # elements elsewhere; so does a float32 sum in another order at 3-4 ranks
        assert np.isfinite(mine).all()
        np.testing.assert_allclose(mine, theirs, rtol=2 * ulp, atol=2 * ulp)


def test_float16_payloads_are_averaged_before_they_are_summed():
    """Gradients of 40000 on every rank: their float16 sum overflows (float16 ends at 65504),
    their average does not; the unsharded optimizer divides first too."""
    parameter = torch.nn.Parameter(torch.zeros(7))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([parameter], lr=1e-5), sharded=True,
                                         compression=hvd.Compression.fp16)
    (40000.0 * parameter.sum()).backward()
    optimizer.step()
    np.testing.assert_allclose(parameter.detach().numpy(), np.full(7, -0.4), rtol=1e-3)


def test_ranks_that_wrap_different_parameters_are_refused_on_every_rank():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    parameters = [torch.nn.Parameter(torch.zeros(5 + (hvd.rank() == 0)))]
    with pytest.raises(ValueError, match="every rank must wrap the same model"):
        hvd.DistributedOptimizer(torch.optim.SGD(parameters, lr=0.1), sharded=True)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_accumulated_over_backward_passes(set_to_none, stage):
    """Two backward passes per step, the gradients kept as zeroed views or set to None
    between steps: the same as large-batch training on both batches."""
    options = {"lr": 0.1, "momentum": 0.9}
    parameters, _ = sharded_run(torch.optim.SGD, options, steps=3, passes=2,
                                set_to_none=set_to_none, stage=stage)
    expected, _ = reference_run(torch.optim.SGD, options, steps=3, passes=2)
    assert_matches(parameters, expected)


@pytest.mark.parametrize("zero", [False, True], ids=["sharded", "ZeroRedundancyOptimizer"])
def test_broadcast_optimizer_state_keeps_a_sharded_state_and_training_continues(zero):
    make = None
    if zero:
        def make(parameters):
            return hvd.ZeroRedundancyOptimizer(groups_of(parameters), torch.optim.Adam, lr=0.01)
    parameters, optimizer = sharded_run(torch.optim.Adam, {"lr": 0.01}, steps=2, make=make)
    before = optimizer.gather_state_dict()
    hvd.broadcast_optimizer_state(optimizer, root_rank=hvd.size() - 1)
    after = optimizer.gather_state_dict()
    for index, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(after["state"][index][key]),
                               torch.as_tensor(value)), (index, key)
    for step in (2, 3):
        optimizer.zero_grad()
        loss_of(parameters, hvd.rank(), step).backward()
        optimizer.step()
    _, reference = reference_run(torch.optim.Adam, {"lr": 0.01}, steps=4)
    assert_matches(parameters, reference.param_groups[0]["params"] +
                   reference.param_groups[1]["params"])


@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "max"])
def test_clip_grad_norm_clips_the_averaged_gradient_over_every_rank(stage, norm_type):
    """``optimizer.clip_grad_norm_`` after backward: torch's clip_grad_norm_ applied to the
    averaged gradient of the whole model, from each rank's slice of it."""
    options = {"lr": 0.1, "momentum": 0.9}
    clip = (0.05, norm_type)  # below the gradients' norms: every step clips
    parameters, optimizer = sharded_run(torch.optim.SGD, options, stage=stage, clip=clip)
    expected, reference = reference_run(torch.optim.SGD, options, clip=clip)
    assert min(reference.norms) > clip[0]
    np.testing.assert_allclose(optimizer.norms, reference.norms, rtol=1e-6)
    assert_identical_on_every_rank(np.array(optimizer.norms))
    assert_matches(parameters, expected)


def test_reduce_scatters_start_during_backward_and_stage_2_lets_the_gradients_go(monkeypatch):
    """One bucket per parameter: after backward, every bucket whose parameters all have
    their gradient is being reduced or done (the unused parameter's waits for step()), and
    the model's .grad are let go. Stage 1 keeps a gradient vector per bucket; stage 2 reuses
    vectors from bucket to bucket and keeps two per slice between steps."""
    from hororing.torch import sharded
    monkeypatch.setattr(sharded, "_BUCKET_BYTES", 40)
    held = {}
    for stage in (1, 2):
        parameters = make_parameters()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(groups_of(parameters), lr=0.1),
                                             sharded=stage)
        pieces = [piece for slices in optimizer._slices for piece in slices]
        trained_bytes = sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
        for step in range(2):
            optimizer.zero_grad()
            loss_of(parameters, hvd.rank(), step).backward()
            started = {bucket.parameters[0] is parameters[3]:
                       bucket.launched is not None or bucket.collected
                       for piece in pieces for bucket in piece.buckets}
            assert started == {False: True, True: False}  # only the unused one waits
            assert all(parameter.grad is None for parameter in parameters)
            with pytest.raises(RuntimeError, match="before optimizer.step"):
                optimizer.zero_grad()
            optimizer.step()
        held[stage] = optimizer.held_gradient_bytes()
        pooled = sum(piece.pool.held_bytes() for piece in pieces)
        if stage == 1:  # each bucket reduced in its own vector: this rank's chunk stays there
            assert held[stage] == pooled == trained_bytes
            assert sum(len(piece.pool.made) for piece in pieces) == 4  # one per parameter
        else:  # this rank's slice: 1/n of the trained bytes, one element more per bucket
            reduced = sum(piece.reduced.nbytes for piece in pieces)
            assert reduced <= trained_bytes / hvd.size() + 8 * 4
            assert held[stage] == reduced + pooled
            # each vector as long as its slice's largest bucket
            assert all(vector.numel() == max(high - low for low, high in
                                             piece.buckets_layout.ranges)
                       and len(piece.pool.made) <= sharded._KEEP
                       for piece in pieces for vector in piece.pool.made)
        expected, _ = reference_run(torch.optim.SGD, {"lr": 0.1}, steps=2)
        assert_matches(parameters, expected)


def test_more_backward_passes_than_declared_are_refused(monkeypatch):
    from hororing.torch import sharded
    monkeypatch.setattr(sharded, "_BUCKET_BYTES", 40)
    parameters = make_parameters()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(groups_of(parameters), lr=0.1),
                                         sharded=True)
    loss_of(parameters, hvd.rank(), 0).backward()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=1 times"):
        loss_of(parameters, hvd.rank(), 1).backward()
    optimizer.step()  # the first pass's reductions complete: it steps with them
    expected, _ = reference_run(torch.optim.SGD, {"lr": 0.1}, steps=1)
    assert_matches(parameters, expected)


def test_buckets_smaller_than_the_rank_count_leave_some_ranks_nothing_to_step(monkeypatch):
    """A parameter of 1 and one of 2 elements, each its own bucket: at 3 and 4 ranks some
    ranks own no element of a bucket (or of any), and the step is still exact."""
    from hororing.torch import sharded
    monkeypatch.setattr(sharded, "_BUCKET_BYTES", 8)

    def make():
        return [torch.nn.Parameter(torch.tensor([0.5, -1.0], dtype=torch.float64)),
                torch.nn.Parameter(torch.tensor([2.0], dtype=torch.float64))]

    def gradient(rank, step):
        return [torch.tensor([rank + step + 1.0, 2.0 * rank]), torch.tensor([3.0 - rank])]

    parameters = make()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(parameters, lr=0.1), sharded=2)
    expected = make()
    reference = torch.optim.Adam(expected, lr=0.1)
    for step in range(3):
        optimizer.zero_grad()
        (sum((parameter * grad).sum() for parameter, grad in
             zip(parameters, gradient(hvd.rank(), step)))).backward()
        optimizer.step()
        for index, parameter in enumerate(expected):
            parameter.grad = sum(gradient(rank, step)[index].double()
                                 for rank in range(hvd.size())) / hvd.size()
        reference.step()
    for parameter, want in zip(parameters, expected):
        assert_identical_on_every_rank(parameter.detach().numpy())
        np.testing.assert_allclose(parameter.detach().numpy(), want.detach().numpy(),
                                   rtol=1e-12)
    assert optimizer.state_dict()["state"][0]["exp_avg"].shape == (2,)


def test_parameters_used_by_some_ranks_only_are_reduced_in_any_order(monkeypatch):
    """Rank r's loss uses the first r + 1 of four parameters (one bucket each), so each rank
    starts a different set of reduce-scatters during backward, and the rest at step(): the
    engine matches them by name, and the missing gradients count as zeros."""
    from hororing.torch import sharded
    monkeypatch.setattr(sharded, "_BUCKET_BYTES", 8)

    def make():
        return [torch.nn.Parameter(torch.full((3,), float(index + 1), dtype=torch.float64))
                for index in range(4)]

    def loss(parameters, rank):
        return sum((parameter * (rank + 1)).pow(2).sum() for parameter in parameters[:rank + 1])

    parameters, expected = make(), make()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(parameters, lr=0.1), sharded=2)
    for _ in range(2):
        optimizer.zero_grad()
        loss(parameters, hvd.rank() % 4).backward()
        optimizer.step()
        gradients = [torch.zeros(3, dtype=torch.float64) for _ in expected]
        for rank in range(hvd.size()):
            copies = [parameter.detach().clone().requires_grad_() for parameter in expected]
            loss(copies, rank % 4).backward()
            for total, copy in zip(gradients, copies):
                if copy.grad is not None:
                    total += copy.grad
        with torch.no_grad():
            for parameter, total in zip(expected, gradients):
                parameter -= 0.1 * total / hvd.size()
    for parameter, want in zip(parameters, expected):
        assert_identical_on_every_rank(parameter.detach().numpy())
        np.testing.assert_allclose(parameter.detach().numpy(), want.detach().numpy(),
                                   rtol=1e-12)
