"""The sharded optimizer's buckets: reduce-scatters started during backward, stage 2's
gradient memory, clipping the sharded gradient, buckets smaller than the rank count, and
ranks that start different buckets. The model and the reference: sharded_reference.py.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402
from reference import assert_identical_on_every_rank  # noqa: E402
from sharded_reference import (assert_matches, groups_of, loss_of,  # noqa: E402,F401
                               make_parameters, reference_run, sharded_run, stage)


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
    vectors from bucket to bucket and keeps two per group vector between steps."""
    from hororing.torch import sharded
    monkeypatch.setattr(sharded, "_BUCKET_BYTES", 40)
    held = {}
    for stage in (1, 2):
        parameters = make_parameters()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(groups_of(parameters), lr=0.1),
                                             sharded=stage)
        group_vectors = [vector for vectors in optimizer._vectors for vector in vectors]
        trained_bytes = sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
        for step in range(2):
            optimizer.zero_grad()
            loss_of(parameters, hvd.rank(), step).backward()
            started = {bucket.parameters[0] is parameters[3]:
                       bucket.launched is not None or bucket.collected
                       for vector in group_vectors for bucket in vector.buckets}
            assert started == {False: True, True: False}  # only the unused one waits
            assert all(parameter.grad is None for parameter in parameters)
            with pytest.raises(RuntimeError, match="before optimizer.step"):
                optimizer.zero_grad()
            optimizer.step()
        held[stage] = optimizer.held_gradient_bytes()
        pooled = sum(vector.pool.held_bytes() for vector in group_vectors)
        if stage == 1:  # each bucket reduced in its own vector: this rank's chunk stays there
            assert held[stage] == pooled == trained_bytes
            assert sum(len(vector.pool.made) for vector in group_vectors) == 4  # one per parameter
        else:  # this rank's slice: 1/n of the trained bytes, one element more per bucket
            reduced = sum(vector.reduced.nbytes for vector in group_vectors)
            assert reduced <= trained_bytes / hvd.size() + 8 * 4
            assert held[stage] == reduced + pooled
            # each pooled vector as long as its group vector's largest bucket
            assert all(pooled.numel() == max(high - low for low, high in
                                             vector.buckets_layout.ranges)
                       and len(vector.pool.made) <= sharded._KEEP
                       for vector in group_vectors for pooled in vector.pool.made)
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
