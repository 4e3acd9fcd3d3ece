"""The device-direct ring (``algorithms/direct.py``) on a CPU: its steps, barriers, buffer
sharing and fallback over an MPI shared-memory window standing in for CUDA IPC
(``shared_memory_fake.py``). tests/gpu runs it on a GPU through cupy."""

import logging

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from hororing.algorithms.direct import DeviceDirectRing
from hororing.algorithms.ring import Ring
from hororing.kernels import divide_into
from reference import all_inputs, reference_allreduce
from shared_memory_fake import SharedHostMemory

OPS = {hvd.Sum: "sum", hvd.Min: "min", hvd.Max: "max", hvd.Product: "product"}


@pytest.fixture
def node():
    """A communicator of this node's ranks (tests/mpi runs on one node) and the fake memory."""
    comm = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    memory = SharedHostMemory(comm.Get_rank())
    yield comm, memory
    comm.Barrier()
    memory.close()
    comm.Free()


def same_on_every_rank(comm, array):
    gathered = comm.allgather(array.tobytes())
    return all(payload == gathered[0] for payload in gathered)


@pytest.mark.parametrize("count", [0, 1, 7, 1001, 10007])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", ["float64", "int32"])
def test_direct_ring_matches_reference_bitwise_alike(node, count, op, dtype):
    comm, memory = node
    ring = DeviceDirectRing(comm, memory)
    inputs = all_inputs(comm.Get_size(), (count,), dtype, seed=count + 3 * op, op=op)
    buffer = inputs[comm.Get_rank()].copy()
    ring.allreduce(buffer, OPS[op])
    np.testing.assert_allclose(buffer.astype(np.float64),
                               reference_allreduce(inputs, op).astype(np.float64),
                               rtol=1e-12, atol=1e-12)
    assert same_on_every_rank(comm, buffer)


def test_direct_ring_out_of_place_with_finalizer(node):
    comm, memory = node
    size = comm.Get_size()
    ring = DeviceDirectRing(comm, memory)
    inputs = all_inputs(size, (4099,), "float32", seed=5)
    source = inputs[comm.Get_rank()].copy()
    buffer = np.full(4099, np.nan, np.float32)
    ring.allreduce(buffer, "sum", finalize=lambda piece: divide_into(piece, size), source=source)
    np.testing.assert_array_equal(source, inputs[comm.Get_rank()])
    np.testing.assert_allclose(buffer, reference_allreduce(inputs, hvd.Average), rtol=1e-5,
                               atol=1e-5)
    assert same_on_every_rank(comm, buffer)


def test_direct_ring_shares_once_and_again_only_for_a_larger_bucket(node):
    comm, memory = node
    if comm.Get_size() == 1:
        pytest.skip("one rank shares nothing")
    ring = DeviceDirectRing(comm, memory)
    for count, shares in ((1000, 1), (1000, 1), (10, 1), (5000, 2), (3000, 2)):
        inputs = all_inputs(comm.Get_size(), (count,), "float64", seed=count)
        buffer = inputs[comm.Get_rank()].copy()
        ring.allreduce(buffer, "sum")
        np.testing.assert_allclose(buffer, reference_allreduce(inputs, hvd.Sum), rtol=1e-12)
        assert memory.shares == shares
    # each rank read (n-1)/n of every bucket from its peers in the scatter-reduce, and the
    # other ranks' reduced chunks in the allgather
    assert ring.bytes_read > 0
    ring.free()
    assert memory.released


def test_a_rank_that_cannot_share_makes_every_rank_fall_back(node, caplog):
    comm, memory = node
    if comm.Get_size() == 1:
        pytest.skip("one rank shares nothing")
    memory.refuse = comm.Get_rank() == comm.Get_size() - 1
    host_ring = Ring(comm, 1024)
    ring = DeviceDirectRing(comm, memory, fallback=host_ring)
    inputs = all_inputs(comm.Get_size(), (3001,), "float64", seed=9)
    buffer = inputs[comm.Get_rank()].copy()
    with caplog.at_level(logging.WARNING, logger="hororing"):
        ring.allreduce(buffer, "sum")
    np.testing.assert_allclose(buffer, reference_allreduce(inputs, hvd.Sum), rtol=1e-12)
    assert ring.failed is not None and f"rank {comm.Get_size() - 1}" in ring.failed
    assert "staged through host memory" in caplog.text
    assert host_ring.bytes_sent > 0  # the fallback moved the data


def test_without_a_fallback_the_refusal_is_an_error_on_every_rank(node):
    comm, memory = node
    if comm.Get_size() == 1:
        pytest.skip("one rank shares nothing")
    memory.refuse = comm.Get_rank() == 0
    ring = DeviceDirectRing(comm, memory)
    with pytest.raises(RuntimeError, match=r"cannot share device memory between the ranks of "
                                           r"this node \(rank 0: RuntimeError: .*pretend.*"
                                           r"HORORING_DEVICE_RING=staged"):
        ring.allreduce(np.ones(100), "sum")


def test_back_to_back_allreduces_never_read_the_next_ones_data(node):
    # a rank that starts the next allreduce while a peer still gathers its chunk would
    # overwrite that chunk with its next input: the final barrier forbids it
    comm, memory = node
    ring = DeviceDirectRing(comm, memory)
    for index in range(30):
        inputs = all_inputs(comm.Get_size(), (301,), "float64", seed=1000 + index)
        buffer = inputs[comm.Get_rank()].copy()
        ring.allreduce(buffer, "sum")
        np.testing.assert_allclose(buffer, reference_allreduce(inputs, hvd.Sum), rtol=1e-12)


def test_each_step_waits_for_the_peer_event_that_orders_it(node):
    # events: 0 after the copy-in, s + 1 after scatter-reduce step s, P after the allgather
    comm, memory = node
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("one rank waits for no one")
    ring = DeviceDirectRing(comm, memory)
    for _ in range(2):
        memory.recorded.clear()
        memory.waited.clear()
        ring.allreduce(np.ones(1000), "sum")
        assert memory.recorded == [(rank, index) for index in range(size + 1)]
        left = (rank - 1) % size
        others = [peer for peer in range(size) if peer != rank]
        assert memory.waited == (
            [(peer, size) for peer in others]  # copy-in: they have read my last allreduce
            + [(left, step) for step in range(size - 1)]  # left's previous step wrote it
            + [(owner, size - 1) for owner in others])  # the owner's reduced chunk
