"""Where a bucket's buffers live: host memory here, device memory in ``device.py``.

The allreduce pipeline (``allreduce.py``) is written once against this small interface; a
place supplies the handful of operations that differ between host and device buffers:

- ``prepare(items)``: wait until the callers' inputs are ready to read;
- ``input(response, request, dtype)``: a request's input, or zeros for a joined rank;
- ``output(response, request, dtype, source)``: where a result goes (in place: the caller's
  array, ``source`` itself when it is the input);
- ``copy(target, source)``: copy one flat array into another of the same place;
- ``fusion_view(dtype, count, limit)``: a flat view of the place's fusion buffer (it grows
  to at most ``limit`` bytes ahead of need: the route's fusion threshold);
- ``span(inputs, outputs)``: one flat array over in-place inputs that lie back to back in
  memory, in bucket order (gradients that live in one flat tensor), or None: fuse them;
- ``algorithms``: the allreduce algorithms by kind (``ring``, ``small``, ``hierarchical``,
  ``ps``), each with ``allreduce(buffer, op, finalize, segments)`` and ``contributors``
  (and, where ``out_of_place`` is true, ``source=``: read the input there, not in ``buffer``);
- ``result(request, output)``: what the caller's handle gets; ``finish()`` ends a bucket.
"""

import math
import sys
import threading

import numpy as np

from ..algorithms.base import Algorithm
from ..ops import numpy_dtype
from ..transport import byte_view


class FusionBuffer:
    """One growing flat buffer: when a bucket needs more, it grows to twice the need, capped
    at ``limit`` (the fusion threshold; never below the need itself)."""

    def __init__(self, allocate):
        self._allocate = allocate  # nbytes -> a flat uint8 array
        self._held = None

    def view(self, dtype, count, limit):
        needed = count * dtype.itemsize
        if self._held is None or self._held.nbytes < needed:
            # at least one element: a device array of no bytes cannot be viewed as a dtype
            self._held = self._allocate(max(needed, min(limit, 2 * needed), dtype.itemsize))
        return self._held[:needed].view(dtype)


class OutputPool:
    """Result arrays of out-of-place allreduces, reused once no caller holds them.

    A fresh large numpy array is fresh pages from the kernel, and the first write to each one
    faults and zeroes it: for a 64 MiB result that cost as much as the ring's own passes. An
    array handed out is a view of a block the pool keeps; every view anyone makes of it (a
    slice, a reshape, ``torch.from_numpy``) holds that block as its base, so the block's
    reference count says whether a result made from it is still alive. Blocks are reused
    only when none is. At most ``capacity`` bytes are pooled; results below ``MIN_BYTES``
    come from numpy directly (malloc reuses those without new pages).
    """

    MIN_BYTES = 1 << 20
    _UNUSED = 2  # references to an unused block: the pool's list and getrefcount's argument

    def __init__(self, capacity):
        self.capacity = capacity
        self._blocks = []  # uint8 blocks, the most recently handed out last
        self._held = 0
        self._lock = threading.Lock()

    def empty(self, shape, dtype):
        dtype = numpy_dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES or nbytes > self.capacity:
            return np.empty(shape, dtype=dtype)
        with self._lock:
            block = self._take(nbytes)
        return block.view(dtype).reshape(shape)

    def _take(self, nbytes):
        blocks = self._blocks
        for index in range(len(blocks)):
            if blocks[index].nbytes == nbytes and sys.getrefcount(blocks[index]) == self._UNUSED:
                blocks.append(blocks.pop(index))
                return blocks[-1]
        # make room: let go of unused blocks, oldest first, then of the oldest handed out
        # (their callers keep them alive; they just leave the pool)
        index = 0
        while self._held + nbytes > self.capacity and index < len(blocks):
            if sys.getrefcount(blocks[index]) == self._UNUSED:
                self._held -= blocks.pop(index).nbytes
            else:
                index += 1
        while self._held + nbytes > self.capacity:
            self._held -= blocks.pop(0).nbytes
        blocks.append(np.empty(nbytes, dtype=np.uint8))
        self._held += nbytes
        return blocks[-1]


class HostBuffers:
    """Buckets of numpy arrays, reduced by the host algorithms."""

    def __init__(self, algorithms, output_pool_bytes=0):
        self.algorithms = algorithms
        self._fusion = FusionBuffer(lambda nbytes: np.empty(nbytes, dtype=np.uint8))
        self._outputs = OutputPool(output_pool_bytes)

    def prepare(self, items):
        """Host inputs are ready when submitted."""

    def input(self, response, request, dtype):
        if request is None:  # a joined rank contributes zeros
            return np.zeros(response.meta.shape, dtype)
        return request.tensor

    def output(self, response, request, dtype, source):
        if request is not None and request.output is not None:
            return request.output
        return self._outputs.empty(response.meta.shape, dtype)

    def copy(self, target, source):
        target[...] = source.reshape(-1)

    def fusion_view(self, dtype, count, limit):
        return self._fusion.view(dtype, count, limit)

    def span(self, inputs, outputs):
        """A flat array over ``inputs`` when each is reduced in place and each begins where
        the one before it ends (same dtype, C-contiguous); else None. Reducing it is reducing
        the fused buffer, byte for byte, without packing or unpacking."""
        extent = back_to_back(inputs, outputs, _address)
        if extent is None:
            return None
        start, end = extent
        dtype = inputs[0].dtype
        # the requests hold the inputs, and so the memory, until the bucket completes; the
        # bytes are viewed as the inputs' dtype (a typestr names no bfloat16: it reads "V2")
        return np.asarray(_Memory(start, end - start, "|u1")).view(dtype)

    def result(self, request, output):
        return output

    # what the other collectives need of a place
    def new(self, shape, dtype):
        return np.empty(shape, dtype=numpy_dtype(dtype))

    def scratch(self, dtype, count):
        """A flat array of ``count`` elements to work in, from the result pool: reused
        once the caller has let go of it."""
        return self._outputs.empty((count,), dtype)

    def flat_bytes(self, array):
        return byte_view(array)

    def finish(self):
        """Nothing is asynchronous on the host."""


def _address(array):
    return array.__array_interface__["data"][0]


def back_to_back(inputs, outputs, address):
    """The [start, end) addresses of ``inputs`` when each is reduced in place (its output is
    itself) and begins where the one before it ends (one dtype, C-contiguous); else None.
    ``address(array)``: where an array's memory begins (host or device)."""
    dtype = inputs[0].dtype
    start = end = address(inputs[0])
    for array, output in zip(inputs, outputs):
        if (output is not array or array.dtype != dtype or not array.flags.c_contiguous
                or address(array) != end):
            return None
        end += array.nbytes
    return start, end


class _Memory:
    """Raw host memory as numpy sees an array (``np.asarray`` of it is a view, no copy)."""

    def __init__(self, address, count, typestr):
        self.__array_interface__ = {"data": (address, False), "shape": (count,),
                                    "typestr": typestr, "version": 3}


class HostRoundTrip(Algorithm):
    """A host algorithm run on a device buffer through a host copy of it (for an MPI that is
    not CUDA-aware, and for the parameter servers, which reduce on the host). The copy lives
    in pinned memory allocated once (grown when a larger bucket comes)."""

    def __init__(self, algorithm, memory):
        """``memory``: the device memory (``gpu.memory``)."""
        self.algorithm = algorithm
        self.memory = memory
        self.contributors = algorithm.contributors
        self._host = np.empty(0, dtype=np.uint8)

    out_of_place = True  # the host copy is taken from the input

    def allreduce(self, buffer, op, finalize=None, segments=None, source=None):
        memory = self.memory
        if self._host.nbytes < buffer.nbytes:
            self._host = memory.pinned(max(buffer.nbytes, 2 * self._host.nbytes))
        host = self._host[:buffer.nbytes].view(buffer.dtype)
        memory.download(buffer if source is None else source, 0, buffer.size, host,
                        memory.stream)
        memory.synchronize()
        self.algorithm.allreduce(host, op, finalize, segments=segments)
        memory.upload(buffer, 0, buffer.size, host, memory.stream)
