"""Ranks blocked on collectives of different names end with an error naming them, on every
rank, after the deadlock grace (``engine/deadlocks.py``); the job goes on. The grace is 1 s
here (a fixture), 5 s by default."""

import dataclasses
import time

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from hororing.context import current

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2,
                                reason="a deadlock needs two ranks")


@pytest.fixture(autouse=True)
def one_second_grace():
    engine = current().engine
    config = engine.config
    engine.config = dataclasses.replace(config, deadlock_grace_seconds=1.0)
    yield
    engine.config = config


def mine(rank=None):
    """This rank's own name: every rank a different one."""
    return f"only.rank{hvd.rank() if rank is None else rank}"


def still_works():
    rank, size = hvd.rank(), hvd.size()
    result = hvd.allreduce(np.full(3, rank + 1.0), op=hvd.Sum, name="after.deadlock")
    np.testing.assert_array_equal(result, np.full(3, size * (size + 1) / 2))


def expect_deadlock(call, kind):
    with pytest.raises(hvd.HorovodInternalError) as raised:
        call()
    message = str(raised.value)
    assert message.startswith("Deadlock: every rank is blocked in a collective that can never "
                              "complete")
    for rank in range(hvd.size()):  # each rank's own wait, and who submitted each name
        assert f"rank {rank} waits on {kind} '{mine(rank)}" in message, message
        assert f"'{mine(rank)}" in message and f"by rank(s) [{rank}]" in message, message
    assert "HORORING_DEADLOCK_GRACE_SECONDS" in message
    still_works()


CALLS = {
    "allreduce": lambda: hvd.allreduce(np.ones(4), name=mine()),
    "allgather": lambda: hvd.allgather(np.ones((2, 2)), name=mine()),
    "broadcast": lambda: hvd.broadcast(np.ones(3), root_rank=0, name=mine()),
    "alltoall": lambda: hvd.alltoall(np.ones(hvd.size() * 2), name=mine()),
    "reducescatter": lambda: hvd.reducescatter(np.ones(hvd.size() * 3), name=mine()),
}


@pytest.mark.parametrize("kind", list(CALLS))
def test_blocking_calls_of_different_names_end_in_an_error_on_every_rank(kind):
    expect_deadlock(CALLS[kind], kind)


@pytest.mark.parametrize("kind,call", [
    ("allreduce", lambda: hvd.grouped_allreduce([np.ones(2), np.ones(3)], name=mine())),
    ("allgather", lambda: hvd.grouped_allgather([np.ones((1, 2))], name=mine())),
    ("reducescatter", lambda: hvd.grouped_reducescatter([np.ones(hvd.size())], name=mine())),
])
def test_grouped_calls_of_different_names_end_in_an_error_on_every_rank(kind, call):
    expect_deadlock(call, kind)


def test_a_barrier_against_an_allreduce_names_both():
    with pytest.raises(hvd.HorovodInternalError, match="Deadlock") as raised:
        if hvd.rank() == 0:
            hvd.barrier()
        else:
            hvd.allreduce(np.ones(2), name=mine())
    assert "rank 0 waits on barrier 'barrier'" in str(raised.value)
    assert "rank 1 waits on allreduce 'only.rank1'" in str(raised.value)
    still_works()


def test_synchronize_on_an_asynchronous_handle_counts_as_blocked():
    handle = hvd.allreduce_async(np.ones(2), name=mine())
    expect_deadlock(lambda: hvd.synchronize(handle), "allreduce")


def test_asynchronous_calls_nobody_waits_for_are_left_to_complete():
    # another thread (here: the same one, later) may still submit the match: no error
    rank, size = hvd.rank(), hvd.size()
    handles = {rank: hvd.allreduce_async(np.full(2, 1.0), op=hvd.Sum, name=mine())}
    time.sleep(2.5)  # longer than the grace, with nothing waited for
    assert not handles[rank].done()
    MPI.COMM_WORLD.Barrier()  # no rank submits the others' names before every rank looked
    for other in range(size):
        if other != rank:
            handles[other] = hvd.allreduce_async(np.full(2, 1.0), op=hvd.Sum, name=mine(other))
    for handle in handles.values():
        np.testing.assert_array_equal(hvd.synchronize(handle), np.full(2, size))


def test_a_rank_that_is_only_late_is_waited_for():
    # the last rank computes for longer than the grace before it calls: nobody is deadlocked
    if hvd.rank() == hvd.size() - 1:
        time.sleep(2.5)
    result = hvd.allreduce(np.ones(2), op=hvd.Sum, name="late.but.matching")
    np.testing.assert_array_equal(result, np.full(2, hvd.size()))


def test_with_no_grace_nothing_is_failed(monkeypatch):
    engine = current().engine
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config,
                                                              deadlock_grace_seconds=0.0))
    rank, size = hvd.rank(), hvd.size()
    handle = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name=mine())
    engine.await_(handle)  # as if a thread waited on it
    time.sleep(2.5)
    assert not handle.done()
    MPI.COMM_WORLD.Barrier()  # no rank submits the others' names before every rank looked
    handles = [hvd.allreduce_async(np.ones(2), op=hvd.Sum, name=mine(other))
               for other in range(size) if other != rank]
    for other in [handle] + handles:
        np.testing.assert_array_equal(hvd.synchronize(other), np.full(2, size))
