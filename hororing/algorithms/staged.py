"""The ring on device buffers through pinned host memory, for an MPI that is not CUDA-aware.

The device buffer is copied down to a pinned host buffer (allocated once, grown when a larger
bucket comes) in blocks of ``copy_bytes`` on a stream of its own, in the order the ring first
reads them (the chunk this rank sends first, then the chunk each scatter-reduce step combines
into), with an event after each block; before the ring reads a piece it waits for the event
of the block holding the piece's end, so later blocks are still crossing the bus while the
first ones are already on the wire. Pieces are copied back up on a second stream once they
hold their final value (the pieces this rank finishes reducing, then every piece the
allgather delivers), joined into copies of at least ``copy_bytes``, so the return trip
overlaps the allgather; the one synchronization of the bucket is the wait for the last of
them. MPI only ever sees host memory.

``copy_bytes`` is Config.staged_copy_bytes: a copy costs one driver call through cupy
(a few microseconds), but about 120 us of Python through numba (docs/gpu.md).
"""

import bisect

import numpy as np

from .base import Algorithm
from .plan import chunk_bounds


class StagedRing(Algorithm):
    """``allreduce`` on a device buffer with the host ``ring``."""

    def __init__(self, ring, copy_bytes, memory):
        """``ring``: the host ring; ``memory``: the device memory (``gpu.memory``)."""
        self.ring = ring
        self.copy_bytes = copy_bytes
        self.memory = memory
        self.contributors = ring.contributors
        self._host = np.empty(0, dtype=np.uint8)
        self._streams = None

    out_of_place = True

    def allreduce(self, buffer, op, finalize=None, segments=None, source=None):
        """Reduce the device ``buffer`` in place, or device ``source`` into it (the host
        copy is taken from ``source``)."""
        memory = self.memory
        if self._streams is None:
            self._streams = (memory.new_stream(), memory.new_stream())
        down, up = self._streams
        # the place's stream has written the buffer (prescale, packing): the copies wait for it
        memory.wait(down, memory.record(memory.stream))
        host = self._pinned(buffer.dtype, buffer.size)
        bounds = chunk_bounds(buffer.size, self.ring.size)
        stage = _Stage(memory, buffer, buffer if source is None else source, host, bounds,
                       first_reads(self.ring.schedule(), len(bounds)), self.copy_bytes,
                       down, up)
        self.ring.allreduce(host, op, finalize, stage=stage)
        stage.finish()
        # later work on the place's stream (unpacking) reads what the up stream wrote
        memory.wait(memory.stream, memory.record(up))

    def _pinned(self, dtype, count):
        needed = count * dtype.itemsize
        if self._host.nbytes < needed:
            self._host = self.memory.pinned(max(needed, 2 * self._host.nbytes))
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
    """The copies around one staged allreduce (the ring's ``stage`` protocol: ``need`` before
    it reads host elements, ``final`` once they hold their result)."""

    def __init__(self, memory, device, source, host, bounds, order, copy_bytes, down, up):
        self.memory, self.device, self.host, self.up = memory, device, host, up
        self.pending = None  # final elements [start, stop) not yet copied back
        self.copy_elements = max(1, copy_bytes // host.itemsize)
        # down: the blocks of each chunk in the ring's reading order, an event after each
        blocks = []
        for chunk in order:
            start, stop = bounds[chunk]
            for block_start in range(start, stop, self.copy_elements):
                block_stop = min(stop, block_start + self.copy_elements)
                memory.download(source, block_start, block_stop, host, down)
                blocks.append((block_start, block_stop, memory.record(down)))
        blocks.sort(key=lambda block: block[0])
        self.block_stops = [stop for _, stop, _ in blocks]
        self.blocks = blocks

    def need(self, start, stop):
        """Wait until host elements [start, stop) have arrived."""
        if stop <= start:
            return
        index = bisect.bisect_right(self.block_stops, start)
        blocks = self.blocks
        while index < len(blocks) and blocks[index][0] < stop:
            blocks[index][2].synchronize()
            index += 1

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
            self.memory.upload(self.device, start, stop, self.host, self.up)
            self.pending = None

    def finish(self):
        self.flush()
        self.up.synchronize()
