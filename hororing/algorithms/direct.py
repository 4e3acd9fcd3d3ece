"""The device-direct ring: ranks on one node reduce in each other's device memory.

Without a CUDA-aware MPI, device buffers would otherwise cross the PCIe bus twice (the staged
ring). Ranks that share a node can instead open each other's device buffers through CUDA IPC:
each rank keeps one shared device buffer and P+1 interprocess events, whose handles the others
open once (and again only when a larger bucket comes, at the same allreduce on every rank),
and then

  copy in         its input into its own shared buffer;
  scatter-reduce  ring step s (``plan.ring_schedule``): chunk ``rank - s - 2`` of the left
                  neighbour's shared buffer is copied device to device into scratch and
                  reduced into the same chunk of its own, so after P-1 steps rank r holds
                  chunk r reduced over every rank, each element combined once in one order
                  (the finalizer, the Average division, runs on it there);
  allgather       every reduced chunk is copied straight from the rank that owns it into the
                  output (one step: the chunks are already where every rank can read them).

The steps are ordered between processes on the GPU itself: each step ends by recording this
rank's event for it, and a step that reads a peer's chunk first makes the stream wait for
that peer's event of the step that wrote it (the next allreduce's copy-in waits for every
peer's last event: they have finished reading). MPI carries no data, only a barrier after each
step, so that every event is recorded before anyone waits for it. The host never waits for the
GPU inside the ring: the bucket's one synchronization is the place's at its end. Results are
bitwise identical on every rank, as the message ring's are.

The memory object (``gpu.cupy_memory.CupyMemory``; tests use a host fake over an MPI shared
window) supplies ``share(comm, nbytes, events)``, ``record``, ``wait_pointer``, ``copy``,
``empty_bytes``, ``synchronize`` and its ``stream``.
"""

import logging

from ..kernels import reduce_into
from .base import Algorithm
from .plan import chunk_bounds, ring_schedule
from .ring import copy_flat

log = logging.getLogger("hororing")


class DeviceDirectRing(Algorithm):
    """``allreduce`` of device buffers among ranks of one node through shared device memory."""

    def __init__(self, comm, memory, fallback=None):
        """``comm``: ranks that all share one node; ``memory``: the device memory (with
        ``share``); ``fallback``: the algorithm to use instead if some rank cannot open the
        others' buffers (None: raise)."""
        self.comm = comm
        self.memory = memory
        self.fallback = fallback
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.contributors = self.size
        self.schedule = ring_schedule(self.size, self.rank, allgather=False)
        self.shared = None  # gpu.cupy_memory.SharedBuffers, grown to the largest bucket
        self.failed = None  # why the buffers could not be shared (then: the fallback runs)
        self.bytes_read = 0  # bytes copied out of peers' memory, over this ring's life
        self._scratch = None

    out_of_place = True

    def allreduce(self, buffer, op, finalize=None, segments=None, source=None):
        """Reduce the flat device ``buffer`` over all ranks: in place, or from ``source``."""
        if source is None:
            source = buffer
        if self.size == 1 or buffer.size == 0:
            if source is not buffer:
                copy_flat(buffer, source)
            if finalize is not None:
                finalize(buffer)
            return
        if self.failed is None and (self.shared is None or self.shared.nbytes < buffer.nbytes):
            self._share(buffer.nbytes)  # the same sizes on every rank: all grow together
        if self.failed is not None:
            self.fallback.allreduce(buffer, op, finalize, segments=segments,
                                    source=None if source is buffer else source)
            return
        memory, itemsize, dtype = self.memory, buffer.itemsize, buffer.dtype
        events, mine = self.shared.events, self.shared.events[self.rank]
        peers = [shared[:buffer.nbytes].view(dtype) for shared in self.shared.peers]
        own, left = peers[self.rank], peers[self.schedule.left]
        bounds = chunk_bounds(buffer.size, self.size)
        scratch = self._scratch_for(max(stop - start for start, stop in bounds) * itemsize)
        steps = self.schedule.steps
        # copy in, once every peer has read what it needed of the last allreduce's
        for peer in range(self.size):
            if peer != self.rank:
                memory.wait_pointer(memory.stream, events[peer][len(steps) + 1])
        memory.copy(own, source)
        self._step_done(mine[0])
        # scatter-reduce: chunk c arrives from the left neighbour's memory, not its messages
        for index, step in enumerate(steps):
            start, stop = bounds[step.recv_chunk]
            memory.wait_pointer(memory.stream, events[self.schedule.left][index])
            if stop > start:
                received = scratch[:(stop - start) * itemsize].view(dtype)
                memory.copy(received, left[start:stop])
                reduce_into(own[start:stop], received, op)
                self.bytes_read += (stop - start) * itemsize
            if index == len(steps) - 1 and finalize is not None:
                finalize(own[start:stop])  # this rank's chunk, reduced over every rank
            self._step_done(mine[index + 1])
        # allgather: each chunk from the rank that reduced it, once its last step is done
        for owner, (start, stop) in enumerate(bounds):
            if owner != self.rank:
                memory.wait_pointer(memory.stream, events[owner][len(steps)])
            if stop > start:
                memory.copy(buffer[start:stop], peers[owner][start:stop])
                if owner != self.rank:
                    self.bytes_read += (stop - start) * itemsize
        self._step_done(mine[len(steps) + 1])  # this rank has read every peer's chunk

    def _step_done(self, event):
        """Record this rank's ``event`` after the work queued so far; once every rank has
        recorded its own, any may wait for it."""
        self.memory.record(self.memory.stream, event)
        self.comm.Barrier()

    def _scratch_for(self, nbytes):
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = self.memory.empty_bytes(max(1, nbytes))
        return self._scratch

    def _share(self, nbytes):
        """Share a buffer of at least ``nbytes`` (twice what the last held, if larger) on
        every rank; where any rank fails, every rank falls back (the outcome is agreed)."""
        if self.shared is not None:
            nbytes = max(nbytes, 2 * self.shared.nbytes)
            self.free()
        shared, error = None, None
        try:
            # events: after the copy-in, after each scatter-reduce step, after the allgather
            shared = self.memory.share(self.comm, nbytes, events=self.size + 1)
        except Exception as failure:  # the driver refused a handle on this rank
            error = f"{type(failure).__name__}: {failure}"
        errors = self.comm.allgather(error)
        failed = [f"rank {rank}: {text}" for rank, text in enumerate(errors) if text is not None]
        if not failed:
            self.shared = shared
            return
        if shared is not None:
            shared.release()
        self.comm.Barrier()
        why = "; ".join(failed)
        if self.fallback is None:
            raise RuntimeError(f"the device-direct ring cannot share device memory between "
                               f"the ranks of this node ({why}); set HORORING_DEVICE_RING="
                               f"staged to stage device buffers through host memory")
        log.warning("device buffers could not be shared through CUDA IPC (%s); device "
                    "allreduces are staged through host memory instead", why)
        self.failed = why

    def free(self):
        """Close the peers' buffers on every rank (collective), then let this rank's go."""
        if self.shared is not None:
            self.memory.synchronize()  # this rank's reads of the peers' buffers are done
            self.comm.Barrier()
            self.shared.release()
            self.comm.Barrier()
            self.shared = None
