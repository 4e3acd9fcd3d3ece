"""hvd.elastic inside one job: commit, restore, sync, the run decorator's answer to a failed
collective, ElasticSampler's shares, and commits written to and resumed from disk."""

import numpy as np
import pytest

import hororing as hvd
from hororing.elastic import job


def test_object_state_syncs_from_rank_0_and_rolls_back_to_the_last_commit():
    state = hvd.elastic.ObjectState(epoch=10 + hvd.rank(), history=[hvd.rank()])
    state.sync()
    assert state.epoch == 10 and state.history == [0]
    state.epoch, _ = 11, state.history.append(1)
    state.restore()
    assert state.epoch == 10 and state.history == [0]  # deep copies: the append is undone
    state.epoch = 12
    state.history.append(2)
    state.commit()
    state.epoch, state.history = 99, []
    state.restore()
    assert state.epoch == 12 and state.history == [0, 2]


def test_a_failed_collective_rolls_the_state_back_and_reaches_the_caller_on_every_rank():
    state = hvd.elastic.ObjectState(step=0)
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(1)
        state.step = 5
        state.commit()
        state.step = 6
        # the ranks disagree on the shape: refused on every rank before data moves
        hvd.allreduce(np.zeros(2 + hvd.rank() % 2), name="elastic.mismatch")

    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")
    with pytest.raises(hvd.HorovodInternalError, match="elastic.mismatch"):
        train(state)
    assert calls == [1] and state.step == 5


def test_host_updates_are_not_checked_outside_hororun(monkeypatch):
    monkeypatch.delenv(job.DIR_ENV, raising=False)
    state = hvd.elastic.ObjectState(step=0)
    state.commit()  # no collective, no interrupt
    state.check_host_updates()


def test_commits_reach_disk_and_a_new_state_resumes_from_the_newest(tmp_path_factory,
                                                                     monkeypatch):
    directory = hvd.broadcast_object(str(tmp_path_factory.mktemp("commits")), root_rank=0)
    monkeypatch.setenv(job.DIR_ENV, directory)
    monkeypatch.setenv(job.LAUNCH_ENV, "1")
    weights = np.arange(5.0) * (hvd.rank() + 1)
    state = hvd.elastic.ObjectState(step=3, weights=weights)
    state.sync()
    for step in (4, 5):
        state.step = step
        state.weights = state.weights + 1
        state.commit()
    hvd.barrier()
    fresh = hvd.elastic.ObjectState(step=0, weights=np.zeros(5))
    assert fresh._resume() == 2
    assert fresh.step == 5 and np.array_equal(fresh.weights, np.arange(5.0) + 2)
    fresh.commit()
    assert fresh._commits == 3


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_a_torn_newest_commit_resumes_from_the_one_before_and_says_so(tmp_path_factory,
                                                                     monkeypatch, capfd, damage):
    from hororing.elastic import commits
    directory = hvd.broadcast_object(str(tmp_path_factory.mktemp(f"torn_{damage}")), root_rank=0)
    monkeypatch.setenv(job.DIR_ENV, directory)
    monkeypatch.setenv(job.LAUNCH_ENV, "1")
    state = hvd.elastic.ObjectState(step=0)
    state.sync()
    for step in (1, 2):
        state.step = step
        state.commit()
    hvd.barrier()
    newest = commits.path_of(directory, 2)
    # as a power cut leaves it, on every host's copy: every host reads before any writes (the
    # hosts of one machine, emulated ones too, share one file)
    data = newest.read_bytes() if hvd.local_rank() == 0 else None
    hvd.barrier()
    if hvd.local_rank() == 0:
        if damage == "truncate":
            newest.write_bytes(data[:len(data) // 3])
        else:
            newest.write_bytes(data[:10] + bytes([data[10] ^ 0xFF]) + data[11:])
    hvd.barrier()
    fresh = hvd.elastic.ObjectState(step=-1)
    assert fresh._resume() == 1
    assert fresh.step == 1
    if hvd.local_rank() == 0:
        assert f"skips commit file {newest}" in capfd.readouterr().err


def test_the_run_decorator_resumes_and_calls_the_reset_callbacks(tmp_path_factory, monkeypatch):
    directory = hvd.broadcast_object(str(tmp_path_factory.mktemp("resume")), root_rank=0)
    monkeypatch.setenv(job.DIR_ENV, directory)
    first = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run
    def advance(state, steps):
        for _ in range(steps):
            state.step += 1
            state.commit()
        return state.step

    assert advance(first, 4) == 4
    hvd.barrier()
    resets = []
    again = hvd.elastic.ObjectState(step=0)
    again.register_reset_callbacks([lambda: resets.append(hvd.size())])
    assert advance(again, 2) == 6 and resets == [hvd.size()]


def test_torch_state_and_the_elastic_sampler():
    torch = pytest.importorskip("torch")
    import hororing.torch as thvd

    torch.manual_seed(thvd.rank())
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dataset = list(range(23))  # not divisible by 2, 3 or 4
    sampler = thvd.elastic.ElasticSampler(dataset, shuffle=True, seed=5)
    state = thvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=thvd.rank())
    state.sync()
    root = thvd.broadcast_object({k: v.clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(model.state_dict()[k], v) for k, v in root.items())
    assert state.epoch == 0
    # every rank's share, gathered, is the epoch's order (padded by repeats to equal shares)
    shares = thvd.allgather_object(list(iter(sampler)))
    assert sorted(set(sum(shares, []))) == dataset and len({len(s) for s in shares}) == 1
    first_batch = 4
    sampler.record_batch(0, first_batch)
    state.commit()
    model.weight.data.zero_()
    sampler.set_epoch(7)
    state.restore()
    assert torch.equal(model.weight, root["weight"]) and sampler.epoch == 0
    rest = thvd.allgather_object(list(iter(sampler)))
    seen = {i for share in shares for i in share[:first_batch]}
    left = set(sum(rest, []))
    assert left.isdisjoint(seen) or thvd.size() * first_batch > len(dataset)
    assert seen | left == set(dataset)
