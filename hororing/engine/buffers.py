"""Where a bucket's buffers live: host memory here, device memory in ``device.py``.

The allreduce pipeline (``allreduce.py``) is written once against this small interface; a
place supplies the handful of operations that differ between host and device buffers:

- ``prepare(items)``: wait until the callers' inputs are ready to read;
- ``input(response, request, dtype)``: a request's input, or zeros for a joined rank;
- ``output(response, request, dtype, source)``: where a result goes (in place: the caller's
  array, ``source`` itself when it is the input);
- ``copy(target, source)``: copy one flat array into another of the same place;
- ``fusion_view(dtype, count)``: a flat view of the place's fusion buffer;
- ``algorithms``: the allreduce algorithms by kind (``ring``, ``small``, ``hierarchical``,
  ``ps``), each with ``allreduce(buffer, op, finalize, segments)`` and ``contributors``;
- ``result(request, output)``: what the caller's handle gets; ``finish()`` ends a bucket.
"""

import numpy as np

from ..transport import byte_view


class FusionBuffer:
    """One growing flat buffer: when a bucket needs more, it grows to twice the need, capped
    at the fusion threshold (but never below the need itself)."""

    def __init__(self, allocate, threshold):
        self._allocate = allocate  # nbytes -> a flat uint8 array
        self._threshold = threshold
        self._held = None

    def view(self, dtype, count):
        needed = count * dtype.itemsize
        if self._held is None or self._held.nbytes < needed:
            # at least one element: a device array of no bytes cannot be viewed as a dtype
            self._held = self._allocate(max(needed, min(self._threshold, 2 * needed),
                                            dtype.itemsize))
        return self._held[:needed].view(dtype)


class HostBuffers:
    """Buckets of numpy arrays, reduced by the host algorithms."""

    def __init__(self, algorithms, fusion_threshold):
        self.algorithms = algorithms
        self._fusion = FusionBuffer(lambda nbytes: np.empty(nbytes, dtype=np.uint8),
                                    fusion_threshold)

    def prepare(self, items):
        """Host inputs are ready when submitted."""

    def input(self, response, request, dtype):
        if request is None:  # a joined rank contributes zeros
            return np.zeros(response.meta.shape, dtype)
        return request.tensor

    def output(self, response, request, dtype, source):
        if request is not None and request.output is not None:
            return request.output
        return np.empty(response.meta.shape, dtype=dtype)

    def copy(self, target, source):
        target[...] = source.reshape(-1)

    def fusion_view(self, dtype, count):
        return self._fusion.view(dtype, count)

    def result(self, request, output):
        return output

    # what the other collectives need of a place
    def new(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def flat_bytes(self, array):
        return byte_view(array)

    def finish(self):
        """Nothing is asynchronous on the host."""


class HostRoundTrip:
    """A host algorithm run on a device buffer through a host copy of it (for an MPI that is
    not CUDA-aware, and for the parameter servers, which reduce on the host)."""

    def __init__(self, algorithm):
        self.algorithm = algorithm
        self.contributors = algorithm.contributors

    def allreduce(self, buffer, op, finalize=None, segments=None):
        host = buffer.copy_to_host()
        self.algorithm.allreduce(host, op, finalize, segments=segments)
        if buffer.size:  # empty device arrays refuse copies (their strides differ)
            buffer.copy_to_device(host)
