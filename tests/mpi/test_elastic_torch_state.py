"""hvd.elastic.TorchState with torch optimizers: restore() returns to the commit however
often it is called, and a sharded optimizer's commits hold its slices (in memory, and on disk
as a checkpoint every rank writes its part of) instead of the gathered state."""

import os

import pytest

torch = pytest.importorskip("torch")

import hororing.torch as hvd  # noqa: E402
from hororing.elastic import job  # noqa: E402
from hororing.torch.elastic import state as torch_state  # noqa: E402


def make(sharded, seed=3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                         sharded=sharded)
    return model, optimizer


def step(model, optimizer, number):
    generator = torch.Generator().manual_seed(100 * number + hvd.rank())
    optimizer.zero_grad()
    model(torch.randn(4, 7, generator=generator)).pow(2).mean().backward()
    optimizer.step()


def full(optimizer):
    """The whole state (a sharded optimizer's gathered: collective), copied."""
    return {index: {key: value.clone() for key, value in entry.items()}
            for index, entry in optimizer.state_dict()["state"].items()}


def assert_same(state, expected):
    assert state.keys() == expected.keys()
    for index in expected:
        for key in expected[index]:
            assert torch.equal(state[index][key], expected[index][key]), (index, key)


@pytest.mark.parametrize("sharded", [False, True, 2])
def test_restore_returns_to_the_commit_however_often_it_is_called(sharded):
    model, optimizer = make(sharded)
    step(model, optimizer, 0)
    state = hvd.elastic.TorchState(model, optimizer, step=1)
    state.commit()
    committed = full(optimizer)
    parameters = [parameter.detach().clone() for parameter in model.parameters()]
    for attempt in range(2):  # each restore() must give the commit, not what steps made of it
        step(model, optimizer, 5 + attempt)
        state.restore()
        assert_same(full(optimizer), committed)
        for parameter, value in zip(model.parameters(), parameters):
            assert torch.equal(parameter.detach(), value)
    if sharded:  # this rank's slices only: nothing gathered for the commit
        saved = state._handlers["optimizer"].saved["slices"]["state"]
        held = sum(entry["exp_avg"].numel() for entry in saved.values())
        assert held == sum(leaf.numel() for group in optimizer.param_groups
                           for leaf in group["params"])
        assert hvd.size() == 1 or held < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("shared", [True, False], ids=["shared_directory", "host_local"])
def test_a_sharded_commit_on_disk_resumes_in_another_sharded_optimizer(tmp_path_factory,
                                                                       monkeypatch, shared):
    directory = hvd.broadcast_object(str(tmp_path_factory.mktemp("commits")), root_rank=0)
    monkeypatch.setenv(job.DIR_ENV, directory)
    monkeypatch.setenv(job.LAUNCH_ENV, "1")
    if not shared:  # each host its own disk: the commit file holds the gathered state
        monkeypatch.setattr(torch_state, "_shared", lambda directory: False)
    model, optimizer = make(True)
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    state.sync()
    for number in range(3):
        step(model, optimizer, number)
        state.step = number + 1
        state.commit()
    committed = full(optimizer)
    hvd.barrier()
    shards = sorted(name for name in os.listdir(directory) if name.endswith(".shards"))
    assert shards == ([f"commit-{seq:010d}.optimizer.shards" for seq in (2, 3)]
                      if shared else [])

    resumed_model, resumed = make(2, seed=9)  # other values, stage 2: the slices replace them
    fresh = hvd.elastic.TorchState(resumed_model, resumed, step=0)
    assert fresh._resume() == 3
    assert fresh.step == 3
    assert_same(full(resumed), committed)
    for parameter, value in zip(resumed_model.parameters(), model.parameters()):
        assert torch.equal(parameter.detach(), value.detach())
    step(resumed_model, resumed, 3)  # and it trains on, and rolls back to the resumed commit
    fresh.restore()
    assert_same(full(resumed), committed)


class Counter:
    """A training object of the user's own that TorchState knows nothing of."""

    def __init__(self):
        self.count = 0


class CounterHandler(torch_state.StateHandler):
    def capture(self):
        return self.value.count

    def apply(self, saved):
        self.value.count = saved

    def sync(self):
        self.value.count = hvd.broadcast_object(self.value.count, root_rank=0,
                                                name="elastic.counter")


def test_a_handler_registered_for_a_type_of_ones_own_commits_restores_and_syncs_it():
    registry = torch_state.get_handler_registry()
    torch_state.set_handler_registry([(Counter, CounterHandler)] + list(registry))
    try:
        counter = Counter()
        counter.count = 5 + hvd.rank()
        state = hvd.elastic.TorchState(counter=counter, epoch=0)
        state.sync()  # rank 0's count everywhere
        assert counter.count == 5
        state.commit()
        counter.count = 99
        state.restore()
        assert counter.count == 5
    finally:
        torch_state.set_handler_registry(registry)
    assert torch_state.get_handler_registry() is registry
    plain = hvd.elastic.TorchState(counter=Counter())  # unregistered: a plain attribute
    assert isinstance(plain.counter, Counter)
