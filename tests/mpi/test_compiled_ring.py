"""The ring's compiled steps (algorithms/compiled/) against its Python steps, run directly on
every rank: the same bits for every dtype they take and every op, in place, out of place,
with a finalizer, as a reduce-scatter; both against the float64 references; ranks running
the two kinds of step in one ring; and waits long enough to sleep in."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from hororing import transport
from hororing.algorithms import compiled
from hororing.algorithms.plan import chunk_bounds
from hororing.algorithms.ring import Ring
from reference import all_inputs, assert_close, reference_allreduce

pytest.importorskip("numba")

SUB = 64  # bytes a piece holds: several pieces per chunk, pieces that do not divide a chunk
DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
          "uint16", "uint32", "uint64")
OPS = {"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}


@pytest.fixture
def comm():
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Barrier()
    comm.Free()


@pytest.fixture(autouse=True)
def mode_restored():
    before = compiled._Loader.mode
    yield
    compiled.configure(before)


def run(comm, mode, inputs, op, in_place=True, finalize=None, subchunk=SUB):
    """One ring allreduce of this rank's input with ``mode``'s steps; the result, and
    whether the compiled steps ran."""
    compiled.configure(mode)
    ring = Ring(comm, subchunk)
    rank = comm.Get_rank()
    if in_place:
        buffer = inputs[rank].copy()
        ring.allreduce(buffer, op, finalize)
    else:
        source = inputs[rank].copy()
        buffer = np.empty_like(source)
        ring.allreduce(buffer, op, finalize, source=source)
        np.testing.assert_array_equal(source, inputs[rank])  # the input is only read
    return buffer, ring._native is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(OPS))
def test_compiled_and_python_steps_give_the_same_bits(comm, dtype, op):
    size = comm.Get_size()
    for length in (1, 7, 61, 1000, 10_007):
        inputs = all_inputs(size, (length,), dtype, seed=length, op=OPS[op])
        for in_place in (True, False):
            python, ran = run(comm, "off", inputs, op, in_place)
            assert not ran
            native, ran = run(comm, "wait", inputs, op, in_place)
            assert ran == (size > 1)
            np.testing.assert_array_equal(native.view(np.uint8), python.view(np.uint8))
            expected = reference_allreduce(inputs, OPS[op])
            if np.dtype(dtype).kind == "f":
                assert_close(native, expected)
            elif op != "sum" and op != "product":  # integer sums and products may wrap
                np.testing.assert_array_equal(native, expected)


@pytest.mark.parametrize("op", ["min", "max"])
def test_nans_and_signed_zeros_come_out_as_numpys(comm, op):
    size, rank = comm.Get_size(), comm.Get_rank()
    pool = np.array([np.nan, 0.0, -0.0, 1.0, -1.0, np.inf, -np.inf], dtype=np.float32)
    inputs = [np.random.default_rng([9, r]).choice(pool, 1003) for r in range(size)]
    python, _ = run(comm, "off", inputs, op)
    native, _ = run(comm, "wait", inputs, op)
    np.testing.assert_array_equal(native.view(np.uint32), python.view(np.uint32))
    assert rank >= 0


def test_a_finalizer_is_applied_to_each_owned_piece_once(comm):
    size = comm.Get_size()
    inputs = all_inputs(size, (4099,), "float32", seed=3)
    seen = []

    def finalize(piece):  # Average's division, and a record of each call
        seen.append(piece.size)
        np.divide(piece, size, out=piece)
    python, _ = run(comm, "off", inputs, "sum", finalize=finalize)
    python_pieces, seen[:] = list(seen), []
    native, _ = run(comm, "wait", inputs, "sum", in_place=False, finalize=finalize)
    np.testing.assert_array_equal(native.view(np.uint32), python.view(np.uint32))
    assert seen == python_pieces  # the same pieces, in the same order
    assert sum(seen) == chunk_bounds(4099, size)[comm.Get_rank()][1] - \
        chunk_bounds(4099, size)[comm.Get_rank()][0]
    assert_close(native, reference_allreduce(inputs, hvd.Average))


def test_a_reducescatter_with_compiled_steps_matches_the_python_one(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = all_inputs(size, (3001,), "float64", seed=4)
    bounds = chunk_bounds(3001, size)
    results = {}
    for mode in ("off", "wait"):
        compiled.configure(mode)
        buffer = inputs[rank].copy()
        Ring(comm, SUB).reducescatter(buffer, "sum", bounds)
        start, stop = bounds[rank]
        results[mode] = buffer[start:stop]
    np.testing.assert_array_equal(results["wait"], results["off"])
    start, stop = bounds[rank]
    assert_close(results["wait"], reference_allreduce(inputs, hvd.Sum)[start:stop])


def test_ranks_running_compiled_and_python_steps_share_one_ring(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = all_inputs(size, (5003,), "float32", seed=6)
    python, _ = run(comm, "off", inputs, "sum")
    mixed, ran = run(comm, "wait" if rank % 2 == 0 else "off", inputs, "sum")
    assert ran == (size > 1 and rank % 2 == 0)
    np.testing.assert_array_equal(mixed.view(np.uint32), python.view(np.uint32))


def test_a_late_peer_is_waited_for_in_the_sleeping_phase(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = all_inputs(size, (2000,), "float32", seed=8)
    python, _ = run(comm, "off", inputs, "sum")
    before = (transport._Backoff.spin_tests, transport._Backoff.yield_tests,
              transport._Backoff.max_sleep_s)
    transport.set_backoff(0, 0, 0.001)  # every wait not done at its first test sleeps
    try:
        if rank == size - 1:
            time.sleep(0.2)  # the others wait for this rank
        native, ran = run(comm, "wait", inputs, "sum")
    finally:
        transport.set_backoff(*before)
    assert ran == (size > 1)
    np.testing.assert_array_equal(native.view(np.uint32), python.view(np.uint32))


def test_a_read_only_input_and_large_pieces_run_compiled(comm):
    size = comm.Get_size()
    inputs = all_inputs(size, (300_001,), "float32", seed=10)
    for array in inputs:
        array.flags.writeable = False
    python, _ = run(comm, "off", inputs, "sum", in_place=False, subchunk=1 << 20)
    native, ran = run(comm, "wait", inputs, "sum", in_place=False, subchunk=1 << 20)
    assert ran == (size > 1)
    np.testing.assert_array_equal(native.view(np.uint32), python.view(np.uint32))


def test_dtypes_the_compiled_steps_do_not_take_run_in_python(comm):
    size = comm.Get_size()
    for dtype in ("bool", "complex64"):
        inputs = [np.ones(100, dtype=dtype) for _ in range(size)]
        result, ran = run(comm, "wait", inputs, "sum")
        assert not ran
        assert result.dtype == np.dtype(dtype)


def test_status_says_which_steps_run(comm):
    size = comm.Get_size()
    compiled.configure("off")
    assert compiled.status() == "python (off)"
    run(comm, "wait", [np.ones(1000, dtype=np.float32)] * size, "sum")
    assert compiled.status() == ("compiled" if size > 1 else compiled.status())


@pytest.mark.parametrize("op", ["sum", "max"])
def test_a_segmented_buffer_runs_compiled_with_the_same_bits(comm, op):
    from hororing.algorithms.segmented import Segmented
    size, rank = comm.Get_size(), comm.Get_rank()
    lengths = (37, 1001, 3, 2500, 611)  # pieces are cut where the arrays meet
    inputs = all_inputs(size, (sum(lengths),), "float32", seed=12)
    results = {}
    for mode in ("off", "wait"):
        compiled.configure(mode)
        ring = Ring(comm, SUB)
        flat = inputs[rank].copy()
        parts = np.split(flat, np.cumsum(lengths)[:-1])
        buffer = Segmented([part.copy() for part in parts])
        seen = []

        def finalize(piece):
            seen.append(piece.size)
            np.multiply(piece, 0.5, out=piece)
        ring.allreduce(buffer, op, finalize)
        results[mode] = (np.concatenate(buffer.parts), seen, ring._native is not None)
    (python, python_seen, python_ran), (native, native_seen, native_ran) = \
        results["off"], results["wait"]
    assert not python_ran and native_ran == (size > 1)
    np.testing.assert_array_equal(native.view(np.uint32), python.view(np.uint32))
    assert native_seen == python_seen
    assert_close(native, reference_allreduce(inputs, OPS[op]) * 0.5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_16_bit_floats_reduce_as_numpys_loops(op, dtype):
    """Every float16 or bfloat16 bit pattern (against four permutations of them) through the
    compiled reduction and numpy's ufunc (ml_dtypes' loops for bfloat16), NaNs, infinities
    and subnormals included: the same bits."""
    import numba
    from hororing.algorithms.compiled import native
    from hororing.ops import BFLOAT16

    @numba.njit
    def reduce_bits(into, values, code, half):
        if half == 1:
            native._reduce_half(into, values, code)
        else:
            native._reduce_bfloat16(into, values, code)
    kind = np.dtype(np.float16) if dtype == "float16" else BFLOAT16
    assert compiled.admitted(kind)
    rng = np.random.default_rng(13)
    first = np.arange(1 << 16, dtype=np.uint16)
    ufunc = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}[op]
    for _ in range(4):
        second = rng.permutation(first)
        expected = first.view(kind).copy()
        with np.errstate(all="ignore"):
            ufunc(expected, second.view(kind), out=expected)
        got = first.copy()
        reduce_bits(got, second, compiled.codes.OPS[op], compiled.HALVES[kind])
        np.testing.assert_array_equal(got, expected.view(np.uint16))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_floats_with_nans_run_compiled_with_the_python_steps_bits(comm, dtype):
    """Random 16-bit bit patterns through the ring both ways: the same bits, except a NaN's
    payload and sign where the Python steps add through torch (its kernels pick those their
    own way; numpy's and ml_dtypes', which the compiled steps follow, the other)."""
    from hororing.ops import BFLOAT16
    kind = np.dtype(np.float16) if dtype == "float16" else BFLOAT16
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [np.random.default_rng([14, r]).integers(0, 1 << 16, 4099, dtype=np.uint16)
              .view(kind) for r in range(size)]
    for op in sorted(OPS):
        with np.errstate(all="ignore"):
            python, _ = run(comm, "off", inputs, op)
            native, ran = run(comm, "wait", inputs, op)
        assert ran == (size > 1)
        python_nan = np.isnan(python.astype(np.float32))
        native_nan = np.isnan(native.astype(np.float32))
        np.testing.assert_array_equal(python_nan, native_nan)
        both_nan = python_nan & native_nan
        np.testing.assert_array_equal(native.view(np.uint16)[~both_nan],
                                      python.view(np.uint16)[~both_nan])
    assert rank >= 0
