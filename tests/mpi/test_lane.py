"""A repeated blocking allreduce runs its lane (engine/lane.py): the same bits as the usual
path, a new result each call where it is not in place, and anything that differs from the
call it was planned on (arguments, dtype, shape, layout, a peer's metadata, a joined rank)
goes the usual way, with the usual checks and errors."""

import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from hororing.context import current
from changed_call import last_rank_changes_its_call
from reference import (all_inputs, assert_close, assert_identical_on_every_rank, rank_input,
                       reference_allreduce)

SINGLE = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="a mismatch needs two ranks")
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
LENGTH = 1001  # divides by none of 2, 3, 4, 5


def _engine():
    return current().engine


def _lane_hits():
    return _engine().stats()["lane_hits"]


@pytest.fixture(scope="module", autouse=True)
def fresh_cache():
    """Only a cached name folds, and a long session fills the response cache with the names
    of earlier tests: these start from an empty one."""
    hvd.shutdown()
    hvd.init()


def _settle(call, calls=4):
    """Calls until the name folds and its lane is learned (the third call folds)."""
    for _ in range(calls):
        call()


def _until_a_lane_is_taken(call, most=200):
    """``call()`` until a call has taken its lane on every rank (every rank makes the same
    calls: whether to go on is agreed outside the library after each). Whether a given call
    takes it depends on the peers' timing (a peer's engine may start the cycle before its
    caller has submitted: that call then folds a cycle later, the usual way; the background
    thread may hold the engine for a moment): on a quiet machine the first call does, and no
    machine makes every one of ``most`` calls miss it on some rank."""
    before = _lane_hits()
    for _ in range(most):
        call()
        if MPI.COMM_WORLD.allreduce(_lane_hits() > before, op=MPI.LAND):
            return
    raise AssertionError(f"after {most} repeated calls some rank had not taken its lane")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "uint8"])
@pytest.mark.parametrize("op", OPS, ids=lambda op: hvd.ops.op_name(op))
def test_the_lane_gives_the_bits_of_the_usual_path(dtype, op):
    prescale, postscale = (1.0, 1.0) if np.dtype(dtype).kind != "f" else (0.5, 3.0)
    name = f"lane.{dtype}.{hvd.ops.op_name(op)}"
    buffer = rank_input(hvd.rank(), (LENGTH,), dtype, 0, op)

    def call(seed):
        buffer[...] = rank_input(hvd.rank(), (LENGTH,), dtype, seed, op)
        return hvd.allreduce_(buffer, name=name, op=op, prescale_factor=prescale,
                              postscale_factor=postscale).copy()
    _settle(lambda: call(0))
    if hvd.size() > 1:  # one rank folds nothing: its single-rank cycle runs locally
        _until_a_lane_is_taken(lambda: call(0))
    laned = [call(seed) for seed in range(1, 6)]
    usual = []
    for seed in range(1, 6):
        _engine().lanes.clear()  # forgotten before each call: the usual path every time
        usual.append(call(seed))
    for seed, (mine, theirs) in enumerate(zip(laned, usual), start=1):
        assert mine.tobytes() == theirs.tobytes(), seed
        expected = reference_allreduce(all_inputs(hvd.size(), (LENGTH,), dtype, seed, op), op,
                                       prescale, postscale)
        assert_close(mine, expected)
        assert_identical_on_every_rank(mine)


def test_an_out_of_place_lane_returns_a_new_result_each_call():
    values = np.arange(LENGTH, dtype=np.float32) + hvd.rank()
    results = [hvd.allreduce(values * (call + 1), name="lane.new", op=hvd.Sum)
               for call in range(8)]
    base = np.arange(LENGTH, dtype=np.float64) * hvd.size() + sum(range(hvd.size()))
    for call, result in enumerate(results):
        assert result is not values
        assert_close(result, (base * (call + 1)).astype(np.float32))
    assert len({id(result) for result in results}) == len(results)


def test_a_different_call_under_the_lane_name_takes_the_usual_way():
    """A call unlike the one the lane was planned on (dtype, shape, layout, op given as
    average) is checked and run as a first call is."""
    values = np.full(LENGTH, 2.0, dtype=np.float32)
    _settle(lambda: hvd.allreduce_(values.copy(), name="lane.changes", op=hvd.Sum))
    size = hvd.size()
    assert_close(hvd.allreduce_(values.copy(), name="lane.changes", op=hvd.Sum),
                 np.full(LENGTH, 2.0 * size, dtype=np.float32))
    assert_close(hvd.allreduce_(values.astype(np.float64), name="lane.changes", op=hvd.Sum),
                 np.full(LENGTH, 2.0 * size))
    assert_close(hvd.allreduce_(values[:7].copy(), name="lane.changes", op=hvd.Sum),
                 np.full(7, 2.0 * size, dtype=np.float32))
    strided = np.full(2 * LENGTH, 2.0, dtype=np.float32)[::2]  # in place, not contiguous
    hvd.allreduce_(strided, name="lane.changes", op=hvd.Sum)
    assert_close(strided, np.full(LENGTH, 2.0 * size, dtype=np.float32))
    # average=False is Sum, average=0 is not the same argument (the usual path decides)
    _settle(lambda: hvd.allreduce_(values.copy(), name="lane.average", average=False))
    assert_close(hvd.allreduce_(values.copy(), name="lane.average", average=0),
                 np.full(LENGTH, 2.0, dtype=np.float32))


def test_a_lane_whose_cache_entry_changed_goes_the_usual_way_then_resumes():
    """An asynchronous call under the lane's name with another dtype of the same size (so the
    fold still expects its bytes) changes the name's cache entry: the lane's next call (which the door still matches) is not folded by the
    lane's id; it is negotiated again, gives the right sum, and the lane is taken again. Rank
    0 forgets its lanes meanwhile, so its call is announced by name: a peer folding by the
    stale id would be read as the other dtype and fail the call as a mismatch."""
    values = np.full(LENGTH, 2.0, dtype=np.float32) + hvd.rank()
    expected = np.full(LENGTH, 2.0 * hvd.size() + sum(range(hvd.size())), dtype=np.float32)

    def call():
        return hvd.allreduce_(values.copy(), name="lane.entry", op=hvd.Sum)
    _settle(call)
    if hvd.size() > 1:
        _until_a_lane_is_taken(call)
    other = hvd.synchronize(hvd.allreduce_async(values.astype(np.int32), name="lane.entry",
                                                op=hvd.Sum))
    np.testing.assert_array_equal(other, expected.astype(np.int32))
    if hvd.rank() == 0:
        _engine().lanes.clear()
    else:
        assert _engine().lanes["lane.entry"].dtype == np.float32  # the door would take it
    for _ in range(3):
        assert_close(call(), expected)
    if hvd.size() > 1:
        _until_a_lane_is_taken(call)
    assert_close(call(), expected)


def test_a_read_only_array_is_refused_on_every_rank_as_at_the_first_call():
    values = np.ones(LENGTH, dtype=np.float32)
    _settle(lambda: hvd.allreduce_(values, name="lane.readonly", op=hvd.Sum))
    frozen = np.ones(LENGTH, dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        hvd.allreduce_(frozen, name="lane.readonly", op=hvd.Sum)
    values[...] = 1.0
    assert_close(hvd.allreduce_(values, name="lane.readonly", op=hvd.Sum),
                 np.full(LENGTH, float(hvd.size()), dtype=np.float32))


@SINGLE
def test_a_second_thread_calling_the_name_of_a_lane_in_flight_is_refused():
    """While one thread's call waits in its lane for a late peer, another thread's call under
    the same name is refused as a name in flight, as it is on the usual path. The peers hold
    their engines meanwhile (their background threads cannot answer with a cycle, which would
    send the waiting call on to the vote, where it is in flight anyway)."""
    name = "lane.in_flight"
    values = np.full(LENGTH, 1.0 + hvd.rank(), dtype=np.float32)
    _settle(lambda: hvd.allreduce_(values.copy(), name=name, op=hvd.Sum))
    _until_a_lane_is_taken(lambda: hvd.allreduce_(values.copy(), name=name, op=hvd.Sum))
    expected = np.full(LENGTH, sum(1.0 + rank for rank in range(hvd.size())), np.float32)
    signals = MPI.COMM_WORLD.Dup()
    try:
        if hvd.rank() != 0:  # late: only once rank 0's second thread has been refused
            with _engine()._drive_lock:
                for _ in range(3000):
                    if signals.Iprobe(source=0):
                        break
                    time.sleep(0.01)
            signals.recv(source=0)
            assert_close(hvd.allreduce_(values.copy(), name=name, op=hvd.Sum), expected)
            return
        results, refused = [], []
        first = threading.Thread(target=lambda: results.append(
            hvd.allreduce_(values.copy(), name=name, op=hvd.Sum)))
        first.start()
        for _ in range(3000):  # the first call is in flight, waiting for its peers
            if name in _engine().in_flight:
                break
            time.sleep(0.01)
        assert name in _engine().in_flight, "the first thread's call is not in flight"
        try:
            hvd.allreduce_(values.copy(), name=name, op=hvd.Sum)
        except ValueError as error:
            refused.append(str(error))
        for peer in range(1, hvd.size()):
            signals.send(None, dest=peer)
        first.join()
        assert refused and name in refused[0] and "in flight" in refused[0], refused
        assert_close(results[0], expected)
    finally:
        signals.Free()


@SINGLE
@pytest.mark.parametrize("change", ["op", "shape", "dtype"])
def test_a_peer_that_changes_its_call_fails_every_rank_by_name(change):
    """Every rank but the last calls as before (its lane); the last changes the op, the
    shape or the dtype: the fold is not agreed, the cycle goes on to the vote and the
    mismatch is named on every rank. The job goes on."""
    name = f"lane.mismatch.{change}"
    values = np.ones(LENGTH, dtype=np.float32)
    _settle(lambda: hvd.allreduce_(values.copy(), name=name, op=hvd.Sum))
    last_rank_changes_its_call(name, values, change)


@SINGLE
def test_a_rank_that_joins_ends_the_lane_of_the_others():
    """The last rank joins while the others repeat their call: theirs go on with its
    contribution as zeros, as without the lane."""
    values = np.ones(LENGTH, dtype=np.float32)
    _settle(lambda: hvd.allreduce_(values.copy(), name="lane.join", op=hvd.Sum))
    if hvd.rank() == hvd.size() - 1:
        last = hvd.join()
    else:
        for _ in range(4):
            result = hvd.allreduce_(values.copy(), name="lane.join", op=hvd.Sum)
            assert_close(result, np.full(LENGTH, float(hvd.size() - 1), dtype=np.float32))
        last = hvd.join()
    assert last != hvd.size() - 1  # it joined first
    assert_close(hvd.allreduce_(values.copy(), name="lane.join", op=hvd.Sum),
                 np.full(LENGTH, float(hvd.size()), dtype=np.float32))


def test_the_torch_bindings_repeated_call_takes_the_lane():
    torch = pytest.importorskip("torch")
    import hororing.torch as thvd
    tensor = torch.arange(LENGTH, dtype=torch.float32) + hvd.rank()
    expected = torch.arange(LENGTH, dtype=torch.float64) * hvd.size() + sum(range(hvd.size()))
    _settle(lambda: thvd.allreduce(tensor, name="lane.torch", op=thvd.Sum))
    if hvd.size() > 1:
        _until_a_lane_is_taken(lambda: thvd.allreduce(tensor, name="lane.torch", op=thvd.Sum))
    results = [thvd.allreduce(tensor, name="lane.torch", op=thvd.Sum) for _ in range(4)]
    for result in results:
        assert result.dtype == torch.float32
        assert torch.equal(result.double(), expected)
    assert len({result.data_ptr() for result in results}) == len(results)
    inplace = tensor.clone()
    _settle(lambda: thvd.allreduce_(inplace.copy_(tensor), name="lane.torch_", op=thvd.Sum))
    for _ in range(3):
        thvd.allreduce_(inplace.copy_(tensor), name="lane.torch_", op=thvd.Sum)
        assert torch.equal(inplace.double(), expected)


def test_unnamed_blocking_calls_repeat_one_name_and_take_the_lane():
    """An unnamed blocking call is named the same each time (Group.blocking_name), so a loop
    of them is cached, folds and takes its lane as a named one does; unnamed asynchronous
    calls between them keep their own numbered names and still pair across ranks."""
    values = np.arange(LENGTH, dtype=np.float32) + hvd.rank()
    expected = (np.arange(LENGTH, dtype=np.float64) * hvd.size()
                + sum(range(hvd.size()))).astype(np.float32)
    _settle(lambda: hvd.allreduce(values, op=hvd.Sum))
    if hvd.size() > 1:
        _until_a_lane_is_taken(lambda: hvd.allreduce(values, op=hvd.Sum))
    assert "allreduce.noname.blocking" in _engine().lanes or hvd.size() == 1
    for call in range(3):
        handle = hvd.allreduce_async(values * (call + 2), op=hvd.Sum)  # numbered, in flight
        assert_close(hvd.allreduce(values, op=hvd.Sum), expected)
        assert_close(hvd.synchronize(handle), (expected * (call + 2)).astype(np.float32))


def test_an_unnamed_blocking_call_from_another_thread_takes_that_threads_lane():
    """The door names the main thread's unnamed blocking calls without a call (by its
    ident); a call from another thread still carries that thread's name, and its loop takes
    a lane of its own."""
    values = np.arange(LENGTH, dtype=np.float32) * (hvd.rank() + 1)
    expected = (np.arange(LENGTH, dtype=np.float64) * sum(range(1, hvd.size() + 1))
                ).astype(np.float32)
    failures = []

    def work():
        try:
            _settle(lambda: hvd.allreduce(values, op=hvd.Sum))
            if hvd.size() > 1:
                _until_a_lane_is_taken(lambda: hvd.allreduce(values, op=hvd.Sum))
            assert_close(hvd.allreduce(values, op=hvd.Sum), expected)
        except BaseException as error:  # re-raised on the main thread
            failures.append(error)
    thread = threading.Thread(target=work, name="worker")
    thread.start()
    thread.join()
    if failures:
        raise failures[0]
    assert "allreduce.worker.noname.blocking" in _engine().lanes or hvd.size() == 1


@SINGLE
def test_a_peers_wake_up_waits_a_moment_for_a_caller_in_a_lane_loop_then_is_answered(
        monkeypatch):
    """While a rank's caller repeats a lane's call, a peer's wake-up that finds nothing
    pending there is left for the caller for a moment (wakeups.LANE_GRACE_S), then answered
    by the background thread; the late caller's call then has the right result."""
    from hororing.engine import wakeups
    monkeypatch.setattr(wakeups, "LANE_LOOP_S", 3600.0)  # every wake-up here is in the loop
    engine = _engine()
    late = hvd.size() - 1
    left = []
    leave = engine._grace.leave

    def recorded(asked):
        left.append(leave(asked))
        return left[-1]
    monkeypatch.setattr(engine._grace, "leave", recorded)
    values = np.arange(LENGTH, dtype=np.float64)

    def call(seed):
        return hvd.allreduce(values * (hvd.rank() + seed), name="lane.late", op=hvd.Sum)
    _settle(lambda: call(1))
    _until_a_lane_is_taken(lambda: call(1))
    for seed in range(2, 5):
        if hvd.rank() == late:  # the peers' call wakes this rank: its engine answers alone
            number, deadline = engine.cycle.number, time.monotonic() + 120
            while engine.cycle.number == number:
                assert time.monotonic() < deadline, "a peer's wake-up was never answered"
                time.sleep(0.001)
        result = call(seed)
        expected = values * sum(rank + seed for rank in range(hvd.size()))
        assert result.tobytes() == expected.tobytes()  # sums of small integers: exact
    if hvd.rank() == late:  # left for the caller first, then answered
        assert True in left and left[-1] is False, left


@SINGLE
def test_unnamed_blocking_calls_that_differ_fail_every_rank_by_name():
    _settle(lambda: hvd.allreduce(np.ones(LENGTH, dtype=np.float32), op=hvd.Sum))
    length = LENGTH + (1 if hvd.rank() == hvd.size() - 1 else 0)
    with pytest.raises(Exception, match="Mismatched ALLREDUCE tensor shapes"):
        hvd.allreduce(np.ones(length, dtype=np.float32), op=hvd.Sum)
    assert_close(hvd.allreduce(np.ones(LENGTH, dtype=np.float32), op=hvd.Sum),
                 np.full(LENGTH, float(hvd.size()), dtype=np.float32))
