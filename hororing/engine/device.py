"""Device buffers (cupy, numba.cuda, torch CUDA tensors) as a place of the allreduce pipeline.

Buckets are fused on the device (pack kernels), prescaled there and unpacked there. With a
CUDA-aware MPI every algorithm runs on device memory: the ring with device scratch and
reduce kernels, the latency path gathering into device rows, and the other collectives on
the device arrays themselves. Otherwise the ring is ``StagedRing``, pipelined through pinned
host memory, and the latency path, the parameter servers and the other collectives go
through one host copy (their cost is latency, not bandwidth).
"""

import math

import numpy as np

from .. import gpu
from ..algorithms.ring import Ring
from ..algorithms.small import GatherReduce
from ..algorithms.staged import StagedRing
from .buffers import FusionBuffer, HostRoundTrip


class DeviceBuffers:
    """The device place (see ``buffers``); made on the first device collective, since it
    imports numba."""

    def __init__(self, comm, config, host_algorithms):
        from numba import cuda

        self.cuda = cuda
        self.aware = gpu.cuda_aware(config.cuda_aware)
        host = host_algorithms
        if self.aware:
            ring = Ring(comm, host["ring"].subchunk_bytes, device=self)
            ring.contributors = host["ring"].contributors
            small = GatherReduce(comm, device=self)
        else:
            ring = StagedRing(host["ring"], config.staged_copy_bytes)
            small = HostRoundTrip(host["small"])
        # a device bucket never takes the hierarchical path: the ring stands in for it
        self.algorithms = {"ring": ring, "small": small, "hierarchical": ring}
        if "ps" in host:
            self.algorithms["ps"] = HostRoundTrip(host["ps"])  # the servers reduce on the host
        self.algorithms["adasum"] = HostRoundTrip(host["adasum"])  # dot products on the host
        self._fusion = FusionBuffer(self.empty, config.fusion_threshold)

    # the algorithms' device protocol (CUDA-aware MPI)
    def empty(self, nbytes):
        return self.cuda.device_array(nbytes, dtype=np.uint8)

    def synchronize(self):
        self.cuda.synchronize()

    # the place's interface (see buffers.py)
    def prepare(self, items):
        for _, request in items:
            if request is not None and request.ready is not None:
                request.ready.synchronize()

    def input(self, response, request, dtype):
        if request is None:  # a joined rank contributes zeros
            zeros = self.cuda.device_array(response.meta.shape, dtype=dtype)
            _copy_in(zeros, np.zeros(response.meta.shape, dtype=dtype))
            return zeros
        return gpu.as_device_view(request.tensor)

    def output(self, response, request, dtype, source):
        if request is not None and request.output is not None:
            if request.output is request.tensor:
                return source
            return gpu.as_device_view(request.output)
        return self.cuda.device_array(response.meta.shape, dtype=dtype)

    def copy(self, target, source):
        if target.size:
            target.copy_to_device(source.reshape(source.size))

    def fusion_view(self, dtype, count):
        return self._fusion.view(dtype, count)

    def span(self, inputs, outputs):
        """Device buckets are always packed (see buffers.HostBuffers.span)."""
        return None

    def result(self, request, output):
        """In place: the caller's own array; otherwise ``output`` in the input's type."""
        if request is None:
            return None
        if request.output is not None:
            return request.output
        return gpu.result_like(request.tensor, output)

    def finish(self):
        self.cuda.synchronize()

    # ---- the other collectives ----------------------------------------------------------

    def run_other(self, verbs, host, response, request):
        """Run a non-allreduce collective of a device tensor with the executor's
        ``verbs(response, request, place)``: on the device itself with a CUDA-aware MPI, else
        on a host copy in the ``host`` place."""
        if request.ready is not None:
            request.ready.synchronize()
        if not self.aware:
            return self._through_host(verbs, host, response, request)
        original, original_output = request.tensor, request.output
        request.tensor = gpu.as_device_view(original)
        if original_output is original:
            request.output = request.tensor
        elif original_output is not None:
            request.output = gpu.as_device_view(original_output)
        result = verbs(response, request, self)
        self.cuda.synchronize()
        extra = None
        if isinstance(result, tuple):  # alltoall: (received rows, received splits)
            result, extra = result
        if original_output is not None:
            result = original_output
        elif result is not None:
            result = gpu.result_like(original, result)
        return result if extra is None else (result, extra)

    def _through_host(self, verbs, host, response, request):
        original, original_output = request.tensor, request.output
        request.tensor = gpu.as_device_view(original).copy_to_host()
        request.output = None
        result = verbs(response, request, host)
        extra = None
        if isinstance(result, tuple):  # alltoall: (received rows, received splits)
            result, extra = result
        if original_output is not None:
            target = gpu.as_device_view(original_output)
            _copy_in(target, np.ascontiguousarray(result).reshape(target.shape))
            device_result = original_output
        else:
            device_result = gpu.result_like(original,
                                            self.cuda.to_device(np.ascontiguousarray(result)))
        return device_result if extra is None else (device_result, extra)

    # what the verbs need of a place
    def new(self, shape, dtype):
        return self.cuda.device_array(shape, dtype=dtype)

    def flat_bytes(self, array):
        """A device array as flat bytes, for a CUDA-aware MPI."""
        return array.reshape(math.prod(array.shape)).view(np.uint8)


def _copy_in(target, host):
    if target.size:  # empty device arrays refuse copies (their strides differ)
        target.copy_to_device(host)
