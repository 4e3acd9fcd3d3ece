"""Executes the negotiated responses of one cycle, the same way on every rank.

Allreduces that share dtype, op, scale factors, place and wire dtype are fused into
buckets of at most the fusion threshold, and each bucket takes the allreduce pipeline
(``allreduce.py``: latency path, ring, hierarchical or parameter servers by size and mode).
The other collectives run here one by one, through MPI on byte views of contiguous
buffers, in the place their tensor lives (``buffers.py``, ``device.py``).
"""

import math
import time

import numpy as np
from .._mpi import MPI

from .. import cores, faults, transport
from ..algorithms import compiled, cost
from ..algorithms.adasum import Adasum as AdasumAllreduce
from ..algorithms.halving import Rabenseifner, RecursiveDoubling
from ..algorithms.hierarchical import Hierarchical, node_layout
from ..algorithms.plan import chunk_bounds
from ..algorithms.ring import Ring
from ..algorithms.shared import SharedMemory, shm_quarter
from ..algorithms.small import GatherReduce
from ..errors import HorovodInternalError, PreconditionError
from ..kernels import pack, scale_into, unpack
from ..ops import KERNEL_OP, numpy_dtype
from .allreduce import AllreducePipeline, Route, complete, wire_dtype
from .scaling import scaling
from .buckets import assign, bucket_key
from .fold import shared_rows_budget


class Executor:
    """Runs responses on the data communicator; owns the algorithms and the allreduce
    pipeline."""

    def __init__(self, comm, config, timeline, reducer=None):
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.config = config
        self.timeline = timeline
        layout = node_layout(comm)  # (local communicator, nodes, smallest node's size)
        # the ring priced with compiled steps where every rank runs them (the choice of
        # algorithm by size must be the same on every rank)
        compiled_ring = comm.allreduce(compiled.expected(config.compiled_steps), op=MPI.LAND)
        # the cores this node's ranks may run on (their affinity, the cgroup's quota), and
        # ranks per core on the busiest node: an oversubscribed node's CPU work is priced so
        self.node_cores = cores.on_node(layout[0])
        contention = comm.allreduce(layout[0].Get_size() / self.node_cores, op=MPI.MAX)
        # the shared memory the fold's rows may take: the same on every rank
        self.rows_budget = comm.allreduce(shared_rows_budget(), op=MPI.MIN)
        across_nodes = layout[1] > 1
        def subchunk():  # the algorithms read their sub-chunk from the route at each call
            return self.allreduce.route.subchunk_bytes
        ring = Ring(comm, subchunk, piece_ceiling=lambda: self.allreduce.route.piece_ceiling)
        algorithms = {"ring": ring, "small": GatherReduce(comm), "adasum": AdasumAllreduce(comm),
                      "rabenseifner": Rabenseifner(comm, subchunk_bytes=subchunk),
                      "recursive_doubling": RecursiveDoubling(comm, subchunk_bytes=subchunk)}
        # every rank on one node: the ranks read each other's values in shared memory, in
        # segments that grow where ranks crowd the cores of a node with a large cache and its
        # shared memory holds them (the same on every rank: the smallest asked for)
        shared = 0
        if not across_nodes and self.size > 1 and config.shared_allreduce:
            cache = cores.last_level_cache()
            shared = comm.allreduce(cost.shared_segment_bytes(
                self.size, contention, shm_quarter() or 0, cache), op=MPI.MIN)
            # segments whose rows would outgrow the cache go around the node, above what the
            # fold's rows take ((2 size + 1) rows of a call) and the gathered path: the route
            # may move the latter, so it is read at each call
            cache = comm.allreduce(cache or 0, op=MPI.MIN)
            folded = self.rows_budget // (2 * self.size + 1)

            def around_above():
                return cost.shared_around_above(self.size, cache, folded,
                                                self.allreduce.route.small_bytes)
            algorithms["shared"] = SharedMemory(faults.track(layout[0].Dup()), shared,
                                                around_above=around_above if cache else None)
        hierarchical = None
        if reducer is not None:  # PS mode: every bucket goes through the parameter servers
            algorithms["ps"] = reducer
        else:
            hierarchical = _hierarchical(comm, config, layout, lambda: self.allreduce.route)
            if hierarchical is not None:
                algorithms["hierarchical"] = hierarchical
        if hierarchical is None:
            layout[0].Free()
        self.allreduce = AllreducePipeline(
            comm, config, algorithms, self.span,
            Route.configured(config, self.size, across_nodes, compiled_ring=compiled_ring,
                             contention=max(1.0, contention), shared=shared),
            across_nodes=across_nodes)

    def execute(self, responses, take, missed=None, cache_id=None):
        """Run ``responses`` in order; ``take(name)`` returns this rank's Request or None.

        ``missed(name)`` is told of each failed response this rank had no request for.
        ``cache_id(name)`` (None: uncached) orders the members of each fused allreduce
        bucket (``bucket_key``), the same on every rank whatever order the cycle listed them
        in, so that tensors laid out by it lie back to back (``Engine.reduction_order``).
        """
        ready = []
        now = time.monotonic()
        for response in responses:
            request = take(response.name)
            self.negotiated(response, request, now)
            if response.error is not None:
                if request is not None:
                    request.handle.set_error(PreconditionError(response.error))
                elif missed is not None:
                    missed(response.name)
                continue
            ready.append((response, request))
        # allreduces fuse; every other collective is a bucket of its own
        buckets = [ready] if len(ready) == 1 else [
            [ready[index] for index in bucket]
            for bucket in assign([response.meta for response, _ in ready],
                                 self.allreduce.route.fusion_threshold)]
        for bucket in buckets:
            if cache_id is not None and len(bucket) > 1:
                bucket.sort(key=lambda pair: bucket_key(pair[0].name, cache_id(pair[0].name)))
            with transport.activity(lambda bucket=bucket: _describe(bucket)):
                if bucket[0][0].meta.kind == "allreduce":
                    self.allreduce.run(bucket)
                else:
                    self._run_other(*bucket[0])

    def negotiated(self, response, request, now):
        """Record on the timeline how long ``request`` (None: this rank had none) waited from
        its submission for the ranks to agree on ``response``."""
        if request is not None and self.timeline is not None:
            self.timeline.span(response.name, "NEGOTIATE_" + response.meta.kind.upper(),
                               request.submitted, now, response.meta.kind)

    # ---- everything else ----------------------------------------------------------------

    def _run_other(self, response, request):
        started = time.monotonic()
        if request is not None and response.meta.device != "cpu":
            result = self.allreduce.device().run_other(self._verb, self.allreduce.host,
                                                       response, request)
        else:
            result = self._verb(response, request, self.allreduce.host)
        self.span([(response, request)], response.meta.kind.upper(), started)
        complete(request, result)

    def _verb(self, response, request, place):
        """Run a non-allreduce collective on buffers of ``place`` (host or device)."""
        kind = response.meta.kind
        if kind == "barrier":
            return None
        if kind == "join":
            return response.last_joined
        run = {"broadcast": self._broadcast, "allgather": self._allgather,
               "alltoall": self._alltoall, "reducescatter": self._reducescatter}.get(kind)
        if run is None:
            raise HorovodInternalError(f"unknown collective kind {kind!r}")
        return run(response, request, place)

    def _broadcast(self, response, request, place):
        output = request.output
        if output is None:
            output = place.new(response.meta.shape, response.meta.dtype)
        if output is not request.tensor:
            place.copy(output.reshape(output.size), request.tensor)
        self.comm.Bcast([place.flat_bytes(output), MPI.BYTE], root=response.meta.root)
        return output

    def _allgather(self, response, request, place):
        meta = response.meta
        dim0s = [response.metas[rank].shape[0] for rank in range(self.size)]
        rest = tuple(meta.shape[1:])
        row_bytes = math.prod(rest) * numpy_dtype(meta.dtype).itemsize
        shape = (sum(dim0s),) + rest
        counts = [dim0 * row_bytes for dim0 in dim0s]
        displacements = _displacements(counts)
        send = [place.flat_bytes(request.tensor), MPI.BYTE]
        given = request.output  # the caller's array, where it holds exactly the rows
        output = None
        if given is not None and given.size == math.prod(shape):
            output = given.reshape(shape)
            start, mine = output.ctypes.data, request.tensor.ctypes.data
            if mine == start + displacements[self.rank]:
                send = MPI.IN_PLACE  # the input is this rank's rows of the output already
            elif start < mine + request.tensor.nbytes and mine < start + output.nbytes:
                output = None  # the input lies elsewhere in the output: a buffer of its own
        if output is None:
            output = place.new(shape, meta.dtype)
        if counts.count(counts[0]) == self.size:
            # every rank the same rows (FSDP2's shards): MPICH's allgather moves 100 MB at 2
            # ranks in 16 ms in place, where its allgatherv took 80 (docs/torch_distributed.md)
            self.comm.Allgather(send, [place.flat_bytes(output), counts[0], MPI.BYTE])
        else:
            self.comm.Allgatherv(send, [place.flat_bytes(output), counts, displacements,
                                        MPI.BYTE])
        return output

    def _alltoall(self, response, request, place):
        meta = response.meta
        rest = tuple(meta.shape[1:])
        row_bytes = math.prod(rest) * numpy_dtype(meta.dtype).itemsize
        sent_rows = [_splits_of(response.metas[rank], self.size) for rank in range(self.size)]
        received = [sent_rows[rank][self.rank] for rank in range(self.size)]
        output = place.new((sum(received),) + rest, meta.dtype)
        send_counts = [rows * row_bytes for rows in sent_rows[self.rank]]
        recv_counts = [rows * row_bytes for rows in received]
        self.comm.Alltoallv(
            [place.flat_bytes(request.tensor), (send_counts, _displacements(send_counts)),
             MPI.BYTE],
            [place.flat_bytes(output), (recv_counts, _displacements(recv_counts)), MPI.BYTE])
        return (output, np.array(received, dtype=np.int64))

    def _reducescatter(self, response, request, place):
        meta = response.meta
        rest = tuple(meta.shape[1:])
        row_elems = math.prod(rest)
        row_bounds = chunk_bounds(meta.shape[0], self.size)
        bounds = [(start * row_elems, stop * row_elems) for start, stop in row_bounds]
        rows = row_bounds[self.rank][1] - row_bounds[self.rank][0]
        start, stop = bounds[self.rank]
        dtype = wire_dtype(meta.dtype, meta.wire)
        # in place (reducescatter_async_), a tensor that travels in its own dtype is reduced
        # where it lies and its rows are the result; anything else goes through a copy
        in_place = request.output is request.tensor and request.tensor.dtype == dtype
        prescale, finalize = scaling(meta, self.size)
        source = None  # out of place: the input, read where it lies by the ring
        if in_place:
            buffer = request.tensor.reshape(request.tensor.size)
        elif place is self.allreduce.host and request.tensor.dtype == dtype \
                and prescale == 1.0 and request.tensor.flags.c_contiguous:
            # the ring reads the input and writes its sums into a reused scratch buffer: no
            # copy of the input, no fresh pages (FSDP2's gradients: 100 MB a step)
            source = request.tensor.reshape(request.tensor.size)
            buffer = place.scratch(dtype, source.size)
        else:
            buffer = place.new(math.prod(meta.shape), dtype)
            pack([request.tensor], buffer)  # casts float16 up to its float32 wire dtype
        if source is None:
            scale_into(buffer, prescale)
        place.algorithms["ring"].reducescatter(buffer, KERNEL_OP[meta.op], bounds, finalize,
                                               source=source)
        if in_place:
            return buffer[start:stop].reshape((rows,) + rest)
        output = place.new((rows,) + rest, meta.dtype)
        unpack(buffer, [(start, stop)], [output])
        return output

    def close(self, clean=True):
        """Free the algorithms' communicators and windows and the data communicator
        (``clean`` False after a failure: nothing that waits for the peers)."""
        for algorithm in self.allreduce.host.algorithms.values():
            algorithm.free(clean)
        self.comm.Free()

    def span(self, items, activity, started):
        """Record ``activity`` from ``started`` until now for each (response, request)."""
        if self.timeline is not None:
            ended = time.monotonic()
            for response, _ in items:
                self.timeline.span(response.name, activity, started, ended,
                                   response.meta.kind)


def _hierarchical(comm, config, layout, route):
    """The hierarchical allreduce for ``comm`` where it applies, else None; it takes over
    ``layout`` (node_layout(comm)) when it is made; its rings read ``route()``'s
    sub-chunks."""
    tuned_from_off = config.autotune and config.autotune_from_set  # made, but starts off
    if config.hierarchical_allreduce is False and not tuned_from_off:
        return None
    nodes = layout[1]
    # automatic: several nodes, and fewer nodes than ranks (one rank per node gains nothing)
    if config.hierarchical_allreduce or 1 < nodes < comm.Get_size():
        return Hierarchical(comm, lambda: route().node_subchunk_bytes, layout,
                            cross_subchunk_bytes=lambda: route().cross_subchunk_bytes,
                            cross_piece_ceiling=lambda: route().cross_piece_ceiling)
    return None


def _splits_of(meta, size):
    if meta.splits is not None:
        return list(meta.splits)
    return [meta.shape[0] // size] * size


def _displacements(counts):
    displacements = [0] * len(counts)
    for index in range(1, len(counts)):
        displacements[index] = displacements[index - 1] + counts[index - 1]
    return displacements


def _describe(items):
    """The collective as the stall watchdog names it: its kind and tensor names."""
    names = [response.name for response, _ in items]
    shown = ", ".join(f"'{name}'" for name in names[:3]) + (", ..." if len(names) > 3 else "")
    kind = items[0][0].meta.kind
    return f"{kind} of {shown}" if len(names) == 1 else f"{kind} of {len(names)} tensors ({shown})"
