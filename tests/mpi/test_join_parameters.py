"""Uneven inputs with hvd.join(): rank r trains on 2 + 2r batches. The joined ranks add zeros
to the allreduces and step no more; after join() every rank holds the last rank's parameters.
These equal one process stepping with, at each step, the sum of the gradients of the ranks
still training divided by the job's size (what the allreduce's Average gives)."""

import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402


def batches_of(rank):
    return 2 + 2 * rank


def model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def loss_of(net, rank, step):
    generator = torch.Generator().manual_seed(31 * step + rank)
    x, y = torch.randn(3, 5, generator=generator), torch.randn(3, 2, generator=generator)
    return torch.nn.functional.mse_loss(net(x), y)


def reference():
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    for step in range(batches_of(hvd.size() - 1)):
        optimizer.zero_grad()
        active = [rank for rank in range(hvd.size()) if step < batches_of(rank)]
        (sum(loss_of(net, rank, step) for rank in active) / hvd.size()).backward()
        optimizer.step()
    return [parameter.detach() for parameter in net.parameters()]


@pytest.mark.parametrize("sharded", [False])
def test_after_join_every_rank_holds_the_last_ranks_parameters(sharded):
    net = model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5), net.named_parameters())
    for step in range(batches_of(hvd.rank())):
        optimizer.zero_grad()
        loss_of(net, hvd.rank(), step).backward()
        optimizer.step()
    last = hvd.join()
    assert last == hvd.size() - 1
    for mine, expected in zip(net.parameters(), reference()):
        torch.testing.assert_close(mine.detach(), expected, rtol=1e-5, atol=1e-6)
    flat = torch.cat([parameter.detach().reshape(-1) for parameter in net.parameters()])
    for other in hvd.allgather_object(flat):
        assert torch.equal(other, flat)
