"""transport.Exchange: a collective started again on the same buffers (the cycle's vote, the
fold's rows), as a persistent request where MPI has them and as a fresh nonblocking call
otherwise; both give what the blocking collective gives, start after start."""

import numpy as np
import pytest
from mpi4py import MPI

from hororing import transport


class NoPersistent:
    """A communicator as an MPI before MPI-4 offers it: no ``*_init`` collectives."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        if name.endswith("_init"):
            raise AttributeError(name)
        return getattr(self._comm, name)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "nonblocking"])
def test_started_again_on_new_contents_it_matches_the_blocking_collectives(persistent):
    world = MPI.COMM_WORLD
    comm = world.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    vote, agreed = np.zeros(5, dtype=np.int64), np.zeros(5, dtype=np.int64)
    row, rows = np.zeros(1003, dtype=np.uint8), np.zeros((size, 1003), dtype=np.uint8)
    where = comm if persistent else NoPersistent(comm)
    votes = transport.Exchange(where, "allreduce", vote, agreed, op=MPI.BAND)
    gathers = transport.Exchange(where, "allgather", row, rows)
    assert (votes._persistent is not None) == persistent
    try:
        for start in range(4):  # new contents in the same buffers each time
            vote[:] = np.arange(5) * 1000 + (rank + start) * 7
            row[:] = (np.arange(1003) + rank * 31 + start) % 251
            assert transport.wait(votes.start())
            assert transport.wait(gathers.start())
            mine = [np.arange(5) * 1000 + (r + start) * 7 for r in range(size)]
            assert agreed.tolist() == np.bitwise_and.reduce(mine).tolist()
            expected = [(np.arange(1003) + r * 31 + start) % 251 for r in range(size)]
            assert rows.tolist() == np.array(expected, dtype=np.uint8).tolist()
    finally:
        votes.free()
        gathers.free()
        comm.Free()


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "nonblocking"])
def test_buffers_given_as_temporaries_live_as_long_as_the_exchange(persistent):
    """MPI writes into the receive buffer at every start: an exchange made on a temporary
    (``Exchange(comm, kind, words, np.zeros_like(words))``) must keep it, or the writes land
    in freed memory that something else reuses."""
    import gc
    import weakref

    world = MPI.COMM_WORLD
    comm = world.Dup()
    words = np.full(7, world.Get_rank() + 1, dtype=np.int64)
    received = np.zeros_like(words)
    gone = weakref.ref(received)
    exchange = transport.Exchange(comm if persistent else NoPersistent(comm), "allreduce",
                                  words, received, op=MPI.SUM)
    del received
    gc.collect()
    assert gone() is not None, "the exchange let its receive buffer go"
    transport.wait(exchange.start())
    expected = sum(range(1, world.Get_size() + 1))
    np.testing.assert_array_equal(gone(), np.full(7, expected, dtype=np.int64))
    exchange.free()
    comm.Free()


def test_init_spins_the_waits_by_the_nodes_ranks_per_core():
    """After ``hvd.init`` a wait spins ``HORORING_WAIT_SPIN_TESTS`` tests (50 unset) where the
    node has a core per rank, and one where its ranks outnumber its cores, unless set: the
    cores its ranks may run on (the union of their affinity masks, at most the CPU quota of
    their cgroup, whose reading tests/unit/test_cores.py checks)."""
    import os

    import hororing as hvd
    from hororing import cores
    from hororing.context import current
    hvd.shutdown()
    hvd.init()
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_on_node = node.Get_size()
    masks = node.allgather(os.sched_getaffinity(0))
    node.Free()
    node_cores = len(set().union(*masks))
    if cores.quota() is not None:
        node_cores = min(node_cores, cores.quota())
    assert current().engine.executor.node_cores == node_cores
    given = os.environ.get("HORORING_WAIT_SPIN_TESTS")
    if given is not None:
        expected = int(given)
    else:
        expected = 1 if ranks_on_node > node_cores else 50
    assert transport.backoff()[0] == expected
