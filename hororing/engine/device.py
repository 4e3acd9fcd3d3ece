"""Device buffers (cupy, numba.cuda, torch CUDA tensors) as a place of the allreduce pipeline.

Every device operation goes through the device memory object (``gpu.memory``: cupy where it
is installed, numba.cuda elsewhere), on the place's own stream. Gradients that lie back to
back in one flat device tensor are reduced where they lie; other buckets are fused on the
device, prescaled there and unpacked there.

How a device bucket travels (``device_ring``; HORORING_DEVICE_RING forces one):

- ``direct``: every rank of the job on one node, and the device memory can be shared
  (CUDA IPC): the device-direct ring (``algorithms/direct.py``), which reduces in the
  peers' device memory; MPI only orders the steps. Buckets below
  ``Config.device_direct_min_bytes`` take the staged paths below instead.
- ``cuda-aware``: the MPI takes device pointers (``gpu.cuda_aware``): the message ring with
  device scratch and reduce kernels, the latency path gathering into device rows, and the
  other collectives on the device arrays themselves.
- ``staged``: otherwise; the ring through pinned host memory (``algorithms/staged.py``) and
  the latency path, the parameter servers and the other collectives through one host copy
  (their cost is latency, not bandwidth).
"""

import math

import numpy as np

from .. import gpu
from ..algorithms.base import Algorithm
from ..algorithms.direct import DeviceDirectRing
from ..algorithms.ring import Ring
from ..algorithms.small import GatherReduce
from ..algorithms.staged import StagedRing
from ..config import DEVICE_RINGS
from ..gpu.memory import memory_for_device_arrays
from .buffers import FusionBuffer, HostRoundTrip, back_to_back


def choose_transport(setting, aware, explicit_aware, one_node, can_share):
    """How device buckets travel: ``"direct"``, ``"cuda-aware"`` or ``"staged"``.

    Args:
        setting: Config.device_ring: ``"auto"``, ``"direct"`` or ``"staged"``.
        aware: the MPI takes device pointers; ``explicit_aware``: the user said so
            (HORORING_CUDA_AWARE=1), which wins over the device-direct ring in ``auto``.
        one_node: every rank of the communicator shares one node.
        can_share: the device memory can be opened by other processes (CUDA IPC).

    Raises:
        ValueError: ``direct`` where it cannot run, naming why.
    """
    if setting not in DEVICE_RINGS:
        raise ValueError(f"HORORING_DEVICE_RING must be one of {', '.join(DEVICE_RINGS)}, got "
                         f"{setting!r}")
    if setting == "direct":
        if not one_node:
            raise ValueError("HORORING_DEVICE_RING=direct needs every rank on one node (the "
                             "ranks share device memory through CUDA IPC); this job spans "
                             "several nodes: use auto or staged")
        if not can_share:
            raise ValueError("HORORING_DEVICE_RING=direct needs cupy (CUDA IPC) and a GPU; "
                             "install 'hororing[cuda]' or use auto or staged")
        return "direct"
    if setting == "staged":
        return "staged"
    if explicit_aware:
        return "cuda-aware"
    if one_node and can_share:
        return "direct"
    return "cuda-aware" if aware else "staged"


class BySize(Algorithm):
    """``large`` for buffers of at least ``min_bytes``, else ``small`` (both take ``source``)."""

    out_of_place = True

    def __init__(self, large, small, min_bytes):
        self.large, self.small, self.min_bytes = large, small, min_bytes
        self.contributors = large.contributors

    def allreduce(self, buffer, op, finalize=None, segments=None, source=None):
        chosen = self.large if buffer.nbytes >= self.min_bytes else self.small
        chosen.allreduce(buffer, op, finalize, segments=segments, source=source)


class DeviceBuffers:
    """The device place (see ``buffers``); made on the first device collective."""

    def __init__(self, comm, config, host_algorithms, one_node, memory=None):
        """``one_node``: every rank of ``comm`` shares one node; ``memory``: the device memory
        (default: ``gpu.memory.memory_for_device_arrays()``)."""
        self.memory = memory if memory is not None else memory_for_device_arrays()
        self.aware = gpu.cuda_aware(config.cuda_aware)
        self.transport = choose_transport(config.device_ring, self.aware,
                                          config.cuda_aware is True, one_node,
                                          self.memory.can_share)
        host = host_algorithms
        staged = StagedRing(host["ring"], config.staged_copy_bytes, self.memory)
        if self.transport == "cuda-aware":
            ring = Ring(comm, host["ring"].chunking, device=self.memory,
                        piece_ceiling=host["ring"].ceiling)
            ring.contributors = host["ring"].contributors
            small = GatherReduce(comm, device=self.memory)
        elif self.transport == "direct":
            # where some rank cannot open the others' memory, every rank stages instead
            fallback = staged if config.device_ring == "auto" else None
            direct = DeviceDirectRing(comm, self.memory, fallback=fallback)
            # below device_direct_min_bytes the staged paths are faster (config.py)
            minimum = config.device_direct_min_bytes
            ring = BySize(direct, staged, minimum)
            small = BySize(direct, HostRoundTrip(host["small"], self.memory), minimum)
        else:
            ring = staged
            small = HostRoundTrip(host["small"], self.memory)
        # a device bucket never takes the hierarchical path or the halving algorithms (host
        # buffers only): the ring stands in for them, the gathered path for recursive doubling
        self.algorithms = {"ring": ring, "small": small, "hierarchical": ring,
                           "rabenseifner": ring, "recursive_doubling": small, "shared": ring}
        if "ps" in host:  # the servers reduce on the host
            self.algorithms["ps"] = HostRoundTrip(host["ps"], self.memory)
        self.algorithms["adasum"] = HostRoundTrip(host["adasum"], self.memory)  # dot products
        self._fusion = FusionBuffer(self.memory.empty_bytes)

    # the place's interface (see buffers.py)
    def prepare(self, items):
        first = next((request for _, request in items if request is not None), None)
        self.memory.activate(first.tensor if first is not None else None)
        for _, request in items:
            if request is not None and request.ready is not None:
                request.ready.synchronize()

    def input(self, response, request, dtype):
        if request is None:  # a joined rank contributes zeros
            return self.memory.zeros(response.meta.shape, dtype)
        return self.memory.view(request.tensor)

    def output(self, response, request, dtype, source):
        if request is not None and request.output is not None:
            if request.output is request.tensor:
                return source
            return self.memory.view(request.output)
        return self.memory.empty(response.meta.shape, dtype)

    def copy(self, target, source):
        self.memory.copy(target, source.reshape(source.size))

    def fusion_view(self, dtype, count, limit):
        return self._fusion.view(dtype, count, limit)

    def span(self, inputs, outputs):
        """One flat device array over in-place ``inputs`` that lie back to back in memory
        (gradients in one flat bucket), or None: pack them (see buffers.HostBuffers.span)."""
        memory = self.memory
        if memory.name != "cupy":
            return None
        extent = back_to_back(inputs, outputs, memory.pointer)
        if extent is None:
            return None
        start, end = extent
        dtype = inputs[0].dtype
        # back to back is not enough: arrays of cupy's pool can end and begin two allocations
        # at one address, and no copy may cross from one allocation into the next
        base = memory.allocation_base(start)
        if base is None or memory.allocation_base(end - 1) != base:
            return None
        # the requests hold the inputs, and so the memory, until the bucket completes
        return memory.from_pointer(start, ((end - start) // dtype.itemsize,), dtype, inputs[0])

    def result(self, request, output):
        """In place: the caller's own array; otherwise ``output`` in the input's type."""
        if request is None:
            return None
        if request.output is not None:
            return request.output
        return self.memory.result_like(request.tensor, output)

    def finish(self):
        self.memory.synchronize()

    # ---- the other collectives ----------------------------------------------------------

    def run_other(self, verbs, host, response, request):
        """Run a non-allreduce collective of a device tensor with the executor's
        ``verbs(response, request, place)``: on the device itself with a CUDA-aware MPI, else
        on a host copy in the ``host`` place."""
        self.memory.activate(request.tensor)
        if request.ready is not None:
            request.ready.synchronize()
        if self.transport != "cuda-aware":
            return self._through_host(verbs, host, response, request)
        original, original_output = request.tensor, request.output
        request.tensor = self.memory.view(original)
        if original_output is original:
            request.output = request.tensor
        elif original_output is not None:
            request.output = self.memory.view(original_output)
        result = verbs(response, request, self)
        self.memory.synchronize()
        extra = None
        if isinstance(result, tuple):  # alltoall: (received rows, received splits)
            result, extra = result
        if original_output is not None:
            result = original_output
        elif result is not None:
            result = self.memory.result_like(original, result)
        return result if extra is None else (result, extra)

    def _through_host(self, verbs, host, response, request):
        memory = self.memory
        original, original_output = request.tensor, request.output
        request.tensor = memory.to_host(memory.view(original))
        request.output = None
        result = verbs(response, request, host)
        extra = None
        if isinstance(result, tuple):  # alltoall: (received rows, received splits)
            result, extra = result
        if original_output is not None:
            target = memory.view(original_output)
            memory.copy(target.reshape(target.size), memory.to_device(result).reshape(target.size))
            memory.synchronize()
            device_result = original_output
        else:
            device_result = memory.result_like(original, memory.to_device(result))
        return device_result if extra is None else (device_result, extra)

    # what the verbs need of a place
    def new(self, shape, dtype):
        return self.memory.empty(shape, dtype)

    def flat_bytes(self, array):
        """A device array as flat bytes, for a CUDA-aware MPI."""
        return array.reshape(math.prod(array.shape)).view(np.uint8)
