"""The latency path for small allreduces: one MPI_Allgather, then a local reduction.

Every rank reduces the same gathered rows in rank order, so the results are bitwise
identical everywhere (MPI_Allreduce does not promise that), in one collective's latency.
"""

import numpy as np

from ..kernels import REDUCE_UFUNCS


REDUCE_BY_NAME = {name: getattr(np, ufunc) for name, ufunc in REDUCE_UFUNCS.items()}


class GatherReduce:
    """Allreduce of small flat buffers by allgather and a local, rank-ordered reduction."""

    def __init__(self, comm):
        self.comm = comm
        self.size = comm.Get_size()
        self.contributors = self.size
        self._rows = np.empty(0, dtype=np.uint8)

    def allreduce(self, buffer, op, finalize=None, segments=None):
        """Reduce the flat ``buffer`` over all ranks in place (see Ring.allreduce)."""
        if self.size > 1:
            rows = self._rows_for(buffer)
            self.comm.Allgather(buffer, rows)
            # one ufunc.reduce over the rows: the same row order on every rank
            REDUCE_BY_NAME[op].reduce(rows, axis=0, out=buffer)
        if finalize is not None:
            finalize(buffer)

    def _rows_for(self, buffer):
        needed = self.size * buffer.nbytes
        if self._rows.nbytes < needed:
            self._rows = np.empty(needed, dtype=np.uint8)
        return self._rows[:needed].view(buffer.dtype).reshape(self.size, buffer.size)
