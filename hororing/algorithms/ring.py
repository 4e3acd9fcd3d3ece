"""The pipelined ring: scatter-reduce then allgather over one flat host buffer.

Each chunk of the plan (``plan.ring_schedule``) is cut into sub-chunks ("pieces"). A piece
is forwarded to the right neighbour as soon as it is reduced, so while one piece is being
combined the next ones are already in flight, and the scatter-reduce flows into the
allgather without a step boundary. Scatter-reduce receives for step t+1 are posted at the
start of step t into the other half of a double-buffered scratch area; nothing is allocated
per step.

Out of place (``source`` given) nothing is copied first: the first chunk a rank sends is read
from the input, each scatter-reduce step receives straight into the output buffer and adds
the input's piece to it there (no scratch: the output has no data yet), and the one chunk a
rank never reduces reaches the output in the allgather. Writing the sum over the bytes just
received, rather than into a third array, keeps the add at two reads and one write.

A ``Segmented`` buffer (several arrays sliced as one: a bucket whose large members are
reduced where they lie) runs the same schedule, its pieces cut where the arrays meet.
"""

import bisect
from typing import NamedTuple

import numpy as np

from ..kernels import reduce_into

from .. import transport
from .compiled import driver
from .base import Algorithm, read_at_each_call
from .plan import chunk_bounds, ring_pieces, ring_schedule
from .segmented import Segmented


class Ring(Algorithm):
    """Executes ring collectives on one communicator, reusing its scratch buffers."""

    def __init__(self, comm, subchunk_bytes, device=None, piece_ceiling=0):
        """``subchunk_bytes``: the pieces' size, or a function that returns the size in effect
        at each call (the engine's route: a ring never holds a tunable of its own);
        ``piece_ceiling``: where above it, pieces grow up to it while a chunk keeps
        ``plan.RING_MIN_PIECES`` of them (``plan.ring_pieces``; a value or a function, as
        ``subchunk_bytes``);
        ``device``: run on device buffers handed straight to a CUDA-aware MPI; the device
        memory (``gpu.memory``: ``empty_bytes(nbytes)``, ``synchronize()``; None: host)."""
        self.comm = comm
        self.device = device
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.chunking = read_at_each_call(subchunk_bytes)
        self.ceiling = read_at_each_call(piece_ceiling)
        self._schedules = {
            True: ring_schedule(self.size, self.rank, allgather=True),
            False: ring_schedule(self.size, self.rank, allgather=False),
        }
        self._scratch = np.empty(0, dtype=np.uint8)
        self._layouts = {}  # (bounds, itemsize, sub-chunk bytes, steps) -> _Layout
        self.contributors = self.size  # ranks whose data is in a reduced result
        self.bytes_sent = 0  # to the right neighbour, over this ring's life
        schedule = self._schedules[True]
        self._neighbours = transport.world_ranks(comm, [schedule.left, schedule.right]) \
            if self.size > 1 else []
        self._native = None  # the compiled steps' arrays (driver.Native), made on their first run

    out_of_place = True  # allreduce and reducescatter take ``source``

    def allreduce(self, buffer, op, finalize=None, segments=None, stage=None, source=None):
        """Reduce the flat ``buffer`` over all ranks: in place, or from ``source`` into it.

        Args:
            buffer: 1-D contiguous array, the same length and dtype on every rank.
            op: kernel op name ("sum", "min", "max", "product").
            finalize: optional function applied once to each fully reduced piece this rank
                owns, before it is passed on (the Average division, postscale).
            segments: the bucket's tensors as ``(name, start, stop)``; unused, the ring splits
                by position (the parameter servers place by tensor).
            stage: optional pipeline around a host copy of a device buffer (see
                ``staged.StagedRing``): ``need(start, stop)`` is called before this rank's
                own elements [start, stop) are first read, ``final(start, stop)`` once a
                piece holds its final value.
            source: this rank's input, a flat array of ``buffer``'s kind, size and dtype,
                only read (None: the input is ``buffer`` itself).
        """
        self._run(buffer, op, buffer.size, self._schedules[True], finalize, stage, source)

    def schedule(self, allgather=True):
        """This rank's ring schedule (``plan.ring_schedule``)."""
        return self._schedules[allgather]

    def reducescatter(self, buffer, op, bounds, finalize=None, source=None):
        """Scatter-reduce the flat ``buffer``; on return ``buffer[bounds[rank]]`` is reduced.

        Args:
            bounds: one (start, stop) element range per rank, covering ``buffer``.
            source: as ``allreduce``'s; the rest of ``buffer`` is then left undefined.
        """
        self._run(buffer, op, tuple(bounds), self._schedules[False], finalize, source=source)

    def _layout(self, bounds, itemsize, schedule, cuts=()):
        """The pieces of every chunk and the elements this rank sends, worked out once per
        buffer shape (a training loop repeats a few). ``bounds``: the chunks' (start, stop)
        ranges, or an element count to cut into ``size`` chunks; ``cuts``: element offsets
        no piece may span (where a ``Segmented`` buffer's arrays meet)."""
        subchunk_bytes, ceiling = self.chunking(), self.ceiling()
        key = (bounds, itemsize, subchunk_bytes, ceiling, len(schedule.steps), cuts)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= _LAYOUTS:
                self._layouts.clear()
            if isinstance(bounds, int):
                bounds = chunk_bounds(bounds, self.size)
            largest = max(stop - start for start, stop in bounds)
            parts = ring_pieces(largest * itemsize, subchunk_bytes, ceiling)
            layout = self._layouts[key] = _Layout(
                [_cut(_split(start, stop, parts), cuts) for start, stop in bounds], largest,
                sum(bounds[step.send_chunk][1] - bounds[step.send_chunk][0]
                    for step in schedule.steps), {})
        return layout

    def _run(self, buffer, op, bounds, schedule, finalize, stage=None, source=None):
        stage = stage or _NO_STAGE
        # device kernels finish before MPI (or the stage) reads a piece: CUDA-aware MPI only
        synchronize = self.device.synchronize if self.device is not None else None
        steps = schedule.steps
        if not steps:
            stage.need(0, buffer.size)
            if source is not None:
                copy_flat(buffer, source)
            if finalize is not None:
                for part in buffer.parts if isinstance(buffer, Segmented) else (buffer,):
                    finalize(part)
            if synchronize is not None:
                synchronize()
            stage.final(0, buffer.size)
            return
        with transport.activity(self._describe, self._neighbours):
            layout = self._layout(bounds, buffer.itemsize, schedule,
                                  buffer.cuts if isinstance(buffer, Segmented) else ())
            source = buffer if source is None else source
            if stage is _NO_STAGE and synchronize is None:
                entry = driver.entry_for(buffer, source)
                if entry is not None:
                    self._compiled_steps(entry, buffer, source, op, layout, schedule, finalize)
                    return
            self._steps(buffer, op, layout, schedule, finalize, stage, synchronize, steps,
                        source)

    def _compiled_steps(self, entry, buffer, source, op, layout, schedule, finalize):
        """The schedule run by the compiled steps (``compiled.driver``)."""
        if self._native is None:
            self._native = driver.Native(self.comm, schedule.left, schedule.right)
        tables = layout.tables.get(id(schedule))
        if tables is None:
            tables = layout.tables[id(schedule)] = driver.tables(
                layout.pieces, schedule, buffer.cuts if isinstance(buffer, Segmented) else ())
        self.bytes_sent += buffer.itemsize * layout.sent
        scratch = None
        if source is buffer:
            self._scratch_halves(buffer.dtype, layout.largest)
            scratch = self._scratch[:2 * layout.largest * buffer.itemsize]
        self._native.run(entry, tables, buffer, source, scratch, op, layout.largest, finalize)

    def _steps(self, buffer, op, layout, schedule, finalize, stage, synchronize, steps, source):
        comm, left, right = self.comm, schedule.left, schedule.right
        pieces = layout.pieces
        in_place = source is buffer
        scratch = self._scratch_halves(buffer.dtype, layout.largest) if in_place else None
        # what MPI reads and writes: the same memory, bfloat16 as its 16-bit patterns (only
        # 16-bit dtypes can need another view: the others skip the calls, on every step)
        if buffer.dtype.itemsize == 2:
            sent, into = _sendable(source), _sendable(buffer)
            received = tuple(transport.sendable(half) for half in scratch) if in_place else None
        else:
            sent, into, received = source, buffer, scratch
        pending_sends = {}  # chunk -> send requests still reading from it

        def post_receives(index):
            step = steps[index]
            chunk_start = pieces[step.recv_chunk][0][0]
            if step.reduce and in_place:
                half = received[index % 2]
                return [comm.Irecv(half[start - chunk_start:stop - chunk_start], left, tag)
                        for tag, (start, stop) in enumerate(pieces[step.recv_chunk])]
            # out of place, a chunk is received into the buffer before this rank has sent it;
            # the allgather writes straight into the buffer: first let earlier sends finish
            transport.wait_all(pending_sends.pop(step.recv_chunk, []))
            return [comm.Irecv(into[start:stop], left, tag)
                    for tag, (start, stop) in enumerate(pieces[step.recv_chunk])]

        first = steps[0].send_chunk
        self.bytes_sent += buffer.itemsize * layout.sent
        sends = pending_sends[first] = []
        for tag, (start, stop) in enumerate(pieces[first]):
            stage.need(start, stop)
            sends.append(comm.Isend(sent[start:stop], right, tag))
        receives = post_receives(0)
        for index, step in enumerate(steps):
            has_next = index + 1 < len(steps)
            # a scatter-reduce receive can be posted a step early (into scratch, or out of
            # place into a chunk of the buffer this rank has not sent); an allgather receive
            # waits for this rank's sends of that chunk, so it is posted once this step is done
            early = has_next and steps[index + 1].reduce
            next_receives = post_receives(index + 1) if early else None
            owned_now = step.reduce and (not has_next or not steps[index + 1].reduce)
            chunk_start = pieces[step.recv_chunk][0][0]
            half = scratch[index % 2] if in_place else None
            forwarded = pending_sends.setdefault(step.recv_chunk, [])
            for tag, (start, stop) in enumerate(pieces[step.recv_chunk]):
                transport.wait(receives[tag])
                if step.reduce:
                    stage.need(start, stop)
                    reduce_into(buffer[start:stop],
                                half[start - chunk_start:stop - chunk_start] if in_place
                                else source[start:stop], op)
                    if owned_now and finalize is not None:
                        finalize(buffer[start:stop])
                    if synchronize is not None:
                        synchronize()
                if owned_now or not step.reduce:
                    stage.final(start, stop)
                if has_next:
                    forwarded.append(comm.Isend(into[start:stop], right, tag))
            receives = next_receives if early else (post_receives(index + 1) if has_next else None)
        for requests in pending_sends.values():
            transport.wait_all(requests)

    def _describe(self):
        return (f"a ring of {self.size} ranks (receives from rank {self._neighbours[0]}, sends "
                f"to rank {self._neighbours[1]})")

    def _scratch_halves(self, dtype, count):
        needed = 2 * count * dtype.itemsize
        if self._scratch.nbytes < needed:
            self._scratch = (np.empty(needed, dtype=np.uint8) if self.device is None
                             else self.device.empty_bytes(needed))
        flat = self._scratch[:needed].view(dtype)
        return flat[:count], flat[count:]


_LAYOUTS = 64  # layouts a ring keeps (a training loop has a few buffer shapes)


class _Layout(NamedTuple):
    pieces: list  # per chunk, its pieces' (start, stop) element ranges
    largest: int  # elements in the largest chunk
    sent: int  # elements this rank sends to the right in one run of the schedule
    tables: dict  # id(schedule) -> the compiled steps' tables (``driver.tables``)


class _NoStage:
    @staticmethod
    def need(start, stop):
        pass

    @staticmethod
    def final(start, stop):
        pass


_NO_STAGE = _NoStage()


def copy_flat(target, source):
    """Copy flat ``source`` into ``target`` (numpy or cupy arrays, or numba.cuda device
    arrays)."""
    if target.size:
        if hasattr(target, "copy_to_device"):  # numba.cuda
            target.copy_to_device(source)
        else:
            target[...] = source


def _split(start, stop, parts):
    return [(start + piece_start, start + piece_stop)
            for piece_start, piece_stop in chunk_bounds(stop - start, parts)]


def _cut(pieces, cuts):
    """``pieces`` split further where they span one of ``cuts`` (sorted offsets)."""
    if not cuts:
        return pieces
    result = []
    for start, stop in pieces:
        for cut in cuts[bisect.bisect_right(cuts, start):bisect.bisect_left(cuts, stop)]:
            result.append((start, cut))
            start = cut
        result.append((start, stop))
    return result


def _sendable(buffer):
    """What MPI reads and writes of ``buffer`` (a ``Segmented`` one: of each array)."""
    if isinstance(buffer, Segmented):
        return buffer.map(transport.sendable)
    return transport.sendable(buffer)
