"""The hierarchical allreduce on nodes of any sizes, against a numpy reference.

"Nodes" here are made by splitting the job's communicator, so uneven layouts (3, 2 and 1
ranks at 6 ranks) are tested on one machine at every job size; the real node detection
(MPI_COMM_TYPE_SHARED) is tested by tests/launch/test_hierarchical.py under MPICH's
simulated nodes.
"""

import numpy as np
import pytest
from mpi4py import MPI

from hororing.algorithms.hierarchical import Hierarchical, node_layout
from hororing.kernels import divide_into


def uneven_node_sizes(size):
    """Node sizes like 3, 2, 1 for 6 ranks: every node a different size where possible."""
    sizes, remaining, take = [], size, max(1, (size + 1) // 2)
    while remaining:
        sizes.append(min(take, remaining))
        remaining -= sizes[-1]
        take = max(1, take - 1)
    return sizes


def layout_of(comm, sizes):
    node = np.repeat(np.arange(len(sizes)), sizes)[comm.Get_rank()]
    local = comm.Split(color=int(node), key=comm.Get_rank())
    return local, len(sizes), min(sizes)


@pytest.fixture(params=["uneven", "one per node", "detected"])
def hierarchical(request):
    comm = MPI.COMM_WORLD.Dup()
    size = comm.Get_size()
    if request.param == "uneven":
        layout = layout_of(comm, uneven_node_sizes(size))
    elif request.param == "one per node":
        layout = layout_of(comm, [1] * size)
    else:
        layout = node_layout(comm)
    algorithm = Hierarchical(comm, subchunk_bytes=256, layout=layout)  # many pieces in flight
    yield algorithm
    algorithm.free()
    comm.Free()


def rank_data(rank, count, dtype, seed):
    rng = np.random.default_rng(1000 * seed + rank)
    if np.dtype(dtype).kind == "f":
        return rng.normal(size=count).astype(dtype)
    return rng.integers(-50, 50, size=count).astype(dtype)


@pytest.mark.parametrize("count", [0, 1, 5, 1001, 40_000])
@pytest.mark.parametrize("dtype, op, reference", [
    (np.float64, "sum", np.sum), (np.float32, "max", np.max), (np.int64, "min", np.min),
    (np.int32, "sum", np.sum)])
@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "out of place"])
def test_matches_numpy_on_every_layout(hierarchical, count, dtype, op, reference, in_place):
    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    inputs = [rank_data(peer, count, dtype, seed=count) for peer in range(size)]
    if in_place:
        buffer = inputs[rank].copy()
        hierarchical.allreduce(buffer, op)
    else:  # every element of the result is written, none of the input
        source = inputs[rank].copy()
        buffer = np.full(count, 77, dtype)
        hierarchical.allreduce(buffer, op, source=source)
        np.testing.assert_array_equal(source, inputs[rank])
    expected = reference(np.stack(inputs), axis=0) if count else np.zeros(0, dtype)
    if np.dtype(dtype).kind == "f":
        tolerance = 1e-5 if dtype == np.float32 else 1e-12  # summation order differs
        np.testing.assert_allclose(buffer, expected, rtol=tolerance, atol=tolerance)
    else:
        np.testing.assert_array_equal(buffer, expected)
    # bitwise the same on every rank
    gathered = MPI.COMM_WORLD.allgather(buffer.tobytes())
    assert all(other == gathered[0] for other in gathered)


def test_average_is_finalized_once_and_cross_node_bytes_are_counted(hierarchical):
    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    count = 3 * size + 1
    buffer = np.full(count, float(rank + 1))
    sent_before = hierarchical.cross_bytes_sent()
    hierarchical.allreduce(buffer, "sum", lambda piece: divide_into(piece, size))
    np.testing.assert_allclose(buffer, np.full(count, (size + 1) / 2))
    sent = hierarchical.cross_bytes_sent() - sent_before
    nodes = hierarchical.nodes
    if nodes == 1 or hierarchical.local_rank >= hierarchical.parts:
        assert sent == 0
    else:  # this rank's part, 2(N-1)/N of it, in the cross-node ring
        start, stop = np.array_split(np.arange(count), hierarchical.parts)[hierarchical.local_rank][[0, -1]]
        part = stop - start + 1
        assert sent == pytest.approx(2 * (nodes - 1) / nodes * part * 8, abs=2 * nodes * 8)
