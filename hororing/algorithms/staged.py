"""The ring on device buffers through pinned host memory, for an MPI that is not CUDA-aware.

The device buffer is copied to a pinned host buffer chunk by chunk on one CUDA stream, in
the order the ring first reads the chunks (the chunk this rank sends first, then the chunk
each scatter-reduce step combines into), with an event after each; the ring waits only for
the event of the chunk it is about to read, so later chunks are still crossing the bus while
the first ones are already on the wire. Pieces are copied back on a second stream once they
hold their final value (the pieces this rank finishes reducing, then every piece the
allgather delivers), so the return trip overlaps the allgather. Adjacent final pieces are
joined into copies of at least ``copy_bytes`` (Config.staged_copy_bytes, 8 MiB): each copy
costs on the order of 100 us of Python and driver time (measured on an H100), so one copy
per ring piece (1 MiB) would cost more than the bytes. MPI only ever sees host memory.
"""

import numpy as np

from .base import Algorithm
from .plan import chunk_bounds


class StagedRing(Algorithm):
    """``allreduce`` on a numba.cuda device buffer with the host ``ring``."""

    def __init__(self, ring, copy_bytes):
        self.ring = ring
        self.copy_bytes = copy_bytes
        self.contributors = ring.contributors
        self._host = np.empty(0, dtype=np.uint8)
        self._streams = None

    out_of_place = True

    def allreduce(self, buffer, op, finalize=None, segments=None, source=None):
        """Reduce the device ``buffer`` in place, or device ``source`` into it (the host
        copy is taken from ``source``)."""
        from numba import cuda

        if self._streams is None:
            self._streams = (cuda.stream(), cuda.stream())
        host = self._pinned(buffer.dtype, buffer.size)
        bounds = chunk_bounds(buffer.size, self.ring.size)
        stage = _Stage(buffer, buffer if source is None else source, host, bounds,
                       first_reads(self.ring.schedule(), len(bounds)), self.copy_bytes,
                       *self._streams)
        self.ring.allreduce(host, op, finalize, stage=stage)
        stage.finish()

    def _pinned(self, dtype, count):
        from numba import cuda

        needed = count * dtype.itemsize
        if self._host.nbytes < needed:
            self._host = cuda.pinned_array(max(needed, 2 * self._host.nbytes), dtype=np.uint8)
        return self._host[:needed].view(dtype)


def first_reads(schedule, chunks):
    """Chunk indices in the order the ring first reads this rank's own data of them."""
    order = []
    steps = schedule.steps
    for chunk in ([steps[0].send_chunk] if steps else []) + [s.recv_chunk for s in steps if s.reduce]:
        if chunk not in order:
            order.append(chunk)
    return order + [chunk for chunk in range(chunks) if chunk not in order]


class _Stage:
    def __init__(self, device, source, host, bounds, order, copy_bytes, down, up):
        from numba import cuda

        self.device, self.host, self.up = device, host, up
        self.pending = None  # final elements [start, stop) not yet copied back
        self.copy_elements = max(1, copy_bytes // host.itemsize)
        self.arrived = {}
        for chunk in order:
            start, stop = bounds[chunk]
            if stop > start:
                source[start:stop].copy_to_host(host[start:stop], stream=down)
            event = cuda.event()
            event.record(down)
            self.arrived[chunk] = event

    def need(self, chunk):
        self.arrived[chunk].synchronize()

    def final(self, start, stop):
        if stop <= start:
            return
        if self.pending is not None and self.pending[1] == start:
            start = self.pending[0]
        else:
            self.flush()
        self.pending = (start, stop)
        if stop - start >= self.copy_elements:
            self.flush()

    def flush(self):
        if self.pending is not None:
            start, stop = self.pending
            self.device[start:stop].copy_to_device(self.host[start:stop], stream=self.up)
            self.pending = None

    def finish(self):
        self.flush()
        self.up.synchronize()
