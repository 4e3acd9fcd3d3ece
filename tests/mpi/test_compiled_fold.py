"""A lane's fold cycle run as one compiled call (engine/compiled_fold.py) against Python's
steps: the same bits for every dtype it takes and every op, NaNs and signed zeros included,
in place and out of place; ranks running the two kinds of cycle in one exchange; a late peer
waited for in the sleeping phase; calls it does not take (a prescale, 16-bit floats, which
travel widened to float32) run Python's steps. Every result is checked against the float64
reference too."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from hororing import transport
from hororing.algorithms import compiled
from hororing.context import current
from changed_call import last_rank_changes_its_call
from reference import all_inputs, assert_close, reference_allreduce

pytest.importorskip("numba")

# neither divides by 2, 3, 4 or 5: rows below 8 KiB, gathered across nodes, where the rows'
# barrier is MPI's or in Python's steps, and in the node's shared memory otherwise; rows of
# 9 KiB and more in the node's shared memory wherever every rank is on one node
# (exchange.SharedRows)
LENGTH, LONG = 1001, 9001
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int32", "int64", "uint8",
          "uint64")
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
# travel as float32 (``allreduce.wire_dtype``): the rows are not the tensor's dtype, and
# the compiled cycle leaves them to Python's steps
WIDENED = ("float16", "bfloat16")
SINGLE = MPI.COMM_WORLD.Get_size() < 2


@pytest.fixture(scope="module", autouse=True)
def fresh_cache():
    """A long session fills the response cache; only cached names fold."""
    hvd.shutdown()
    hvd.init()


@pytest.fixture(autouse=True)
def long_rows_on_one_node(request):
    """LONG rows are the node's shared rows: where the job spans nodes (MPICH's cliques) they
    are gathered instead, and at 8-byte dtypes and 4 ranks the route does not fold them at all
    (so no cycle would run compiled)."""
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("length") == LONG \
            and hvd.local_size() != hvd.size():
        pytest.skip("rows this long are shared rows, and this job spans nodes")


@pytest.fixture(autouse=True)
def mode_restored():
    before = compiled.mode()
    yield
    compiled.configure(before)


def _compiled_folds():
    return current().engine.stats()["compiled_folds"]


def _inputs(dtype, seed, op, special=False, length=LENGTH):
    """Every rank's input; ``special``: NaNs and signed zeros among the floats."""
    if dtype == "bfloat16":
        inputs = all_inputs(hvd.size(), (length,), "float32", seed, op)
        inputs = [array.astype(hvd.ops.BFLOAT16) for array in inputs]
    else:
        inputs = all_inputs(hvd.size(), (length,), dtype, seed, op)
    if special and inputs[0].dtype.kind in "fV":
        for rank, array in enumerate(inputs):
            array[rank::7] = np.nan
            array[3::11] = -0.0 if rank % 2 else 0.0
    return inputs


def _repeat(mode, name, inputs, op, calls=6, out_of_place=False, until_compiled=False,
            **factors):
    """``calls`` blocking allreduces of this rank's input under ``name`` with ``mode``'s
    steps; the last result, and how many cycles ran compiled on this rank. ``until_compiled``:
    go on (up to 200 calls) until a call ran compiled on every rank in "wait" mode, and give
    that call's result: whether a given call takes its lane depends on the peers' timing
    (``test_lane.py``), and every rank makes the same calls, agreed outside the library."""
    compiled.configure(mode)
    mine = inputs[hvd.rank()]
    before = _compiled_folds()
    for call in range(200 if until_compiled else calls):
        ran_before = _compiled_folds()
        if out_of_place:
            result = hvd.allreduce(mine, name=name, op=op, **factors)
        else:
            result = mine.copy()
            hvd.allreduce_(result, name=name, op=op, **factors)
        if until_compiled and call >= calls - 1:
            this = _compiled_folds() > ran_before or mode != "wait"
            if MPI.COMM_WORLD.allreduce(this, op=MPI.LAND):
                break
    else:
        assert not until_compiled, f"after 200 calls some rank had not run the compiled cycle"
    return result, _compiled_folds() - before


def _same_bits_everywhere(result):
    gathered = MPI.COMM_WORLD.allgather(result.tobytes())
    assert all(value == gathered[0] for value in gathered)


@pytest.mark.parametrize("length", [LENGTH, LONG])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS, ids=lambda op: hvd.ops.op_name(op))
def test_the_compiled_cycle_gives_the_bits_of_pythons_steps(dtype, op, length):
    name = f"cfold.{dtype}.{hvd.ops.op_name(op)}.{length}"
    inputs = _inputs(dtype, 1, op, length=length)
    python, ran = _repeat("off", name, inputs, op)
    assert ran == 0
    native, ran = _repeat("wait", name, inputs, op, until_compiled=dtype not in WIDENED)
    if dtype in WIDENED:
        assert ran == 0
    else:
        assert ran > 0
    assert native.tobytes() == python.tobytes()
    _same_bits_everywhere(native)
    if dtype != "bfloat16":
        assert_close(native, reference_allreduce(inputs, op))


@pytest.mark.parametrize("length", [LENGTH, LONG])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Min, hvd.Max, hvd.Product], ids=lambda op: hvd.ops.op_name(op))
def test_nans_and_signed_zeros_come_out_as_pythons_steps_give_them(dtype, op, length):
    name = f"cfold.special.{dtype}.{hvd.ops.op_name(op)}.{length}"
    inputs = _inputs(dtype, 2, op, special=True, length=length)
    python, _ = _repeat("off", name, inputs, op)
    native, ran = _repeat("wait", name, inputs, op, until_compiled=True)
    assert ran > 0
    assert native.tobytes() == python.tobytes()


def test_an_out_of_place_call_runs_compiled_into_a_new_result():
    inputs = _inputs("float32", 3, hvd.Sum)
    python, _ = _repeat("off", "cfold.new", inputs, hvd.Sum, out_of_place=True)
    native, ran = _repeat("wait", "cfold.new", inputs, hvd.Sum, out_of_place=True,
                          until_compiled=True)
    assert ran > 0
    assert native is not inputs[hvd.rank()]
    np.testing.assert_array_equal(inputs[hvd.rank()], _inputs("float32", 3, hvd.Sum)[hvd.rank()])
    assert native.tobytes() == python.tobytes()
    assert_close(native, reference_allreduce(inputs, hvd.Sum))


@pytest.mark.parametrize("length", [LENGTH, LONG])
def test_ranks_running_compiled_and_python_cycles_share_one_exchange(length):
    inputs = _inputs("float32", 4, hvd.Sum, length=length)
    name = f"cfold.mixed.{length}"
    python, _ = _repeat("off", name, inputs, hvd.Sum)
    mode = "wait" if hvd.rank() % 2 == 0 else "off"
    mixed, ran = _repeat(mode, name, inputs, hvd.Sum, until_compiled=True)
    assert (ran > 0) == (mode == "wait")
    assert mixed.tobytes() == python.tobytes()
    _same_bits_everywhere(mixed)


def test_a_prescaled_call_runs_pythons_steps_with_the_same_result():
    inputs = _inputs("float32", 5, hvd.Sum)
    python, _ = _repeat("off", "cfold.scaled", inputs, hvd.Sum, prescale_factor=0.5)
    native, ran = _repeat("wait", "cfold.scaled", inputs, hvd.Sum, prescale_factor=0.5)
    assert ran == 0
    assert native.tobytes() == python.tobytes()
    assert_close(native, reference_allreduce(inputs, hvd.Sum, prescale=0.5))


CHUNKS = 9007  # shared rows reduced chunk by chunk under ``chunks``: a length no other test has


@pytest.fixture
def chunks(monkeypatch):
    """Shared rows of 8 KiB and more reduced chunk by chunk (fold._Chunked; the default:
    32 KiB and more where each rank has a core, 256 KiB where ranks crowd the cores);
    skipped where there are no shared rows (one rank gathers its own; a job across nodes)."""
    if SINGLE or hvd.local_size() != hvd.size():
        pytest.skip("rows reduced chunk by chunk are shared rows: one node, two ranks or more")
    from hororing.engine import fold
    monkeypatch.setattr(fold, "CHUNKED_BYTES", 8 * 1024)
    monkeypatch.setattr(fold, "CROWDED_CHUNKED_BYTES", 8 * 1024)
    # a fresh engine: rows an earlier test made (as wide as its widest call, so wide enough
    # for this test's) are whole or in chunks as the thresholds were when they were made
    hvd.shutdown()
    hvd.init()
    yield
    hvd.shutdown()  # and none of this test's chunked rows left for the next
    hvd.init()


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "uint8"])
@pytest.mark.parametrize("op", OPS, ids=lambda op: hvd.ops.op_name(op))
def test_rows_reduced_chunk_by_chunk_run_compiled_with_the_bits_of_pythons_steps(
        dtype, op, chunks):
    """Each rank reduces its chunk of every row into the shared result, a second barrier,
    the result copied out: compiled, the same bits as Python's steps. An integer Average,
    whose division the compiled cycle leaves to Python, has Python finalize this rank's chunk
    in the middle of the cycle, before the others copy it."""
    from hororing.engine.fold import _Chunked
    name = f"cfold.chunks.{dtype}.{hvd.ops.op_name(op)}"
    inputs = _inputs(dtype, 7, op, length=CHUNKS)
    python, ran = _repeat("off", name, inputs, op)
    assert ran == 0
    assert isinstance(current().engine.cycle._fold.gathered, _Chunked)
    native, ran = _repeat("wait", name, inputs, op, until_compiled=True)
    assert ran > 0
    assert native.tobytes() == python.tobytes()
    _same_bits_everywhere(native)
    assert_close(native, reference_allreduce(inputs, op))


@pytest.mark.parametrize("out_of_place", [False, True], ids=["in_place", "out_of_place"])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average], ids=["sum", "average"])
def test_each_call_reduces_its_own_data_chunk_by_chunk(op, dtype, out_of_place, chunks):
    """New data every call: a rank's own chunk, which no other rank reads, is reduced from
    where its input lies (the compiled cycle leaves it out of its row) and goes into the
    output as it is reduced (the others' chunks are copied from the shared result), so
    neither a row nor an output holding an earlier call's data reaches the result."""
    name = f"cfold.chunks.fresh.{dtype}.{hvd.ops.op_name(op)}.{out_of_place}"
    calls = [_inputs(dtype, 100 + call, op, length=CHUNKS) for call in range(12)]
    results = {}
    for mode in ("off", "wait"):
        compiled.configure(mode)
        before = _compiled_folds()
        results[mode] = []
        for inputs in calls:
            if out_of_place:
                result = hvd.allreduce(inputs[hvd.rank()], name=name, op=op)
            else:
                result = inputs[hvd.rank()].copy()
                hvd.allreduce_(result, name=name, op=op)
            results[mode].append(result.copy())
        ran = _compiled_folds() - before
        assert (ran > 0) == (mode == "wait")
    for inputs, python, native in zip(calls, results["off"], results["wait"]):
        assert native.tobytes() == python.tobytes()
        assert_close(native, reference_allreduce(inputs, op))


@pytest.mark.skipif(SINGLE, reason="the fold's rows change plans between ranks' calls")
@pytest.mark.parametrize("rows", ["whole", "chunked"])
def test_tensors_reduced_in_turn_each_run_their_own_plan(rows, request):
    """A loop reducing a few tensors of one size in bytes in turn (a loss and its metrics)
    changes the compiled cycle's plan every call: its op, dtype, divisor and chunk, each
    plan's fields kept from its first call. New data every round: each result is its own
    call's, with the bits of Python's steps."""
    length = LENGTH  # the float64 tensor's; the 4-byte ones have twice as many values
    if rows == "chunked":
        request.getfixturevalue("chunks")
        length = CHUNKS
    kinds = [("float32", hvd.Sum, 2 * length), ("int32", hvd.Average, 2 * length),
             ("float32", hvd.Average, 2 * length), ("float64", hvd.Max, length)]
    rounds = [[_inputs(dtype, 300 + 10 * round_ + index, op, length=count)
               for index, (dtype, op, count) in enumerate(kinds)] for round_ in range(8)]
    results = {}
    for mode in ("off", "wait"):
        compiled.configure(mode)
        before = _compiled_folds()
        results[mode] = []
        for inputs in rounds:
            for index, ((dtype, op, _), every) in enumerate(zip(kinds, inputs)):
                result = every[hvd.rank()].copy()
                hvd.allreduce_(result, name=f"cfold.turns.{rows}.{index}", op=op)
                results[mode].append(result)
        assert (_compiled_folds() > before) == (mode == "wait")
    calls = [(op, every) for inputs in rounds for (_, op, _), every in zip(kinds, inputs)]
    for (op, every), python, native in zip(calls, results["off"], results["wait"]):
        assert native.tobytes() == python.tobytes()
        assert_close(native, reference_allreduce(every, op))


# the widest tensor of each kind of rows: below 8 KiB (gathered, or shared as above), shared
# (whole), in chunks
WIDEST = {"gathered": ("float64", LENGTH), "shared": ("float32", 2251),
          "chunked": ("float64", CHUNKS)}


@pytest.mark.skipif(SINGLE, reason="one rank folds nothing: its cycles run locally")
@pytest.mark.parametrize("rows", list(WIDEST))
def test_tensors_of_different_sizes_in_turn_fold_in_rows_of_the_widest(rows, request):
    """A loop reducing tensors of different sizes and dtypes in turn (a scalar loss, a few
    metrics, a longer vector) folds each of them in rows as wide as the widest, its data the
    first bytes of its row: each name learns its lane on every rank where every rank is on
    one node (across nodes a narrower call folds only within ``fold.MIXED_EXTRA_BYTES``).
    New data every round: each result is its own call's, with the bits of Python's steps."""
    if rows == "chunked":
        request.getfixturevalue("chunks")
    elif rows == "shared" and hvd.local_size() != hvd.size():
        pytest.skip("shared rows: every rank on one node")
    dtype, length = WIDEST[rows]
    kinds = [("float32", hvd.Sum, 1), (dtype, hvd.Average, length), ("int32", hvd.Max, 333),
             ("uint8", hvd.Min, 7)]
    names = [f"cfold.sizes.{rows}.{index}" for index in range(len(kinds))]
    rounds = [[_inputs(kind, 500 + 10 * round_ + index, op, length=count)
               for index, (kind, op, count) in enumerate(kinds)] for round_ in range(6)]

    def run(inputs):
        results = []
        for name, (_, op, _), every in zip(names, kinds, inputs):
            result = every[hvd.rank()].copy()
            hvd.allreduce_(result, name=name, op=op)
            results.append(result)
        return results
    results = {}
    for mode in ("off", "wait"):
        compiled.configure(mode)
        before = _compiled_folds()
        results[mode] = [result for inputs in rounds for result in run(inputs)]
        if hvd.local_size() == hvd.size():
            assert (_compiled_folds() > before) == (mode == "wait")
    calls = [(op, every) for inputs in rounds for (_, op, _), every in zip(kinds, inputs)]
    for (op, every), python, native in zip(calls, results["off"], results["wait"]):
        assert native.tobytes() == python.tobytes()
        assert_close(native, reference_allreduce(every, op))
    if hvd.local_size() == hvd.size():
        for _ in range(200):  # a call folds unless a peer's cycle started before its caller
            if MPI.COMM_WORLD.allreduce(all(name in current().engine.lanes for name in names),
                                        op=MPI.LAND):
                break
            run(rounds[-1])
        else:
            raise AssertionError("after 200 rounds some tensor never folded on some rank")


@pytest.mark.parametrize("out_of_place", [False, True], ids=["in_place", "out_of_place"])
@pytest.mark.parametrize("op,dtype", [(hvd.Sum, "float32"), (hvd.Average, "float32"),
                                      (hvd.Average, "int32")],
                         ids=["sum-float32", "average-float32", "average-int32"])
def test_ranks_running_compiled_and_python_chunks_share_one_result(op, dtype, out_of_place,
                                                                   chunks):
    """Ranks running the compiled cycle and ranks running Python's steps each reduce their
    chunk into the one shared result: the same barriers, the chunks finalized alike (an
    integer Average by Python on either kind of rank, before the others copy the chunk)."""
    inputs = _inputs(dtype, 8, op, length=CHUNKS)
    name = f"cfold.chunks.mixed.{dtype}.{hvd.ops.op_name(op)}.{out_of_place}"
    python, _ = _repeat("off", name, inputs, op, out_of_place=out_of_place)
    mode = "wait" if hvd.rank() % 2 == 0 else "off"
    mixed, ran = _repeat(mode, name, inputs, op, out_of_place=out_of_place,
                         until_compiled=True)
    assert (ran > 0) == (mode == "wait")
    assert mixed.tobytes() == python.tobytes()
    _same_bits_everywhere(mixed)
    assert_close(mixed, reference_allreduce(inputs, op))


@pytest.mark.skipif(SINGLE, reason="a mismatch needs two ranks")
@pytest.mark.parametrize("length", [LENGTH, LONG])
@pytest.mark.parametrize("change", ["op", "shape", "dtype"])
def test_a_peer_that_changes_its_call_fails_every_rank_by_name(change, length):
    """The others' compiled cycle finds the last rank's fields differ: the cycle goes on
    to the vote, which names the mismatch on every rank; the job goes on."""
    name = f"cfold.mismatch.{change}.{length}"
    values = np.ones(length, dtype=np.float32)
    _repeat("wait", name, [values] * hvd.size(), hvd.Sum, until_compiled=True)
    last_rank_changes_its_call(name, values, change)


@pytest.mark.skipif(SINGLE, reason="a late peer needs two ranks")
@pytest.mark.parametrize("length", [LENGTH, LONG])
def test_a_late_peer_is_waited_for_in_the_sleeping_phase(length):
    inputs = _inputs("float64", 6, hvd.Sum, length=length)
    name = f"cfold.late.{length}"
    python, _ = _repeat("off", name, inputs, hvd.Sum)
    _repeat("wait", name, inputs, hvd.Sum, until_compiled=True)  # its lane, compiled
    before = transport.backoff()
    transport.set_backoff(0, 0, 0.001)  # every wait not done at its first test sleeps
    try:
        for _ in range(5):  # until the late call ran compiled on every rank (timing)
            if hvd.rank() == hvd.size() - 1:
                time.sleep(0.2)  # the others wait for this rank
            native, ran = _repeat("wait", name, inputs, hvd.Sum, calls=1)
            assert native.tobytes() == python.tobytes()
            if MPI.COMM_WORLD.allreduce(ran == 1, op=MPI.LAND):
                break
        else:
            raise AssertionError("in 5 tries a late call did not run compiled on every rank")
    finally:
        transport.set_backoff(*before)
    assert_close(native, reference_allreduce(inputs, hvd.Sum))


@pytest.mark.skipif(SINGLE, reason="one rank exchanges no rows")
@pytest.mark.parametrize("length", [LENGTH, LONG])
def test_the_spin_lasts_as_long_as_pythons_and_the_wake_up_comes_as_late_for_each_kind_of_rows(
        length):
    """A compiled test of the node's shared memory costs a fraction of Python's, so the
    compiled cycle spins that many times the tests; one across nodes costs what Python's
    does (the network's progress), so it spins Python's count there and then yields the
    core. Either way the peers are woken after as many tests as on the node, before the
    sleep; where the node's ranks outnumber its cores (the back-off's ``wake_late``), at
    the last test before the sleep. The multiples are the ones for where the rows go, as MPI
    places the ranks."""
    from hororing.algorithms.compiled.codes import F_LINES, F_SPIN, F_WAKE, F_YIELD
    from hororing.engine import compiled_fold
    from reference import every_rank_on_one_node

    inputs = _inputs("float32", 8, hvd.Sum, length=length)
    _repeat("wait", f"cfold.spin.{length}", inputs, hvd.Sum, until_compiled=True)
    fields = current().engine.cycle._fold._compiled.fields
    spin_tests, yield_tests, _, wake_late = transport.backoff()
    wake = compiled_fold.SPIN_SCALE
    if not every_rank_on_one_node():
        spin = compiled_fold.NETWORK_SPIN_SCALE
    elif fields[F_LINES] != 0:  # the node's shared rows, whose barrier waits on flags
        spin = wake = compiled_fold.FLAG_SPIN_SCALE
    else:
        spin = compiled_fold.SPIN_SCALE
    assert fields[F_SPIN] == spin_tests * spin
    assert fields[F_YIELD] == yield_tests - spin_tests + spin_tests * spin
    assert wake_late == (current().local_size > current().node_cores)
    if wake_late:
        assert fields[F_WAKE] == fields[F_YIELD]
    else:
        assert fields[F_WAKE] == spin_tests * wake <= fields[F_YIELD]
