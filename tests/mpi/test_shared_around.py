"""The shared allreduce's segments that go around the node (algorithms/shared.py,
``_segment_around``): each rank combines its input into one row where it lies, chunk c in
the order of the ranks from c round to c - 1. The algorithm alone on its own communicator,
against a reduction in that order computed here from every rank's input: the same bits for
every op and several dtypes, sizes no rank count divides, segments that go around beside
ones that do not in one call, in place and out of place, its barriers MPI's or the window's
flags, ranks arriving late; and the job's rule for which segments go around."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from hororing.algorithms import cost
from hororing.algorithms.shared import SharedMemory
from hororing.context import current
from reference import (all_inputs, assert_close, assert_identical_on_every_rank,
                       every_rank_on_one_node, reference_allreduce)

OPS = {"sum": (np.add, hvd.Sum), "min": (np.minimum, hvd.Min), "max": (np.maximum, hvd.Max),
       "product": (np.multiply, hvd.Product)}
DTYPES = ["float16", "float32", "float64", "int32", "uint8"]
SEGMENT_BYTES = 4096
AROUND_ABOVE = 256  # bytes: a segment part of more goes around
NEEDS_SHARED = pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() < 2 or not every_rank_on_one_node(),
    reason="the ranks do not all share one node (or there is one rank)")


def split(count, parts):
    """``count`` items in ``parts`` contiguous ranges, the first ``count % parts`` one longer."""
    sizes = [count // parts + (1 if index < count % parts else 0) for index in range(parts)]
    edges = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return list(zip(edges[:-1], edges[1:]))


def expected_bits(inputs, ufunc, around_above, segment_bytes):
    """Every segment combined as the algorithm's contract says: around the node where its bytes
    are more than ``around_above`` (chunk c from rank c round), else in rank order."""
    size = len(inputs)
    itemsize = inputs[0].dtype.itemsize
    step = segment_bytes // itemsize
    result = np.empty_like(inputs[0])
    for start in range(0, result.size, step):
        stop = min(result.size, start + step)
        if (stop - start) * itemsize > around_above:
            for chunk, (low, high) in enumerate(split(stop - start, size)):
                low, high = start + low, start + high
                value = inputs[chunk][low:high].copy()
                for turn in range(1, size):
                    value = ufunc(value, inputs[(chunk + turn) % size][low:high])
                result[low:high] = value
        else:
            value = inputs[0][start:stop].copy()
            for rank in range(1, size):
                value = ufunc(value, inputs[rank][start:stop])
            result[start:stop] = value
    return result


@NEEDS_SHARED
@pytest.mark.parametrize("flags", [False, True], ids=["mpi-barrier", "flag-barrier"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bits_of_a_reduction_around_the_node(dtype, flags):
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=hvd.rank())
    algorithm = SharedMemory(node, segment_bytes=SEGMENT_BYTES, flags=flags,
                             around_above=lambda: AROUND_ABOVE)
    itemsize = np.dtype(dtype).itemsize
    step = SEGMENT_BYTES // itemsize
    # one element (rank order), whole segments around, a short last part in rank order, and
    # a last part just long enough to go around
    lengths = [1, 3 * step + 1, 2 * step + AROUND_ABOVE // itemsize + 1, step + 7]
    random = np.random.default_rng(hvd.rank())
    try:
        for length in lengths:
            for seed, (name, (ufunc, op)) in enumerate(OPS.items()):
                inputs = all_inputs(hvd.size(), (length,), dtype, seed + length, op)
                expected = expected_bits(inputs, ufunc, AROUND_ABOVE, SEGMENT_BYTES)
                if random.random() < 0.3:  # ranks arrive late
                    time.sleep(random.random() * 2e-3)
                in_place = inputs[hvd.rank()].copy()
                algorithm.allreduce(in_place, name)
                source = inputs[hvd.rank()].copy()
                out = np.zeros(length, dtype)
                algorithm.allreduce(out, name, source=source)
                assert np.array_equal(source, inputs[hvd.rank()])  # the input untouched
                for result in (in_place, out):
                    assert result.tobytes() == expected.tobytes(), (length, name)
                    assert_close(result, reference_allreduce(inputs, op))
                    assert_identical_on_every_rank(result)
    finally:
        algorithm.free()


@NEEDS_SHARED
@pytest.mark.parametrize("flags", [False, True], ids=["mpi-barrier", "flag-barrier"])
def test_a_finalizer_applied_once_where_the_last_rank_combines(flags):
    """A finalizer (Average's, postscale's; here times two) runs once on every element, around
    the node or not, and consecutive calls, taking the two rows in turn, give the same bits."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=hvd.rank())
    algorithm = SharedMemory(node, segment_bytes=SEGMENT_BYTES, flags=flags,
                             around_above=lambda: AROUND_ABOVE)
    try:
        for length in (5, 1000, 3001):
            inputs = all_inputs(hvd.size(), (length,), "float64", length)

            def finalize(piece):
                piece *= 2.0
            results = []
            for _ in range(3):  # consecutive calls take the two rows in turn
                buffer = inputs[hvd.rank()].copy()
                algorithm.allreduce(buffer, "sum", finalize=finalize)
                results.append(buffer)
            expected = np.sum(inputs, axis=0) * 2.0
            for result in results:
                np.testing.assert_allclose(result, expected, rtol=1e-12, atol=1e-9)
                assert result.tobytes() == results[0].tobytes()
                assert_identical_on_every_rank(result)
    finally:
        algorithm.free()


def test_which_segments_go_around():
    """Those whose rows outgrow the cache, but never a size the fold or the gathered path
    takes; none where the cache is unknown."""
    assert cost.shared_around_above(8, None, 1 << 20, 4096) is None
    assert cost.shared_around_above(8, 0, 1 << 20, 4096) is None
    assert cost.shared_around_above(8, 32 << 20, 1 << 20, 4096) == 4 << 20
    assert cost.shared_around_above(8, 32 << 20, 8 << 20, 4096) == 8 << 20
    assert cost.shared_around_above(64, 32 << 20, 0, 1 << 20) == 1 << 20


@NEEDS_SHARED
def test_the_job_sends_around_only_what_neither_the_fold_nor_the_gathered_path_takes():
    engine = current().engine
    shared = engine.allreduce.host.algorithms["shared"]
    if shared.around_above is None:
        pytest.skip("this node's last-level cache is unknown: no segment goes around")
    above = shared.around_above()
    # a call the fold would take ((2 size + 1) rows of it fit the budget) has no part above
    assert (2 * hvd.size() + 1) * (above + 1) > engine.executor.rows_budget
    assert above >= engine.allreduce.route.small_bytes
