"""torch.amp's GradScaler with hvd.DistributedOptimizer: the standard pattern
(``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``) trains as one process
does on the global batch, with a GradScaler of its own; a step with inf in one rank's gradients
is skipped on every rank and every rank's scale moves alike; unscaling before the averages is
refused on every rank; Horovod's clipping pattern works.
"""

import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402

# torch warns each step that GradScaler will stop passing itself to optimizers that scale for
# themselves (the wrapper's contract, amp.py, which silences it outside pytest)
pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself")

STEPS = 6
INF_STEP = 2  # the last rank's loss is infinite at this step


def model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def loss_of(net, rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
    loss = torch.nn.functional.mse_loss(net(x), y)
    if step == INF_STEP and rank == hvd.size() - 1:
        loss = loss * float("inf")
    return loss


def scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)


def reference(clip=None):
    """One process: the mean of every rank's loss, its own GradScaler."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    amp = scaler()
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = sum(loss_of(net, rank, step) for rank in range(hvd.size())) / hvd.size()
        amp.scale(loss).backward()
        if clip is not None:
            amp.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        amp.step(optimizer)
        amp.update()
    return [parameter.detach() for parameter in net.parameters()], amp.get_scale()


def assert_same_everywhere(net, scale):
    flat = torch.cat([parameter.detach().reshape(-1) for parameter in net.parameters()])
    everyone = hvd.allgather_object((flat, scale))
    for other, other_scale in everyone:
        assert torch.equal(other, flat) and other_scale == scale


@pytest.mark.parametrize("sharded", [False, 1, 2])
def test_the_standard_pattern_trains_as_one_process_and_skips_inf_steps_together(sharded):
    net = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         net.named_parameters(), sharded=sharded)
    amp = scaler()
    for step in range(STEPS):
        optimizer.zero_grad()
        amp.scale(loss_of(net, hvd.rank(), step)).backward()
        amp.step(optimizer)
        amp.update()
    expected, expected_scale = reference()
    assert amp.get_scale() == expected_scale
    # the inf step was skipped and the scale backed off: growth_interval 2 after it
    assert expected_scale == 2.0 ** 8 * 2 * 0.5 * 2 if hvd.size() > 1 else True
    for mine, theirs in zip(net.parameters(), expected):
        torch.testing.assert_close(mine.detach(), theirs, rtol=1e-5, atol=1e-6)
    assert_same_everywhere(net, amp.get_scale())


@pytest.mark.parametrize("sharded, words", [
    (False, r"optimizer\.synchronize\(\); scaler\.unscale_"),
    (1, r"not supported with DistributedOptimizer\(sharded=")])
def test_unscaling_before_the_averages_is_refused_on_every_rank_with_the_pattern(sharded, words):
    if hvd.size() == 1:
        pytest.skip("one rank has nothing to average")
    net = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         net.named_parameters(), sharded=sharded)
    amp = scaler()
    optimizer.zero_grad()
    amp.scale(loss_of(net, hvd.rank(), 0)).backward()
    amp.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=words):
        amp.step(optimizer)
    optimizer.zero_grad()  # the allreduces were finished: the next step starts clean


def test_horovods_clipping_pattern_matches_one_process():
    net = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         net.named_parameters())
    amp = scaler()
    for step in range(STEPS):
        optimizer.zero_grad()
        amp.scale(loss_of(net, hvd.rank(), step)).backward()
        optimizer.synchronize()
        amp.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        with optimizer.skip_synchronize():
            amp.step(optimizer)
        amp.update()
    expected, expected_scale = reference(clip=0.5)
    assert amp.get_scale() == expected_scale
    for mine, theirs in zip(net.parameters(), expected):
        torch.testing.assert_close(mine.detach(), theirs, rtol=1e-5, atol=1e-6)
    assert_same_everywhere(net, amp.get_scale())
