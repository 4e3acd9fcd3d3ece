"""A folded allreduce whose rows meet in the node's shared memory (engine/exchange.py's
SharedRows): every rank of the job on one node and rows of 8 KiB and more (smaller ones too
where the compiled cycle runs on the window's flags). The same bits as
rows gathered by MPI (the same job started again with HORORING_SHARED_FOLD's switch off),
against a float64 reference, for every op and several dtypes, sizes no rank count divides;
the rows' size changing in the loop; a peer that changes its call under the shared rows
named on every rank."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from hororing import faults
from hororing.context import current
from changed_call import last_rank_changes_its_call
from reference import (all_inputs, assert_close, every_rank_on_one_node, rank_input,
                       reference_allreduce)

SINGLE = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="a mismatch needs two ranks")
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
DTYPES = ["float16", "float32", "float64", "int32", "uint8"]
LENGTH = 8209  # rows of 8 KiB and more in every dtype here; divides by none of 2, 3, 4, 5


def _fold():
    return current().engine.cycle._fold


@pytest.fixture(scope="module", autouse=True)
def fresh_engine():
    """Started afresh (an empty response cache: only cached names fold), and left as the
    session found it."""
    hvd.shutdown()
    hvd.init()
    yield
    hvd.shutdown()
    hvd.init()


def _run_every_case(calls=5):
    """Each op and dtype repeated until a call has folded on every rank, then ``calls`` more
    with new values: every result, in order, and for each case whether that fold's rows
    were shared. Whether a given call folds depends on the peers' timing (test_lane.py's
    ``_until_a_lane_is_taken``), so whether to go on is agreed outside the library."""
    results, shared = [], []
    current().engine.allreduce.force("small")  # the latency path at every size: each folds
    try:
        _cases(calls, results, shared)
    finally:
        current().engine.allreduce.force(None)
    return results, shared


def _cases(calls, results, shared):
    for dtype in DTYPES:
        for op in OPS:
            name = f"shared.{dtype}.{hvd.ops.op_name(op)}"
            buffer = rank_input(hvd.rank(), (LENGTH,), dtype, 0, op)

            def call():
                buffer[...] = rank_input(hvd.rank(), (LENGTH,), dtype, 0, op)
                hvd.allreduce_(buffer, name=name, op=op)
            shared.append(_until_folded(call) and _fold()._turns is not None)
            for seed in range(1, 1 + calls):
                buffer[...] = rank_input(hvd.rank(), (LENGTH,), dtype, seed, op)
                results.append((dtype, op, seed, hvd.allreduce_(buffer, name=name, op=op).copy()))


def _inline_hits():
    return current().engine.stats().get("inline_hits", 0)


def _until_folded(call, most=200):
    """``call()`` until a call has folded on every rank (at most ``most``); whether one did."""
    for _ in range(most):
        before = _inline_hits()
        call()
        if MPI.COMM_WORLD.allreduce(_inline_hits() > before, op=MPI.LAND):
            return True
    return False


def test_shared_rows_give_the_bits_of_gathered_rows():
    shared_results, shared_used = _run_every_case()
    hvd.shutdown()
    hvd.init(shared_fold=False)
    try:
        gathered_results, gathered_used = _run_every_case()
    finally:
        hvd.shutdown()
        hvd.init()
    folds = hvd.size() > 1  # one rank folds nothing: its single-rank cycle runs locally
    assert all(shared_used) == (folds and every_rank_on_one_node()), shared_used
    assert not any(gathered_used)
    for (dtype, op, seed, mine), (_, _, _, theirs) in zip(shared_results, gathered_results):
        assert mine.tobytes() == theirs.tobytes(), (dtype, hvd.ops.op_name(op), seed)
        expected = reference_allreduce(all_inputs(hvd.size(), (LENGTH,), dtype, seed, op), op,
                                       1.0, 1.0)
        assert_close(mine, expected)


def test_the_shared_rows_barriers_wait_on_flags_unless_a_dead_peer_is_recovered_from():
    """Folded shared rows pass their barriers on the window's flags (Python's steps and the
    compiled cycle alike), except under an MPI that recovers from a dead peer in process
    (ULFM), whose own barrier fails when one dies."""
    values = np.ones(LENGTH, np.float32)
    folded = _until_folded(lambda: hvd.allreduce_(values, name="shared.flags", op=hvd.Sum))
    if not (folded and _fold()._turns is not None):
        pytest.skip("no shared rows: one rank, or ranks on several nodes")
    lines = _fold()._exchange.window.flag_lines()
    assert (lines is not None) is not faults.supported()
    if lines is not None:  # every barrier entered, by each rank as often
        counts = MPI.COMM_WORLD.allgather(int(_fold()._exchange.window.all_entered()))
        assert all(counts), counts


@pytest.mark.parametrize("steps", ["wait", "off"])
def test_rows_below_8_kib_are_shared_where_every_rank_runs_the_compiled_cycle_on_flags(steps):
    """Rows below ``exchange.SHARED_ROWS_MIN`` meet in the node's shared memory too where
    every rank runs the compiled fold cycle and the rows' barrier waits on the window's
    flags; with Python's steps (or MPI's own barrier, under ULFM) they are gathered. The sum
    is exact either way."""
    from hororing.algorithms import compiled
    hvd.shutdown()
    hvd.init(compiled_steps=steps)
    try:
        values = np.arange(1001, dtype=np.float32) + hvd.rank()  # a row of about 4 KiB
        result = np.empty_like(values)

        def call():
            result[...] = values
            hvd.allreduce_(result, name=f"shared.small.{steps}", op=hvd.Sum)

        folded = _until_folded(call)
        expected = np.arange(values.size, dtype=np.float64) * hvd.size() \
            + sum(range(hvd.size()))
        np.testing.assert_array_equal(result, expected.astype(np.float32))
        if hvd.size() < 2:
            pytest.skip("one rank folds nothing: its cycles run locally")
        assert folded
        wanted = every_rank_on_one_node() and compiled.expected(steps) \
            and not faults.supported()
        assert (_fold()._turns is not None) == wanted, (steps, wanted)
    finally:
        hvd.shutdown()
        hvd.init()


@pytest.mark.parametrize("shared_fold", [True, False], ids=["shared_fold", "gathered_fold"])
def test_a_lone_call_of_the_shared_allreduces_sizes_folds_only_in_shared_rows(shared_fold):
    """A repeated 1 MiB call, which the shared allreduce takes on one node, folds in the
    node's shared rows; with the fold's rows gathered (HORORING_SHARED_FOLD=0) it does not
    fold (rows that wide would be an allgather of every rank's buffer) and goes the usual
    way. The sum is exact either way."""
    hvd.shutdown()
    hvd.init(shared_fold=shared_fold)
    try:
        values = np.arange(1 << 18, dtype=np.float32) + hvd.rank()
        result = np.empty_like(values)

        def call():
            result[...] = values
            hvd.allreduce_(result, name="shared.lone_wide", op=hvd.Sum)

        for _ in range(3):
            call()
        if current().engine.allreduce.kind_for(values.nbytes) != "shared":
            pytest.skip("the shared allreduce does not take 1 MiB here (one rank, or nodes)")
        folded = _until_folded(call, most=60)
        expected = np.arange(values.size, dtype=np.float64) * hvd.size() \
            + sum(range(hvd.size()))
        np.testing.assert_array_equal(result, expected.astype(np.float32))
        assert folded == shared_fold
    finally:
        hvd.shutdown()
        hvd.init()


def test_rows_go_in_chunks_from_the_size_the_ranks_per_core_set():
    """Rows of 64 KiB are reduced chunk by chunk where each rank has a core of its own
    (``fold.chunked_bytes``: from 32 KiB) and whole where ranks crowd the cores (from
    256 KiB); the sum is right either way."""
    from hororing.engine import fold
    hvd.shutdown()  # rows made for this size: an earlier test's may be wider (fold.py)
    hvd.init()
    values = np.arange(16 * 1024, dtype=np.float32) + hvd.rank()
    result = np.empty_like(values)

    def call():
        result[...] = values
        hvd.allreduce_(result, name="shared.chunked_from", op=hvd.Sum)

    if not (_until_folded(call) and _fold()._turns is not None):
        pytest.skip("no shared rows: one rank, or ranks on several nodes")
    contention = current().engine.allreduce.route.contention
    assert isinstance(_fold().gathered, fold._Chunked) == (contention <= 1.0), contention
    expected = np.arange(values.size, dtype=np.float64) * hvd.size() + sum(range(hvd.size()))
    np.testing.assert_array_equal(result, expected.astype(np.float32))


def test_rows_of_another_size_make_new_shared_rows_on_every_rank():
    """The loop moves from one size to another and back: where a size does not fit the
    rows they are made again, collectively, and the sums stay right."""
    for length in (LENGTH, 3 * LENGTH, 2048 + 1, LENGTH):
        values = np.arange(length, dtype=np.float32) + hvd.rank()
        for call in range(6):
            result = hvd.allreduce(values * (call + 1), name="shared.sizes", op=hvd.Sum)
            expected = (np.arange(length, dtype=np.float64) * hvd.size()
                        + sum(range(hvd.size()))) * (call + 1)
            assert_close(result, expected.astype(np.float32))


@SINGLE
@pytest.mark.timeout(120)
def test_wider_rows_are_made_in_the_cycle_every_rank_is_in():
    """A loop's lone call of a new width comes round again while the other ranks already
    wait on their next call, announced before it: the cycle after it is rank 0's alone to
    start (its news), and the others take part only once woken. The wider rows are made
    (collectively: a shared window freed and made) in the lone call's cycle, which every
    rank is in, not when rank 0 starts the next one, which would hold rank 0 in the
    window's barrier before it woke anyone (then only the blocked ranks' deadlock check,
    off here, would end the wait)."""
    hvd.shutdown()  # the fold's history from this loop alone
    hvd.init(deadlock_grace_seconds=0)
    try:
        _wider_rows_while_the_others_wait()
    finally:
        hvd.shutdown()
        hvd.init()


def _wider_rows_while_the_others_wait():
    narrow = np.arange(2049, dtype=np.float32) + hvd.rank()  # rows of 8 KiB and more
    wide = np.arange(LENGTH, dtype=np.float32) + hvd.rank()
    idle = np.full(3, hvd.rank() + 1.0)
    for _ in range(2):  # a loop of one size: rows of its width
        hvd.allreduce(narrow, name="shared.narrow", op=hvd.Sum)
    hvd.allreduce(wide, name="shared.wide", op=hvd.Sum)  # a new size: no fold yet
    if hvd.rank() == 0:
        result = hvd.allreduce(wide, name="shared.wide", op=hvd.Sum)  # comes round: wider rows
        made = _fold().bytes, _fold()._width
        time.sleep(0.3)  # the others wait on "shared.idle", announced
        later = hvd.allreduce(idle, name="shared.idle", op=hvd.Sum)
    else:
        idle_handle = hvd.allreduce_async(idle, name="shared.idle", op=hvd.Sum)
        wide_handle = hvd.allreduce_async(wide, name="shared.wide", op=hvd.Sum)
        result = hvd.synchronize(wide_handle)
        made = _fold().bytes, _fold()._width
        later = hvd.synchronize(idle_handle)
    expected = np.arange(LENGTH, dtype=np.float64) * hvd.size() + sum(range(hvd.size()))
    assert_close(result, expected.astype(np.float32))
    np.testing.assert_array_equal(later, np.full(3, hvd.size() * (hvd.size() + 1) / 2))
    # the next cycle folds in rows as wide as the wide call, made with that call's cycle
    # (16: the rows' fields)
    assert made[0] is not None and made[0] >= wide.nbytes and made[1] == 16 + made[0], made


@SINGLE
@pytest.mark.parametrize("change", ["op", "shape", "dtype"])
def test_a_peer_that_changes_its_call_under_shared_rows_fails_every_rank_by_name(change):
    name = f"shared.mismatch.{change}"
    values = np.ones(LENGTH, dtype=np.float32)
    current().engine.allreduce.force("small")
    try:
        assert _until_folded(lambda: hvd.allreduce_(values.copy(), name=name, op=hvd.Sum))
        assert (_fold()._turns is not None) == every_rank_on_one_node()
        last_rank_changes_its_call(name, values, change)
    finally:
        current().engine.allreduce.force(None)
