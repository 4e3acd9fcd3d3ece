"""hororing.torch's DistributedOptimizer and its gradient buckets: gradients as views into
flat buckets, started whole (one allreduce of each flat bucket, as DDP's), or one gradient
at a time and laid out again in the engine's order (where each is reduced apart)."""

import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402
from torch_reference import (expected_average_gradients, expected_step, local_loss,  # noqa: E402
                             make_model)


@pytest.fixture
def per_tensor(monkeypatch):
    """Buckets do not start whole: each gradient is started as it comes (the path of a
    compressor's or Adasum's gradients), and the buckets are laid out again after the first
    step in the order the engine reduces them."""
    from hororing.torch import optimizer as optimizer_module
    monkeypatch.setattr(optimizer_module._DistributedOptimizer, "_starts_whole",
                        lambda self, bucket: False)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_by_default_a_bucket_is_one_allreduce_of_its_flat_tensor(set_to_none, reduced_buffers):
    """Each gradient is a view into its bucket's flat tensor, in reverse parameter order (as
    backward computes them), the same every step; the bucket travels as one allreduce."""
    model = make_model()
    optimizer = hvd.DistributedOptimizer(  # names of its own: nothing cached for them yet
        torch.optim.SGD(model.parameters(), lr=0.0),
        named_parameters=[(f"default.{set_to_none}.{name}", parameter)
                          for name, parameter in model.named_parameters()])
    parameters = list(model.parameters())
    storages = set()
    for step in range(3):
        optimizer.zero_grad(set_to_none=set_to_none)
        reduced_buffers.clear()  # the bucket starts in backward, once its gradients are in
        local_loss(model, hvd.rank()).backward()
        optimizer.step()
        storages.add(tuple(p.grad.data_ptr() for p in parameters))
        for got, want in zip([p.grad for p in parameters], expected_average_gradients()):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        if hvd.size() > 1 and step == 0:  # later, the engine may fold a small cached bucket
            # into its negotiation (engine/fold.py), which the watch does not see
            total = sum(p.numel() for p in parameters)
            assert reduced_buffers == [(reduced_buffers[0][0], "float32", total)]
    if hvd.size() == 1:
        return  # nothing is reduced: no buckets
    assert len(storages) == 1, "the gradients moved between steps"
    backward = parameters[::-1]
    starts = [parameter.grad.data_ptr() for parameter in backward]
    sizes = [parameter.grad.nbytes for parameter in backward]
    assert starts == [starts[0] + sum(sizes[:index]) for index in range(len(backward))]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_live_in_their_bucket_in_the_engines_order(per_tensor, set_to_none):
    """Each gradient is a view into one flat bucket, stays one across steps and zero_grad,
    holds the average, and lies where the executor lists it in a fused bucket."""
    from hororing.context import current
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         named_parameters=model.named_parameters())
    parameters = list(model.parameters())
    storages = set()
    for step in range(4):
        if step == 1:
            storages.clear()  # the buckets are laid out again after the first step
        optimizer.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            assert all(p.grad is None for p in parameters)
        local_loss(model, hvd.rank()).backward()
        optimizer.step()
        storages.add(tuple(p.grad.untyped_storage().data_ptr() for p in parameters))
        for got, want in zip([p.grad for p in parameters], expected_average_gradients()):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    if hvd.size() == 1:
        return  # nothing is reduced: no buckets
    assert len(storages) == 1 and len(set(next(iter(storages)))) == 1, \
        "the gradients are not views of one bucket, the same every step"
    # back to back in that order, so a fused bucket of them is a span of the flat tensor
    # (which gradients fuse is up to the timing: the span itself is tested in
    # test_allreduce.py)
    names = dict(model.named_parameters())
    order = [names[name] for name in current().engine.reduction_order(list(names))]
    starts = [parameter.grad.data_ptr() for parameter in order]
    sizes = [parameter.grad.nbytes for parameter in order]
    assert starts == [starts[0] + sum(sizes[:index]) for index in range(len(order))]


def test_bucket_views_keep_backward_passes_clipping_and_synchronize():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2)
    optimizer.zero_grad()
    for _ in range(2):
        local_loss(model, hvd.rank()).backward()
    optimizer.synchronize()
    expected = expected_average_gradients(passes=2)
    for got, want in zip([p.grad for p in model.parameters()], expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(
        torch.cat([g.reshape(-1) for g in expected])), atol=1e-6, rtol=1e-5)
    with optimizer.skip_synchronize():
        optimizer.step()
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1)
                                                  for p in model.parameters()]))
    assert float(clipped) <= 1e-3 * (1 + 1e-4)


@pytest.fixture
def whole_buckets(monkeypatch):
    """Every gradient bucket starts whole, a compressor's too, as CUDA buckets do (one
    allreduce of the flat bucket once every gradient of it is in, or its members announced
    together): the same code a GPU runs, on tensors CI has."""
    from hororing.torch import optimizer as optimizer_module
    monkeypatch.setattr(optimizer_module._DistributedOptimizer, "_starts_whole",
                        lambda self, bucket: True)


@pytest.mark.parametrize("passes,op", [(1, "Average"), (2, "Average"), (1, "Sum")])
def test_a_whole_bucket_is_one_allreduce_of_its_flat_tensor(whole_buckets, reduced_buffers,
                                                            passes, op):
    model = make_model()
    # names of this case alone: a bucket cached from another case could be folded at once
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         named_parameters=[(f"whole.{passes}.{op}.{name}", p)
                                                           for name, p in model.named_parameters()],
                                         backward_passes_per_step=passes, op=getattr(hvd, op))
    numel = sum(p.numel() for p in model.parameters())
    for step in range(3):  # the first step and those after the layout would change
        optimizer.zero_grad(set_to_none=step == 0)
        reduced_buffers.clear()
        for _ in range(passes):
            local_loss(model, hvd.rank()).backward()
        optimizer.step()
        expected = expected_average_gradients(passes)
        if op == "Sum":
            expected = [grad * hvd.size() for grad in expected]
        for got, want in zip([p.grad for p in model.parameters()], expected):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        if hvd.size() > 1 and step == 0:  # later, the engine may fold a small cached bucket
            # into its negotiation (engine/fold.py), which the watch does not see
            assert reduced_buffers == [(reduced_buffers[0][0], "float32", numel)]


def test_a_whole_bucket_with_a_missing_gradient_starts_at_synchronize(whole_buckets):
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                         named_parameters=model.named_parameters())
    for _ in range(2):
        optimizer.zero_grad()
        if hvd.rank() == 0:
            model[0](torch.ones(1, 4)).sum().backward()  # the last layer gets no gradient here
        else:
            model(torch.ones(1, 4)).sum().backward()
        optimizer.step()  # must not hang: the held bucket starts with zeros for the rest
    if hvd.size() > 1:
        assert all(p.grad is not None for p in model.parameters())
        last_bias = model[2].bias.grad  # every rank but 0 contributed ones: (size - 1) / size
        torch.testing.assert_close(last_bias, torch.full_like(last_bias,
                                                              (hvd.size() - 1) / hvd.size()))


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_a_whole_bucket_with_a_compressor_reduces_each_member(whole_buckets, compression):
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression=getattr(hvd.Compression, compression))
    local_loss(model, hvd.rank()).backward()
    optimizer.step()
    tolerance = {"fp16": 1e-3, "bf16": 1e-2}[compression]
    for got, want in zip(model.parameters(), expected_step(0.1)):
        torch.testing.assert_close(got.detach(), want, atol=tolerance, rtol=tolerance)


def test_a_gradient_twice_in_a_held_bucket_is_refused(whole_buckets):
    if hvd.size() == 1:
        pytest.skip("one rank reduces nothing: no hooks")
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                         named_parameters=model.named_parameters())
    model[0](torch.ones(1, 4)).sum().backward()  # holds the bucket: the rest are missing
    with pytest.raises(RuntimeError, match="computed more than backward_passes_per_step=1 times before step"):
        model[0](torch.ones(1, 4)).sum().backward()
    optimizer.synchronize()


def test_a_parameter_frozen_after_the_layout_leaves_its_bucket_to_the_others():
    """requires_grad turned off after the optimizer laid out its buckets: the bucket waits
    for a gradient that never comes, starts at synchronize, and reduces the others."""
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        named_parameters=[(f"frozen.{name}", p) for name, p in model.named_parameters()])
    frozen = model[0].weight
    frozen.requires_grad_(False)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        local_loss(model, hvd.rank()).backward()
        optimizer.step()
        assert frozen.grad is None
        for parameter, want in zip(model.parameters(), expected_average_gradients()):
            if parameter is not frozen:
                torch.testing.assert_close(parameter.grad, want, atol=1e-6, rtol=1e-6)
    frozen.requires_grad_(True)  # and back: every gradient reduced again
    optimizer.zero_grad(set_to_none=True)
    local_loss(model, hvd.rank()).backward()
    optimizer.step()
    for got, want in zip([p.grad for p in model.parameters()], expected_average_gradients()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_whole_buckets_follow_a_new_fusion_threshold():
    """When the route's fusion threshold changes (the autotuner), whole buckets are laid out
    again at the new size after the step, their gradients kept, and keep reducing right."""
    from hororing.context import current
    if hvd.size() == 1:
        pytest.skip("nothing is reduced on one rank: no buckets")
    pipeline = current().engine.executor.allreduce
    saved = pipeline.route.fusion_threshold
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        named_parameters=[(f"rethreshold.{name}", p) for name, p in model.named_parameters()])
    parameters = list(model.parameters())

    def step():
        optimizer.zero_grad(set_to_none=False)
        local_loss(model, hvd.rank()).backward()
        optimizer.step()
        for got, want in zip([p.grad for p in parameters], expected_average_gradients()):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        return {p.grad.untyped_storage().data_ptr() for p in parameters}

    try:
        assert len(step()) == 1  # 23 float32 gradients: one bucket
        hvd.barrier()
        # backward order 2.bias (8 B), 2.weight (24), 0.bias (12), 0.weight (48): in buckets
        # of at most 40 bytes, [2.bias, 2.weight], [0.bias], [0.weight]
        pipeline.reroute(fusion_threshold=40)
        kept = [p.grad.clone() for p in parameters]
        step()  # reduced in the old buckets, then laid out again, gradients kept
        assert len(step()) == 3
        assert all(torch.equal(a, b) for a, b in zip(kept, [p.grad for p in parameters]))
    finally:
        hvd.barrier()
        pipeline.reroute(fusion_threshold=saved)
