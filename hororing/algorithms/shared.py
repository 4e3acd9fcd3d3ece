"""The allreduce of one node's ranks through its shared memory: no message carries data.

Where every rank of the job is on one node, the ranks can read each other's values where
they lie instead of sending them. Each rank keeps a row of a shared-memory window
(``MPI_Win_allocate_shared``), and the result has a row of its own. A buffer is reduced in
segments of at most a row, each in four moves:

  copy in    this rank's segment into its row;
  barrier    every row is written;
  reduce     chunk r of the segment (``plan.chunk_bounds``) is combined by rank r over every
             rank's row in rank order into the result row, and finalized there (Average,
             postscale); a rank's own chunk is read from its input, never copied in;
  barrier    every chunk is reduced;
  copy out   the result row into the output.

A bucket laid out in segments (its large members reduced where they lie,
``engine/segments.py``) goes through segment by segment.

A rank copies in and out about the buffer's size once each and reduces 1/n of it, whatever
the rank count, and it waits for two barriers a segment: the ring's 2(n-1) steps with their
copies through MPI's own shared memory are gone. Segments are 1 MiB, 16 MiB where ranks crowd
their cores (``cost.shared_segment_bytes``: there a barrier costs more than a segment's
copies). The elements are combined in rank order, as the gathered path combines them
(``small.reduce_rows``), so the two give the same bits, and every rank gets the same bits.

One window serves every call: a barrier passed by every rank separates each write of a row
from the reads of what it held before (the rows are read before the second barrier of a
segment and written again after it; the result row is read after it and written again
after the next segment's first barrier, which no rank enters before it has copied out).
The input is read before the second barrier and the output written after it, so the two may
be one buffer.

Around the node. Where the rows of a segment would outgrow the node's last-level cache, the
copies in cost a pass through memory of their own. A segment of more than ``around_above``
bytes (the executor's: above what the cache holds for every rank's row, and above what the
negotiation's fold and the gathered path take, so a call's first and later runs give the same
bits) goes around the node instead, into one of two result rows of a window of its own:

  combine     in n steps, rank r taking chunk (r - step) mod n of the row: at step 0 it
              copies its own chunk r in; at each later step it combines its input's part of
              the chunk into the row, once rank r - 1 has done so at the step before (a
              token: an empty message, after a memory fence on both sides); rank r - 1
              finalizes chunk r at the last step;
  barrier     every chunk is reduced;
  copy out    the row into the output.

Each rank reads its input once, where it lies: nothing is copied in. Chunk c is combined in
the order of the ranks from c round to c - 1, as the ring's reduction goes round, so there
the bits depend on where an element lies in the buffer (every rank still gets the same
bits). The two rows take turns: a row is written again only in the segment after next, once
every rank has entered the barrier of the segment between, which no rank enters before it
has copied out.
"""

import os

import numpy as np

from .. import transport
from .._mpi import MPI
from ..shared_window import SharedWindow, flags_by_default
from .base import Algorithm
from .cost import SHARED_SEGMENT_BYTES as SEGMENT_BYTES  # a row: the window holds ranks + 1
from .plan import chunk_bounds
from .ring import copy_flat
from .segmented import Segmented
from .small import REDUCE_BY_NAME, reduce_rows

SHM_PATH = "/dev/shm"


def shm_quarter(path=SHM_PATH):
    """A quarter of what this node's /dev/shm has free, in bytes (None where that cannot be
    read): the most that one user of it, the window here with segments larger than
    ``SEGMENT_BYTES`` (``cost.shared_segment_bytes``) or the fold's rows
    (``engine/fold.py``), may take; the MPI's own shared memory comes out of it too. Every
    rank of a job must use the same: the executor agrees on the smallest."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize // 4


class SharedMemory(Algorithm):
    """Allreduce of host buffers among ranks that all share one node (``node``: their
    communicator, in the data communicator's order). Collective to make; the window is
    made at the first allreduce, also collectively. ``flags``: whether the barriers wait on the
    window's flags, not on MPI's barrier (``shared_window.SharedWindow``; None: its
    default, ``shared_window.flags_by_default``). ``around_above``: a callable giving the bytes
    above which a segment goes around the node (see above; the same on every rank), or None:
    none does."""

    out_of_place = True

    def __init__(self, node, segment_bytes=SEGMENT_BYTES, flags=None, around_above=None):
        self.comm = node
        self.flags = flags_by_default() if flags is None else flags
        self.size = node.Get_size()
        self.rank = node.Get_rank()
        self.contributors = self.size
        self.segment_bytes = segment_bytes
        self._window = None
        self._rows = None    # (size, segment_bytes) uint8: every rank's row
        self._result = None  # (segment_bytes,) uint8
        self.around_above = around_above
        self._around = None  # the window of the segments that go around: two result rows
        self._around_turn = 0  # the row the next of them takes (the same on every rank)
        self.around_segments = 0  # how many have gone around
        self._token = np.empty(0, np.uint8)  # a step's token carries no data

    def allreduce(self, buffer, op, finalize=None, segments=None, source=None):
        """Reduce the flat host ``buffer`` over the node's ranks, in place or from ``source``
        (see Ring.allreduce)."""
        if source is None:
            source = buffer
        if self.size == 1 or not buffer.size:  # every rank has the same size: all skip alike
            if source is not buffer:
                copy_flat(buffer, source)
            if finalize is not None and buffer.size:
                finalize(buffer)
            return
        if self._window is None:
            self._open()
        ufunc = REDUCE_BY_NAME[op]
        itemsize = buffer.dtype.itemsize
        step = self.segment_bytes // itemsize
        above = None if self.around_above is None else self.around_above() // itemsize
        # a bucket laid out in segments (segmented.py; reduced in place) goes part by part
        parts = buffer.parts if isinstance(buffer, Segmented) else (buffer,)
        for part in parts:
            part_source = source if part is buffer else part
            for start in range(0, part.size, step):
                stop = min(part.size, start + step)
                segment = self._segment if above is None or stop - start <= above \
                    else self._segment_around
                segment(part[start:stop], part_source[start:stop], ufunc, finalize)

    def _segment(self, out, source, ufunc, finalize):
        count = out.size
        dtype = out.dtype
        nbytes = count * dtype.itemsize
        rows = self._rows[:, :nbytes].view(dtype)
        low, high = chunk_bounds(count, self.size)[self.rank]
        row = rows[self.rank]  # the others read all of it but this rank's own chunk,
        row[:low] = source[:low]
        row[high:] = source[high:]
        parts = [rows[rank, low:high] for rank in range(self.size)]
        parts[self.rank] = source[low:high]  # which is read where it lies
        self._barrier()
        result = self._result[:nbytes].view(dtype)
        mine = result[low:high]
        reduce_rows(ufunc, parts, mine)
        if finalize is not None and high > low:
            finalize(mine)
        self._barrier()
        out[...] = result  # in place too: the source was read before the last barrier

    def _segment_around(self, out, source, ufunc, finalize):
        if self._around is None:  # collective: every rank's segments are the same
            self._around = SharedWindow(self.comm, 2, self.segment_bytes, flags=self.flags)
        count = out.size
        dtype = out.dtype
        result = self._around.rows[self._around_turn, :count * dtype.itemsize].view(dtype)
        self._around_turn ^= 1
        self.around_segments += 1
        size, rank, comm = self.size, self.rank, self.comm
        token, fence = self._token, self._around.window.Sync
        bounds = chunk_bounds(count, size)
        before, after = (rank - 1) % size, (rank + 1) % size
        tokens = [comm.Irecv(token, before, step) for step in range(1, size)]
        sent = []
        for step in range(size):
            low, high = bounds[(rank - step) % size]
            mine = result[low:high]
            if step:
                transport.wait(tokens[step - 1])  # the rank before has combined its part
                fence()
                ufunc(mine, source[low:high], out=mine)
            else:
                mine[...] = source[low:high]
            if step < size - 1:
                fence()
                sent.append(comm.Isend(token, after, step + 1))
            elif finalize is not None and high > low:
                finalize(mine)
        self._around.barrier()
        out[...] = result  # in place too: the source was read before the barrier
        MPI.Request.Waitall(sent)  # each received before the barrier was passed

    def _barrier(self):
        self._window.barrier()

    def _open(self):
        window = SharedWindow(self.comm, self.size + 1, self.segment_bytes, flags=self.flags)
        self._rows, self._result = window.rows[:self.size], window.rows[self.size]
        self._window = window

    def free(self, clean=True):
        """Free the window and the node's communicator (collective); not after a failure
        (``clean`` False), where a peer may never free its part: the process's end releases
        them."""
        for window in (self._window, self._around):
            if window is not None:
                window.free(clean)
        self._window = self._rows = self._result = self._around = None
        if clean:
            self.comm.Free()

