"""The ring on device buffers through pinned host memory, for an MPI that is not CUDA-aware.

The device buffer is copied to a pinned host buffer chunk by chunk on one CUDA stream, in
the order the ring first reads the chunks (the chunk this rank sends first, then the chunk
each scatter-reduce step combines into), with an event after each; the ring waits only for
the event of the chunk it is about to read, so later chunks are still crossing the bus while
the first ones are already on the wire. Each piece is copied back on a second stream as soon
as it holds its final value (the piece this rank finishes reducing, then every piece the
allgather delivers), so the return trip overlaps the allgather. MPI only ever sees host memory.
"""

import numpy as np

from .plan import chunk_bounds


class StagedRing:
    """``allreduce`` on a numba.cuda device buffer with the host ``ring``."""

    def __init__(self, ring):
        self.ring = ring
        self.contributors = ring.contributors
        self._host = np.empty(0, dtype=np.uint8)
        self._streams = None

    def allreduce(self, buffer, op, finalize=None, segments=None):
        from numba import cuda

        if self._streams is None:
            self._streams = (cuda.stream(), cuda.stream())
        host = self._pinned(buffer.dtype, buffer.size)
        bounds = chunk_bounds(buffer.size, self.ring.size)
        stage = _Stage(buffer, host, bounds, first_reads(self.ring.schedule(), len(bounds)),
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
    def __init__(self, device, host, bounds, order, down, up):
        from numba import cuda

        self.device, self.host, self.up = device, host, up
        self.arrived = {}
        for chunk in order:
            start, stop = bounds[chunk]
            if stop > start:
                device[start:stop].copy_to_host(host[start:stop], stream=down)
            event = cuda.event()
            event.record(down)
            self.arrived[chunk] = event

    def need(self, chunk):
        self.arrived[chunk].synchronize()

    def final(self, start, stop):
        if stop > start:
            self.device[start:stop].copy_to_device(self.host[start:stop], stream=self.up)

    def finish(self):
        self.up.synchronize()
