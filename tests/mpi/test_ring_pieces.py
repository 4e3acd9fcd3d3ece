"""The host ring with pieces that grow (``piece_ceiling``, as the engine gives a ring that
crosses nodes), run directly on every rank: results against the float64 references, in place,
out of place and as a reduce-scatter, on lengths no rank count divides."""

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from hororing.algorithms.plan import chunk_bounds, ring_pieces
from hororing.algorithms.ring import Ring
from reference import all_inputs, assert_close, reference_allreduce

SUB, CEILING = 64, 512  # bytes: a chunk of float32 grows pieces from 64 up to 512 bytes


@pytest.fixture
def ring():
    comm = MPI.COMM_WORLD.Dup()
    yield Ring(comm, SUB, piece_ceiling=lambda: CEILING)
    comm.Barrier()
    comm.Free()


@pytest.mark.parametrize("length", [0, 1, 7, 61, 1000, 10_007])
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "out_of_place"])
def test_a_ring_with_growing_pieces_matches_the_reference(ring, length, in_place):
    size, rank = ring.comm.Get_size(), ring.comm.Get_rank()
    inputs = all_inputs(size, (length,), "float32", seed=length)
    buffer = inputs[rank].copy()
    if in_place:
        ring.allreduce(buffer, "sum")
    else:
        source = buffer.copy()
        buffer = np.empty_like(source)
        ring.allreduce(buffer, "sum", source=source)
        np.testing.assert_array_equal(source, inputs[rank])  # the input is only read
    assert_close(buffer, reference_allreduce(inputs, hvd.Sum))
    if size > 1 and length:
        largest = max(stop - start for start, stop in chunk_bounds(length, size))
        layout = next(iter(ring._layouts.values()))
        assert max(len(pieces) for pieces in layout.pieces) == ring_pieces(largest * 4, SUB,
                                                                           CEILING)


def test_a_reducescatter_with_growing_pieces_matches_the_reference(ring):
    size, rank = ring.comm.Get_size(), ring.comm.Get_rank()
    length = 4099
    inputs = all_inputs(size, (length,), "float64", seed=5)
    buffer = inputs[rank].copy()
    bounds = chunk_bounds(length, size)
    ring.reducescatter(buffer, "sum", bounds)
    start, stop = bounds[rank]
    assert_close(buffer[start:stop], reference_allreduce(inputs, hvd.Sum)[start:stop])
