"""How a negotiation cycle talks to its peers: the only messages a cycle sends.

A cycle (``cycle.py``) needs three collectives: a repeated one on fixed buffers (the vote's
bitwise AND, the fold's allgather of rows), an allgather of header rows, and an allgatherv
of variable-length notes. ``MpiExchange`` runs them on a communicator of its own. Each call
returns a request to wait on with ``transport.wait`` (anything with ``Test()``), so a cycle
can also run against an in-process stand-in that plays several ranks in one process (the
unit tests' ``LocalExchange``).

Where every rank is on one node, the fold's rows need not travel at all: ``SharedRows``
keeps them in a shared-memory window of the node, each rank writing its own row, and the
exchange is a barrier. A 64 KiB row at 2 ranks: 15.7 µs against the allgather's 21.9 and
MPI_Allreduce's 15.3 (docs/benchmarks.md, "The fold's rows in shared memory").
"""

import numpy as np

from .. import faults, transport
from .._mpi import MPI
from ..shared_window import SharedWindow, flags_by_default


# Rows below this many bytes are gathered by MPI even on one node where the fold's cycle runs
# Python's steps or the rows' barrier is MPI's (no flags, ``shared_window.flags_by_default``):
# there the allgather is as fast (4 KiB at 2 ranks: 5.3 µs against 5.7 through shared memory;
# 8 KiB: 8.6 against 6.3; Python's steps at 2 ranks, 256 B-4 KiB: 24-26 µs against 28-31).
# Where the cycle runs compiled and the barrier is the window's flags, rows of every width go
# through shared memory: 2 ranks, 256 B-4 KiB, MPI_Allreduce over hororing 0.43-0.57 against
# 0.36-0.53 gathered in each of 4 alternated pairs; 3-8 ranks crowding 2 cores 0.45-0.87
# against 0.29-0.67 (docs/benchmarks.md, "Small rows in shared memory too")
SHARED_ROWS_MIN = 8 * 1024


class MpiExchange:
    """The negotiation's collectives over MPI, on a duplicate of ``comm``; ``shared``: the
    fold's rows may go through the node's shared memory (``shared_rows``)."""

    def __init__(self, comm, shared=True, small_shared=False):
        """``small_shared``: rows below ``SHARED_ROWS_MIN`` go through shared memory too
        where its barriers are the window's flags (every rank runs the compiled fold cycle:
        the same on every rank)."""
        self.comm = faults.track(comm.Dup())
        self._small_shared = small_shared and flags_by_default()
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self._node = None if shared and self.size > 1 else False  # made on first use
        self._one_node = True if self.size == 1 else None  # asked on first use

    def repeated(self, kind, sendbuf, recvbuf, op=None):
        """A collective started again and again on the same buffers (``transport.Exchange``):
        ``kind`` "allreduce" (with ``op``) or "allgather". Collective to make."""
        kwargs = {} if op is None else {"op": {"band": MPI.BAND}[op]}
        return transport.Exchange(self.comm, kind, sendbuf, recvbuf, **kwargs)

    def one_node(self):
        """Whether every rank is on one node. Collective the first time it is asked."""
        if self._one_node is None:
            self._find_node()
        return self._one_node

    def _find_node(self):
        """Whether every rank is on one node (``_one_node``), and where they are and the
        fold's rows may be shared, the node's communicator, kept (``_node``; else False).
        Collective."""
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)  # in this communicator's order
        self._one_node = node.Get_size() == self.size
        if self._one_node and self._node is None:
            self._node = faults.track(node)
        else:
            node.Free()
            self._node = False

    def shared_rows(self, width):
        """``SharedRows`` of ``width`` bytes a row where every rank is on one node and the
        rows are at least ``SHARED_ROWS_MIN`` bytes (any width with ``small_shared``); None
        where the rows are to be gathered by MPI. Collective: the same answer on every rank."""
        if self._node is None:  # the node's communicator, looked for once
            self._find_node()
        if self._node is False or (width < SHARED_ROWS_MIN and not self._small_shared):
            return None
        return SharedRows(self._node, width)

    def allgather(self, row, rows):
        """Every rank's ``row`` into ``rows`` (one row per rank); the request."""
        return self.comm.Iallgather(row, rows)

    def allgatherv(self, own, gathered, lengths, offsets):
        """Every rank's bytes ``own`` into the uint8 ``gathered`` (rank r's ``lengths[r]``
        bytes at ``offsets[r]``); the request."""
        return self.comm.Iallgatherv(np.frombuffer(own, dtype=np.uint8),
                                     [gathered, lengths, offsets, MPI.BYTE])

    def free(self):
        if self._node:
            self._node.Free()
        self.comm.Free()


class SharedRows:
    """Every rank's row of ``width`` bytes in one shared-memory window of the node (``node``:
    its communicator, every rank of the exchange, in its order), in two sets used in turn.
    A rank writes its row of the next set, then the exchange is a barrier, after which every
    rank reads every row. A set is written again two exchanges later, after a barrier every
    rank entered once it had read that set, so one barrier an exchange is all it takes.
    ``result``: one more row, where a chunked fold's ranks each reduce their chunk of every
    row (``fold.py``). ``flags``: whether the barriers wait on the window's flags
    (``shared_window.SharedWindow``; None: its default). Making one is collective, as is
    freeing it."""

    def __init__(self, node, width, flags=None):
        size = node.Get_size()
        self._window = SharedWindow(node, 2 * size + 1, width, flags=flags)
        rows = self._window.rows
        self.sets = (rows[:size], rows[size:2 * size])
        self.result = rows[2 * size]  # a chunked fold's result (fold.py)
        self.rank = node.Get_rank()
        # this rank's row is written: start the barrier (the request); then, once it has
        # completed, ``arrived``: the other ranks' rows readable (the window's fence). Bound
        # here: a lone allreduce's cycle calls both
        self.start = self._window.start_barrier
        self.arrived = self._window.window.Sync

    @property
    def window(self):
        """The ``shared_window.SharedWindow`` the rows lie in (its window and node, for the
        compiled cycle: ``compiled_fold.py``)."""
        return self._window

    def barrier(self):
        """A barrier of the node, fenced on both sides (a chunked fold's second)."""
        self._window.barrier()

    def free(self, clean=True):
        """Free the window (collective; not after a failure, as ``SharedWindow.free``)."""
        self._window.free(clean)
