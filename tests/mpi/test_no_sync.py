"""Gradient accumulation with ``optimizer.no_sync()``, as DDP's: backward passes inside reduce
nothing; the first one after reduces the accumulated sum. Three micro-batches per step (two
inside), against one process summing every rank's micro-batches over the job's size."""

import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402

MICRO = 3


def model():
    torch.manual_seed(9)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def loss_of(net, rank, step, micro):
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x, y = torch.randn(2, 4, generator=generator), torch.randn(2, 3, generator=generator)
    return torch.nn.functional.mse_loss(net(x), y)


def reference(steps):
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    for step in range(steps):
        optimizer.zero_grad()
        (sum(loss_of(net, rank, step, micro) for rank in range(hvd.size())
             for micro in range(MICRO)) / hvd.size()).backward()
        optimizer.step()
    return [parameter.detach() for parameter in net.parameters()]


def test_no_sync_accumulates_locally_and_the_next_pass_reduces_the_sum():
    net = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01),
                                         net.named_parameters())
    for step in range(3):
        optimizer.zero_grad()
        with optimizer.no_sync():
            for micro in range(MICRO - 1):
                loss_of(net, hvd.rank(), step, micro).backward()
        assert not optimizer._handles  # nothing in flight: nothing was started
        loss_of(net, hvd.rank(), step, MICRO - 1).backward()
        optimizer.step()
    for mine, expected in zip(net.parameters(), reference(3)):
        torch.testing.assert_close(mine.detach(), expected, rtol=1e-5, atol=1e-6)
