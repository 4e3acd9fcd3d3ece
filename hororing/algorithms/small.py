"""The latency path for small allreduces: one MPI_Allgather, then a local reduction.

Every rank reduces the same gathered rows in rank order, so the results are bitwise
identical everywhere (MPI_Allreduce does not promise that), in one collective's latency.
With a CUDA-aware MPI it runs on device buffers too: the rows are gathered into device memory
and combined there by the reduce kernel, row after row.
"""

import numpy as np

from .. import transport
from ..kernels import REDUCE_UFUNCS, reduce_into
from .base import Algorithm
from .ring import copy_flat


REDUCE_BY_NAME = {name: getattr(np, ufunc) for name, ufunc in REDUCE_UFUNCS.items()}


def reduce_rows(ufunc, rows, out):
    """Combine ``rows`` (one per rank, in rank order: a 2-D host array, or a list of arrays
    of ``out``'s length) into ``out`` with ``ufunc``, one row after another.

    A 2-D array of more than two rows takes ``ufunc.reduce`` over axis 0, which combines
    them in the same order, element by element, so a list gives the same bits; but not rows
    of one element: numpy reduces that column as a 1-D array, from 8 elements up in eight
    interleaved partial sums (the float bits of 1-element allreduces at 8 ranks and more
    differed from the other paths'), so a column takes ``ufunc.accumulate``, which combines
    one row after another. Two rows take one binary call, at about half ``reduce``'s fixed
    cost (0.54 against 0.93 us, 4 KiB); one row is copied. ``out`` may be one of a list's
    rows only where it is the first.
    """
    count = len(rows)
    if count == 2:
        ufunc(rows[0], rows[1], out=out)
    elif count == 1:
        out[...] = rows[0]
    elif isinstance(rows, list):
        ufunc(rows[0], rows[1], out=out)
        for row in rows[2:]:
            ufunc(out, row, out=out)
    elif rows.shape[1] == 1:
        out[...] = ufunc.accumulate(rows[:, 0])[-1:]
    else:
        ufunc.reduce(rows, axis=0, out=out)


class GatherReduce(Algorithm):
    """Allreduce of small flat buffers by allgather and a local, rank-ordered reduction."""

    def __init__(self, comm, device=None):
        """``device``: gather device buffers with a CUDA-aware MPI (the device memory, as the
        Ring takes it); None: host buffers."""
        self.comm = comm
        self.device = device
        self.size = comm.Get_size()
        self.contributors = self.size
        self._rows = None

    out_of_place = True

    def allreduce(self, buffer, op, finalize=None, segments=None, source=None):
        """Reduce the flat ``buffer`` over all ranks, in place or from ``source`` (see
        Ring.allreduce)."""
        if source is None:
            source = buffer
        if self.size > 1 and buffer.size:  # every rank has the same size: all skip alike
            rows = self._rows_for(buffer)
            if self.device is None:
                self.comm.Allgather(transport.sendable(source), transport.sendable(rows))
                # the rows combined in rank order: the same bits on every rank
                reduce_rows(REDUCE_BY_NAME[op], rows, buffer)
            else:
                self.device.synchronize()  # the prescale kernel has written the buffer
                self.comm.Allgather(source, rows)
                copy_flat(buffer, rows[0])
                for row in range(1, self.size):
                    reduce_into(buffer, rows[row], op)
        elif source is not buffer:
            copy_flat(buffer, source)
        if finalize is not None:
            finalize(buffer)

    def _rows_for(self, buffer):
        needed = self.size * buffer.nbytes
        if self._rows is None or self._rows.nbytes < needed:
            self._rows = (np.empty(needed, dtype=np.uint8) if self.device is None
                          else self.device.empty_bytes(needed))
        return self._rows[:needed].view(buffer.dtype).reshape(self.size, buffer.size)
