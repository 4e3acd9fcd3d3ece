"""The Python side of the ring's compiled steps: which buffers they take, the tables they
read, and the loop that runs them and answers what they hand back (a piece to finalize, a
wait to sleep in). ``algorithms/ring.py`` calls it; the steps themselves are ``native.py``."""

import bisect

import numpy as np

from ... import transport
from ..._mpi import MPI
from ..segmented import Segmented
from . import HALVES, carried, codes, handle, module, ring_entry


def entry_for(buffer, source):
    """The compiled ring for these arrays (``compiled.ring_entry``), where they are ones it
    runs: numpy arrays (a ``Segmented`` buffer's in place), C-contiguous, in native byte
    order, the output writeable."""
    if type(buffer) is np.ndarray:
        if not (buffer.flags.c_contiguous and source.flags.c_contiguous
                and buffer.flags.writeable) or source.dtype != buffer.dtype:
            return None
        read_only = not source.flags.writeable
    elif isinstance(buffer, Segmented) and source is buffer:
        if not all(type(part) is np.ndarray and part.flags.c_contiguous and part.flags.writeable
                   for part in buffer.parts):
            return None
        read_only = False
    else:
        return None
    if not buffer.dtype.isnative:
        return None
    return ring_entry(buffer.dtype, read_only)


def tables(pieces_by_chunk, schedule, cuts):
    """A ring layout's pieces (per chunk, its pieces' (start, stop) element ranges) and
    schedule as the compiled steps read them (``native.ring``), and where the output's
    parts start (``cuts``: a ``Segmented`` buffer's)."""
    most = max(len(chunk) for chunk in pieces_by_chunk)
    part_starts = (0,) + tuple(cuts)
    pieces = np.zeros((len(pieces_by_chunk), 2 * most + 2), dtype=np.int64)
    for index, chunk in enumerate(pieces_by_chunk):  # a chunk's pieces lie back to back
        pieces[index, 0] = len(chunk)
        pieces[index, 1:len(chunk) + 2] = [start for start, _ in chunk] + [chunk[-1][1]]
        pieces[index, most + 2:most + 2 + len(chunk)] = [
            bisect.bisect_right(part_starts, start) - 1 for start, _ in chunk]
    steps = np.array([(step.send_chunk, step.recv_chunk, step.reduce) for step in schedule.steps],
                     dtype=np.int64)
    return pieces, steps, np.array(part_starts, dtype=np.int64)


class Native:
    """What a ring's compiled steps keep from call to call: its handles and request slots."""

    def __init__(self, comm, left, right):
        native = module()
        self.params = np.zeros(codes.PARAMS, dtype=np.int64)
        self.params[codes.P_COMM] = handle(comm)
        self.params[codes.P_BYTE] = handle(MPI.BYTE)
        self.params[codes.P_NULL] = handle(MPI.REQUEST_NULL)
        self.params[codes.P_LEFT] = left
        self.params[codes.P_RIGHT] = right
        self.state = np.zeros(codes.STATE_FIELDS, dtype=np.int64)
        self.flag = np.zeros(1, dtype=np.int32)
        self.status = np.zeros(16, dtype=np.int64)  # larger than either MPI's MPI_Status
        self.slots = None
        self._test = native.test_slot
        self._one_part = np.zeros((1, 2), dtype=np.int64)
        self._unused = {}

    def run(self, entry, tables, buffer, source, scratch, op, largest, finalize):
        """Run the compiled ring ``entry`` on ``buffer`` (from ``source``, which is
        ``buffer`` in place) with ``tables`` (``tables()``); ``scratch``: the in-place
        receive area, bytes for two halves of ``largest`` elements (None out of place).
        Python is called back for each owned piece's ``finalize`` and for waits long enough
        to sleep in."""
        pieces, steps, part_starts = tables
        bits = carried(buffer.dtype)  # the 16-bit floats as their bits
        in_place = source is buffer
        if in_place:
            scratch = scratch.view(bits)
            source = scratch  # unread
        else:
            scratch = self.unused(bits)
            if bits is not buffer.dtype:
                source = source.view(bits)
        parts = self.parts_of(buffer, part_starts)
        params = self.params
        params[codes.P_HALF] = HALVES.get(buffer.dtype, 0)
        params[codes.P_OP] = codes.OPS[op]
        params[codes.P_IN_PLACE] = in_place
        params[codes.P_FINALIZE] = finalize is not None
        params[codes.P_LARGEST] = largest
        params[codes.P_SPIN], params[codes.P_YIELD] = transport.backoff()[:2]
        most = (pieces.shape[1] - 2) // 2
        slots = self.slots_for((pieces.shape[0] + 2) * most)
        state = self.state
        state[:] = 0
        while True:
            event = entry(parts, source, scratch, pieces, steps, slots, state, params,
                          self.flag, self.status)
            if event == codes.DONE:
                return
            if event == codes.FINALIZE:
                finalize(buffer[state[codes.FIN_START]:state[codes.FIN_STOP]])
            elif event == codes.WAIT:
                self.sleep_on(slots, int(state[codes.SLOT]))
            else:
                self.slots = None  # requests may be outstanding in them
                raise MPI.Exception(int(state[codes.ERROR]))

    def parts_of(self, buffer, part_starts):
        """The output's parts as ``native.ring`` takes them: each its address and where it
        starts in the flat buffer."""
        if type(buffer) is np.ndarray:
            parts = self._one_part
            parts[0, 0] = buffer.ctypes.data
            return parts
        parts = np.empty((len(buffer.parts), 2), dtype=np.int64)
        parts[:, 0] = [part.ctypes.data for part in buffer.parts]
        parts[:, 1] = part_starts
        return parts

    def unused(self, dtype):
        """An empty array of ``dtype``: the scratch argument where none is read."""
        array = self._unused.get(dtype)
        if array is None:
            array = self._unused[dtype] = np.empty(0, dtype=dtype)
        return array

    def slots_for(self, count):
        if self.slots is None or self.slots.size < count:
            self.slots = np.full(count, self.params[codes.P_NULL], dtype=np.int64)
        return self.slots

    def sleep_on(self, slots, slot):
        """Wait for request ``slot`` in transport's sleeping phase (the stall watchdog sees
        it)."""
        test, flag, status = self._test, self.flag, self.status
        transport.wait_until(lambda: test(slots, slot, flag, status), asleep=True)
