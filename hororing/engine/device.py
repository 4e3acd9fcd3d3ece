"""Collectives on device arrays (cupy, numba.cuda, torch CUDA tensors), for the executor.

Allreduce buckets are fused on the device (one pack launch), prescaled there, reduced by the
ring, and unpacked on the device. With a CUDA-aware MPI the ring runs on the device buffer
itself (device scratch, device reduce kernels, the device synchronized before MPI reads a
piece); otherwise ``StagedRing`` pipelines it through pinned host memory. Buckets below the
small-message threshold, PS mode, and the other collectives go through a host copy whole:
their cost is latency, not bandwidth.
"""

import numpy as np

from .. import gpu
from ..algorithms.ring import Ring
from ..algorithms.staged import StagedRing
from ..kernels import pack, scale_into, unpack
from ..ops import KERNEL_OP
from .executor import segments_of


class DeviceCollectives:
    """The device half of an Executor; made on the first device collective."""

    def __init__(self, executor):
        from numba import cuda

        self.cuda = cuda
        self.executor = executor
        self.aware = gpu.cuda_aware(executor.config.cuda_aware)
        if self.aware:
            self.ring = Ring(executor.comm, executor.config.ring_subchunk_bytes, device=self)
            self.ring.contributors = executor.ring.contributors
        else:
            self.ring = StagedRing(executor.ring)
        self._fusion = None

    # the Ring's device protocol (CUDA-aware MPI)
    def empty(self, nbytes):
        return self.cuda.device_array(nbytes, dtype=np.uint8)

    def synchronize(self):
        self.cuda.synchronize()

    def allreduce(self, items, wire, finalizer):
        """Reduce the bucket ``items`` in place of their outputs; return the results."""
        cuda = self.cuda
        meta = items[0][0].meta
        for _, request in items:
            if request is not None and request.ready is not None:
                request.ready.synchronize()
        dtype = np.dtype(meta.dtype)
        inputs, outputs = [], []
        for response, request in items:
            shape = response.meta.shape
            if request is None:  # joined rank: contributes zeros
                zeros = cuda.device_array(shape, dtype=dtype)
                _copy_in(zeros, np.zeros(shape, dtype=dtype))
                inputs.append(zeros)
            else:
                inputs.append(gpu.as_device_view(request.tensor))
            in_place = request is not None and request.output is not None
            outputs.append(gpu.as_device_view(request.output) if in_place
                           else cuda.device_array(shape, dtype=dtype))
        total = sum(array.size for array in inputs)
        buffer = self._fusion_view(wire, total)
        ranges = pack(inputs, buffer)
        scale_into(buffer, meta.prescale)
        executor = self.executor
        if executor.reducer is not None or buffer.nbytes < executor.config.small_allreduce_bytes:
            algorithm = executor.reducer or executor.small
            host = buffer.copy_to_host()
            segments = None
            if executor.reducer is not None:
                segments = segments_of([response.name for response, _ in items], ranges)
            algorithm.allreduce(host, KERNEL_OP[meta.op], finalizer(algorithm.contributors),
                                segments=segments)
            _copy_in(buffer, host)
        else:
            self.ring.allreduce(buffer, KERNEL_OP[meta.op], finalizer(self.ring.contributors))
        unpack(buffer, ranges, outputs)
        cuda.synchronize()
        return [_result(request, output) for (_, request), output in zip(items, outputs)]

    def run_other(self, run_host, response, request):
        """Run a non-allreduce collective on a host copy of the device tensor."""
        cuda = self.cuda
        if request.ready is not None:
            request.ready.synchronize()
        original, original_output = request.tensor, request.output
        request.tensor = gpu.as_device_view(original).copy_to_host()
        request.output = None
        result = run_host(response, request)
        extra = None
        if isinstance(result, tuple):  # alltoall: (received rows, received splits)
            result, extra = result
        if original_output is not None:
            target = gpu.as_device_view(original_output)
            _copy_in(target, np.ascontiguousarray(result).reshape(target.shape))
            device_result = original_output
        else:
            device_result = gpu.result_like(original, cuda.to_device(np.ascontiguousarray(result)))
        return device_result if extra is None else (device_result, extra)

    def _fusion_view(self, dtype, count):
        needed = count * dtype.itemsize
        held = 0 if self._fusion is None else self._fusion.nbytes
        if self._fusion is None or held < needed:
            self._fusion = self.cuda.device_array(max(needed, 2 * held, dtype.itemsize), np.uint8)
        return self._fusion[:needed].view(dtype)


def _copy_in(target, host):
    if target.size:  # empty device arrays refuse copies (their strides differ)
        target.copy_to_device(host)


def _result(request, view):
    """In place: the caller's own output array; otherwise ``view`` in the input's type."""
    if request is None:
        return None
    if request.output is not None:
        return request.output
    return gpu.result_like(request.tensor, view)
