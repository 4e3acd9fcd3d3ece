"""What a comm hook is handed and what it must hand back, numpy and torch alike: which bucket
is the last of the layout, and a result without wait() refused by name."""

import pytest
import torch

import hororing.torch as hvd
from hororing import comm_hooks

from test_comm_hooks import make_model, needs_peers, numpy_optimizer, numpy_step, torch_batch


def test_a_hook_is_told_which_bucket_is_the_last_of_the_layout():
    """GradBucket.is_last(), as DDP's: True for the optimizer's last bucket only, numpy and
    torch alike (a hook that flushes state once per step keys on it)."""
    from hororing.context import current

    needs_peers()
    pipeline = current().engine.allreduce
    before = pipeline.route
    seen = {"numpy": [], "torch": []}

    def recording(kind):
        def hook(state, bucket):
            seen[kind].append((bucket.index(), bucket.is_last()))
            return (comm_hooks if kind == "numpy" else hvd.comm_hooks).allreduce(state, bucket)
        return hook
    pipeline.reroute(hook_bucket_bytes=1000)  # several buckets of the models below
    try:
        optimizer = numpy_optimizer(recording("numpy"))
        numpy_step(optimizer, 0)
        model = make_model()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             model.named_parameters(),
                                             comm_hook=recording("torch"))
        inputs, labels = torch_batch(hvd.rank())
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.synchronize()
    finally:
        pipeline.reroute(hook_bucket_bytes=before.hook_bucket_bytes)
    for kind, buckets in seen.items():
        assert len(buckets) >= 2, (kind, buckets)
        last = max(index for index, _ in buckets)
        assert sorted(buckets) == [(index, index == last) for index in range(last + 1)], kind


def test_a_hook_that_returns_no_wait_is_named_on_numpy_and_torch_alike():
    needs_peers()

    def returns_the_buffer(state, bucket):
        return bucket.buffer()
    optimizer = numpy_optimizer(returns_the_buffer)
    with pytest.raises(TypeError, match="a comm_hook returns something with wait.*"
                                        "returns_the_buffer.* returned ndarray"):
        numpy_step(optimizer, 0)
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model.named_parameters(),
                                         comm_hook=returns_the_buffer)
    inputs, labels = torch_batch(hvd.rank())
    with pytest.raises(TypeError, match="returns_the_buffer.* returned Tensor"):
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.synchronize()
