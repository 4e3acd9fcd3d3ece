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
"""

import os

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
    default, ``shared_window.flags_by_default``)."""

    out_of_place = True

    def __init__(self, node, segment_bytes=SEGMENT_BYTES, flags=None):
        self.comm = node
        self.flags = flags_by_default() if flags is None else flags
        self.size = node.Get_size()
        self.rank = node.Get_rank()
        self.contributors = self.size
        self.segment_bytes = segment_bytes
        self._window = None
        self._rows = None    # (size, segment_bytes) uint8: every rank's row
        self._result = None  # (segment_bytes,) uint8

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
        step = self.segment_bytes // buffer.dtype.itemsize
        # a bucket laid out in segments (segmented.py; reduced in place) goes part by part
        parts = buffer.parts if isinstance(buffer, Segmented) else (buffer,)
        for part in parts:
            part_source = source if part is buffer else part
            for start in range(0, part.size, step):
                stop = min(part.size, start + step)
                self._segment(part[start:stop], part_source[start:stop], ufunc, finalize)

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
        if self._window is not None:
            self._window.free(clean)
        self._window = self._rows = self._result = None
        if clean:
            self.comm.Free()

