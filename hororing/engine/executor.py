"""Executes the negotiated responses of one cycle, the same way on every rank.

Allreduces that share dtype, op and scale factors are fused into buckets of at most the
fusion threshold; a bucket below the small-message threshold takes the gather-reduce
latency path, a larger one the pipelined ring, or, when the job spans several nodes and
the bucket reaches the hierarchical threshold, the hierarchical allreduce (in PS mode,
every bucket goes through the parameter servers). The other collectives run one by one
through MPI on byte views of contiguous buffers.
"""

import functools
import math
import time

import numpy as np
from .._mpi import MPI

from ..algorithms.hierarchical import Hierarchical, node_layout
from ..algorithms.plan import chunk_bounds
from ..algorithms.ring import Ring
from ..algorithms.small import REDUCE_BY_NAME, GatherReduce
from ..errors import HorovodInternalError
from ..kernels import divide_into, divide_trunc, pack, scale_into, unpack
from ..ops import Average, KERNEL_OP, Sum
from ..transport import byte_view


class Executor:
    """Runs responses on the data communicator; owns the fusion buffer and the algorithms."""

    def __init__(self, comm, config, timeline, reducer=None):
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.config = config
        self.timeline = timeline
        self.ring = Ring(comm, config.ring_subchunk_bytes)
        self.small = GatherReduce(comm)
        # PS mode: every allreduce bucket goes through the parameter servers
        self.reducer = reducer
        self.hierarchical = None if reducer is not None else _hierarchical(comm, config)
        self._fusion = np.empty(0, dtype=np.uint8)
        self._device = None  # DeviceCollectives, made on the first device collective

    def execute(self, responses, take, missed=None):
        """Run ``responses`` in order; ``take(name)`` returns this rank's Request or None.

        ``missed(name)`` is told of each failed response this rank had no request for.
        """
        buckets = {}
        ordered = []
        now = time.monotonic()
        for response in responses:
            request = take(response.name)
            if request is not None and self.timeline is not None:
                self.timeline.span(response.name, "NEGOTIATE_" + response.meta.kind.upper(),
                                   request.submitted, now)
            if response.error is not None:
                if request is not None:
                    request.handle.set_error(HorovodInternalError(response.error))
                elif missed is not None:
                    missed(response.name)
                continue
            if response.meta.kind != "allreduce":
                ordered.append((response, request))
            elif len(responses) == 1:  # nothing to fuse with
                ordered.append([(response, request)])
            else:
                self._bucket(buckets, ordered, response, request)
        for item in ordered:
            if isinstance(item, list):
                self._allreduce(item)
            else:
                self._run_other(*item)

    # ---- allreduce ----------------------------------------------------------------------

    def _bucket(self, buckets, ordered, response, request):
        meta = response.meta
        key = (meta.dtype, meta.op, meta.prescale, meta.postscale, meta.device, meta.wire)
        nbytes = math.prod(meta.shape) * _wire_dtype(meta.dtype, meta.wire).itemsize
        bucket = buckets.get(key)
        if bucket is None or bucket[0] + nbytes > self.config.fusion_threshold:
            bucket = buckets[key] = [0, []]
            ordered.append(bucket[1])
        bucket[0] += nbytes
        bucket[1].append((response, request))

    def _allreduce(self, items):
        meta = items[0][0].meta
        dtype = _dtype(meta.dtype)
        if meta.device != "cpu":
            wire = _wire_dtype(meta.dtype)  # device buffers: float16 is summed in float32
            started = time.monotonic()
            results = self.device().allreduce(
                items, wire, lambda contributors: _finalizer(meta, contributors))
            self._span(items, "ALLREDUCE", started)
            for (_, request), result in zip(items, results):
                _complete(request, result)
            return
        wire = _wire_dtype(meta.dtype, meta.wire)
        outputs = [_output_for(request, response.meta) for response, request in items]
        inputs = [request.tensor if request is not None else np.zeros(response.meta.shape, dtype)
                  for response, request in items]
        started = time.monotonic()
        if len(items) == 1 and wire == dtype:
            buffer = outputs[0].reshape(-1)
            if inputs[0] is not outputs[0]:
                buffer[...] = inputs[0].reshape(-1)
            ranges = None
        else:
            total = sum(array.size for array in inputs)
            buffer = self._fusion_view(wire, total)
            ranges = pack(inputs, buffer)
            self._span(items, "MEMCPY_IN_FUSION_BUFFER", started)
        algorithm = self.reducer
        segments = None  # the ring splits by position; only the servers place by tensor
        if algorithm is None:
            algorithm = self._algorithm_for(buffer.nbytes)
        else:
            segments = segments_of([response.name for response, _ in items],
                                   ranges or [(0, buffer.size)])
        prescale, finalize = _scaling(meta, algorithm.contributors)
        scale_into(buffer, prescale)
        collective_started = time.monotonic()
        algorithm.allreduce(buffer, KERNEL_OP[meta.op], finalize, segments=segments)
        self._span(items, "ALLREDUCE", collective_started)
        if ranges is not None:
            unpack_started = time.monotonic()
            unpack(buffer, ranges, outputs)
            self._span(items, "MEMCPY_OUT_FUSION_BUFFER", unpack_started)
        for (response, request), output in zip(items, outputs):
            _complete(request, output)

    # ---- an allreduce folded into the negotiation exchange -----------------------------

    def inline_bytes(self, response):
        """The bytes ``response`` (a lone allreduce) would put in a gathered negotiation row,
        or None where it must take the executor's own route (the same on every rank)."""
        if response.joined or response.error is not None:
            return None
        return self._foldable_bytes(response.meta)

    def inline_contribution(self, request, out):
        """Write this rank's prescaled wire buffer for ``request`` into the bytes ``out``;
        False if it does not fit them exactly (then it goes the usual way)."""
        meta = request.meta
        if self._foldable_bytes(meta) != out.nbytes:
            return False
        buffer = out.view(_wire_dtype(meta.dtype, meta.wire))
        buffer[...] = request.tensor.reshape(-1)
        scale_into(buffer, _scaling(meta, self.size)[0])
        return True

    def _foldable_bytes(self, meta):
        """The wire bytes of a host allreduce that the latency path would take, else None."""
        if self.reducer is not None or meta.kind != "allreduce" or meta.device != "cpu":
            return None
        nbytes = math.prod(meta.shape) * _wire_dtype(meta.dtype, meta.wire).itemsize
        return nbytes if nbytes < self.config.small_allreduce_bytes else None

    def finish_inline(self, response, request, rows):
        """Complete ``request`` from every rank's contribution (the uint8 ``rows``, one per
        rank): reduced in rank order, as the latency path reduces its gathered rows, so the
        result is bitwise what that path gives."""
        started = time.monotonic()
        meta = response.meta
        wire = _wire_dtype(meta.dtype, meta.wire)
        output = _output_for(request, meta)
        flat = output.reshape(-1)
        buffer = flat if wire == flat.dtype else np.empty(flat.size, dtype=wire)
        REDUCE_BY_NAME[KERNEL_OP[meta.op]].reduce(rows.view(wire), axis=0, out=buffer)
        finalize = _scaling(meta, self.size)[1]
        if finalize is not None:
            finalize(buffer)
        if buffer is not flat:
            flat[...] = buffer
        self._span([(response, request)], "ALLREDUCE", started)
        _complete(request, output)

    def _algorithm_for(self, nbytes):
        if nbytes < self.config.small_allreduce_bytes:
            return self.small
        threshold = self.config.hierarchical_threshold_bytes
        if self.hierarchical is not None and (
                self.config.hierarchical_allreduce or nbytes >= threshold):
            return self.hierarchical
        return self.ring

    def _fusion_view(self, dtype, count):
        needed = count * dtype.itemsize
        if self._fusion.nbytes < needed:
            self._fusion = np.empty(max(needed, min(self.config.fusion_threshold, 2 * needed)),
                                    dtype=np.uint8)
        return self._fusion[:needed].view(dtype)

    # ---- everything else ----------------------------------------------------------------

    def device(self):
        """The device collectives (imports numba on first use)."""
        if self._device is None:
            from .device import DeviceCollectives

            self._device = DeviceCollectives(self)
        return self._device

    def _run_other(self, response, request):
        started = time.monotonic()
        if request is not None and response.meta.device != "cpu":
            result = self.device().run_other(self._host_result, response, request)
        else:
            result = self._host_result(response, request)
        self._span([(response, request)], response.meta.kind.upper(), started)
        _complete(request, result)

    def _host_result(self, response, request):
        kind = response.meta.kind
        if kind == "barrier":
            return None
        if kind == "join":
            return response.last_joined
        run = {"broadcast": self._broadcast, "allgather": self._allgather,
               "alltoall": self._alltoall, "reducescatter": self._reducescatter}.get(kind)
        if run is None:
            raise HorovodInternalError(f"unknown collective kind {kind!r}")
        return run(response, request)

    def _broadcast(self, response, request):
        output = _output_for(request, response.meta)
        if output is not request.tensor:
            output[...] = request.tensor
        self.comm.Bcast([byte_view(output), MPI.BYTE], root=response.meta.root)
        return output

    def _allgather(self, response, request):
        meta = response.meta
        dim0s = [response.metas[rank].shape[0] for rank in range(self.size)]
        rest = tuple(meta.shape[1:])
        row_bytes = math.prod(rest) * np.dtype(meta.dtype).itemsize
        output = np.empty((sum(dim0s),) + rest, dtype=meta.dtype)
        counts = [dim0 * row_bytes for dim0 in dim0s]
        self.comm.Allgatherv([byte_view(request.tensor), MPI.BYTE],
                             [byte_view(output), counts, _displacements(counts), MPI.BYTE])
        return output

    def _alltoall(self, response, request):
        meta = response.meta
        rest = tuple(meta.shape[1:])
        row_bytes = math.prod(rest) * np.dtype(meta.dtype).itemsize
        sent_rows = [_splits_of(response.metas[rank], self.size) for rank in range(self.size)]
        received = [sent_rows[rank][self.rank] for rank in range(self.size)]
        output = np.empty((sum(received),) + rest, dtype=meta.dtype)
        send_counts = [rows * row_bytes for rows in sent_rows[self.rank]]
        recv_counts = [rows * row_bytes for rows in received]
        self.comm.Alltoallv(
            [byte_view(request.tensor), (send_counts, _displacements(send_counts)), MPI.BYTE],
            [byte_view(output), (recv_counts, _displacements(recv_counts)), MPI.BYTE])
        return (output, np.array(received, dtype=np.int64))

    def _reducescatter(self, response, request):
        meta = response.meta
        rest = tuple(meta.shape[1:])
        row_elems = math.prod(rest)
        row_bounds = chunk_bounds(meta.shape[0], self.size)
        bounds = [(start * row_elems, stop * row_elems) for start, stop in row_bounds]
        buffer = np.array(request.tensor, dtype=_wire_dtype(meta.dtype)).reshape(-1)
        scale_into(buffer, meta.prescale)
        self.ring.reducescatter(buffer, KERNEL_OP[meta.op], bounds, _finalizer(meta, self.size))
        start, stop = bounds[self.rank]
        rows = row_bounds[self.rank][1] - row_bounds[self.rank][0]
        output = buffer[start:stop].reshape((rows,) + rest).astype(meta.dtype, copy=True)
        return output

    def _span(self, items, activity, started):
        """Record ``activity`` from ``started`` until now for each (response, request)."""
        if self.timeline is not None:
            ended = time.monotonic()
            for response, _ in items:
                self.timeline.span(response.name, activity, started, ended)


def _hierarchical(comm, config):
    """The hierarchical allreduce for ``comm`` where it applies, else None (collective)."""
    if config.hierarchical_allreduce is False or (
            config.hierarchical_allreduce is None and config.hierarchical_threshold_bytes is None):
        return None
    layout = node_layout(comm)
    if layout[1] > 1 or config.hierarchical_allreduce:
        return Hierarchical(comm, config.ring_subchunk_bytes, layout)
    layout[0].Free()
    return None


def segments_of(names, ranges):
    """A bucket's tensors as ``(name, start, stop)``: how the parameter servers place them."""
    return [(name, start, stop) for name, (start, stop) in zip(names, ranges)]


# cached: numpy builds dtypes from names in Python, and these run on every allreduce
@functools.cache
def _dtype(dtype_name):
    return np.dtype(dtype_name)


@functools.cache
def _wire_dtype(dtype_name, chosen=""):
    """The dtype a tensor travels and is reduced in: the sender's choice (``Meta.wire``), or
    its own dtype, except float16."""
    dtype = np.dtype(chosen or dtype_name)
    # float16 sums accumulate in float32: an fp16 partial sum loses precision and overflows
    return np.dtype(np.float32) if dtype == np.float16 and not chosen else dtype


@functools.lru_cache(maxsize=1024)  # a training loop repeats the same few tensors
def _scaling(meta, contributors):
    """The factor applied before the reduction, and the finalizer applied after it."""
    if meta.wire and meta.op == Average:
        # a 16-bit wire sum could overflow where the average would not: divide first
        return meta.prescale / contributors, _finalizer(meta._replace(op=Sum), contributors)
    return meta.prescale, _finalizer(meta, contributors)


def _finalizer(meta, size):
    """The division (Average over ``size`` contributions) and postscale of a reduced piece."""
    postscale = meta.postscale
    if meta.op == Average:
        if np.dtype(meta.dtype).kind == "f":
            if postscale == 1.0:
                def finalize_divided(piece):
                    divide_into(piece, size)
                return finalize_divided
            factor = postscale / size

            def finalize(piece):
                scale_into(piece, factor)
            return finalize

        def finalize_integer(piece):
            divide_trunc(piece, size)
            scale_into(piece, postscale)
        return finalize_integer
    if postscale == 1.0:
        return None

    def finalize_scaled(piece):
        scale_into(piece, postscale)
    return finalize_scaled


def _output_for(request, meta):
    if request is not None and request.output is not None:
        return request.output
    return np.empty(meta.shape, dtype=meta.dtype)


def _complete(request, result):
    if request is None:
        return
    if request.writeback is not None:
        request.writeback[...] = result
        result = request.writeback
    request.handle.set_result(result)


def _splits_of(meta, size):
    if meta.splits is not None:
        return list(meta.splits)
    return [meta.shape[0] // size] * size


def _displacements(counts):
    displacements = [0] * len(counts)
    for index in range(1, len(counts)):
        displacements[index] = displacements[index - 1] + counts[index - 1]
    return displacements
