"""Rows in one shared-memory window of a node's ranks, and the barriers between their
writes and reads: MPI's, or counts kept in the window itself (its flags)."""

import numpy as np

from . import faults
from ._mpi import MPI
from .transport import wait


def flags_by_default():
    """Whether a window's barriers wait on its flags where its maker does not say: where
    the MPI cannot recover from a dead peer in process. Where it can (``faults.supported``,
    ULFM), MPI's barrier fails when a peer dies and recovery starts from that failure; the
    flags would wait on (only the stall watchdog's dead-peer check would end them)."""
    return not faults.supported()


class SharedWindow:
    """``count`` rows of ``width`` bytes in one shared-memory window of a node's ranks
    (``node``: their communicator), each row on cache lines of its own, so no two ranks
    write one line. ``rows``: a (count, width) uint8 view every rank reads and writes.
    A passive epoch is held for the memory fences around its barriers (MPI_Win_sync: this
    rank's writes visible to the others, theirs to it, on weakly ordered CPUs). Making one is
    collective, as is freeing it.

    ``flags``: ``barrier`` waits on a line of the window per rank instead of MPI's barrier
    (None: ``flags_by_default``). Each rank counts the barriers it has entered in its line
    and waits until every line holds that count: no rank relays another's arrival, so where
    ranks crowd the cores a barrier waits for the last rank to arrive, not for each round of
    MPI's dissemination to be scheduled in turn (docs/benchmarks.md, "A barrier in the
    shared window"). ``self.flags`` says which it is."""

    _LINE = 64

    def __init__(self, node, count, width, flags=None):
        self.flags = flags_by_default() if flags is None else bool(flags)
        pitch = -(-width // self._LINE) * self._LINE
        size = node.Get_size()
        lines = size if self.flags else 0
        total = count * pitch + lines * self._LINE
        self._node = node
        self._window = MPI.Win.Allocate_shared(total if node.Get_rank() == 0 else 0, 1,
                                               comm=node)
        memory, _ = self._window.Shared_query(0)
        whole = np.frombuffer(memory, dtype=np.uint8, count=total)
        self.rows = whole[:count * pitch].reshape(count, pitch)[:, :width]
        self._counts = self._mine = self._entered = None
        self._window.Lock_all(MPI.MODE_NOCHECK)
        if self.flags:  # rank r's count: the first 8 bytes of line r, zero before any barrier
            lines = whole[count * pitch:].reshape(size, self._LINE)
            self._counts = lines[:, :8].view(np.int64)[:, 0]
            self._mine = self._counts[node.Get_rank():node.Get_rank() + 1]
            self._mine[0] = 0
            # the one barrier in flight at a time, entered again by each ``start_barrier``
            self._entered = _Entered(self._counts, 0)
            self._window.Sync()
            wait(node.Ibarrier())
            self._window.Sync()

    @property
    def window(self):
        """The MPI window (its handle, for compiled code: ``engine/compiled_fold.py``)."""
        return self._window

    @property
    def node(self):
        """The node's communicator the window and its barriers are over."""
        return self._node

    def start_barrier(self):
        """Fence this rank's writes and enter a barrier of the node; what to wait on: MPI's
        request, or with flags one whose ``Test`` says whether every rank has entered."""
        self._window.Sync()
        if self._counts is None:
            return self._node.Ibarrier()
        entered = int(self._mine[0]) + 1
        self._mine[0] = entered
        request = self._entered  # waited on before the next barrier is entered
        request.entered = entered
        return request

    def barrier(self):
        """A barrier of the node with its fences on both sides."""
        wait(self.start_barrier())
        self._window.Sync()  # the others' writes before this rank's reads

    def flag_lines(self):
        """For compiled code entering the same barriers: the address of the first rank's
        count, that of this rank's, and the bytes from one line to the next; None where the
        barriers are MPI's."""
        if self._counts is None:
            return None
        return self._counts.ctypes.data, self._mine.ctypes.data, self._counts.strides[0]

    def all_entered(self):
        """With flags: whether every rank has entered as many barriers as this rank."""
        return _Entered(self._counts, self._mine[0]).Test()

    def free(self, clean=True):
        """Free the window (collective); not after a failure (``clean`` False), where a peer
        may never free its part: the process's end releases it."""
        if clean:
            self._window.Unlock_all()
            self._window.Free()
        self.rows = self._counts = self._mine = self._entered = None


class _Entered:
    """A flag barrier this rank has entered as its ``entered``-th (``SharedWindow``): done
    once every rank's count has reached it. Tested as a request is."""

    __slots__ = ("_counts", "entered")

    def __init__(self, counts, entered):
        self._counts, self.entered = counts, entered

    def Test(self):  # noqa: N802 (as MPI's requests spell it)
        return _least(self._counts) >= self.entered


_least = np.minimum.reduce  # ``counts.min()`` without numpy's Python wrapper around it
