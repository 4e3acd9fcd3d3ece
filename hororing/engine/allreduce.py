"""The allreduce pipeline: one route for a fused bucket, host or device.

For a bucket of negotiated allreduces (same dtype, op, scale factors, place and wire dtype):
wait for the inputs, fuse them into one flat buffer (a lone tensor is reduced in its output
directly, and out of place the algorithm reads the input itself: no copy of it is made
first; in-place tensors that lie back to back in memory are reduced there), prescale,
choose the algorithm by size, reduce, unpack, complete the handles.
Where the buffers live is a *place* (``buffers.HostBuffers``, ``device.DeviceBuffers``): the
pipeline asks it for inputs, outputs, the fusion buffer and its algorithms, and never
branches on host or device itself.

The algorithm kind for a buffer of n bytes: ``adasum`` for op=Adasum (whatever the size or
mode), ``ps`` in parameter-server mode, else the cost model's choice for n bytes over this
many ranks (``Route.table``, ``algorithms/cost.py``): ``small`` (gather and reduce, one
MPI call; only below the small-message threshold, ``Route.small_bytes``, by default
1 MiB / ranks), ``recursive_doubling``, the ``ring`` or ``rabenseifner``; where that is the
ring or Rabenseifner's, ``hierarchical`` instead when the job spans nodes and n reaches the
hierarchical threshold (``Route.hierarchical_bytes``). At 2 and 3 ranks the model picks
``small`` below the threshold and the ring above; from 4 ranks the halving algorithms
take over where their fewer steps pay. Where every rank is on one node, ``shared`` (the
ranks read each other's values in a shared-memory window) takes what the model gives a
message algorithm below ``cost.SHARED_LARGEST_BYTES``, or at every size where ranks crowd
the cores (``cost.shared_segment_bytes``).
``force(kind)`` overrides the choice (tests and benchmarks); ``observers`` are told of each
buffer handed to an algorithm.

Every setting that routes an allreduce (those thresholds, the fusion threshold, which also
caps the fusion buffer's growth, the cycle time, the rings' sub-chunks, a forced algorithm)
is one value, the pipeline's ``route``: the autotuner and ``force`` replace it whole, the
rings read their sub-chunk from it at each call, and what is worked out from it (the fold's
plans, the optimizers' gradient buckets) is kept with the route's ``version``.
"""

import contextlib
import functools
import math
import time
from typing import NamedTuple, Optional

import numpy as np

from ..algorithms import cost
from ..kernels import pack, scale_into, unpack
from ..algorithms.segmented import Segmented
from ..ops import Adasum, KERNEL_OP, numpy_dtype
from .buffers import HostBuffers
from .scaling import scaling
from .segments import lay_out, plan as segment_plan, split_pays

class Route(NamedTuple):
    """The settings in effect for routing allreduces; replaced whole, never changed."""

    version: int           # counts replacements: what was worked out under an older one is stale
    fusion_threshold: int  # the most bytes a fused bucket holds
    cycle_time_ms: float   # how long the background thread lets submissions gather
    small_bytes: int       # below it, a bucket takes the latency path
    subchunk_bytes: int    # the pipelining chunk of the flat ring (host and device)
    node_subchunk_bytes: int   # ... of the hierarchical allreduce's ring within a node
    cross_subchunk_bytes: int  # ... of its ring across nodes
    hierarchical: bool     # the hierarchical allreduce may run (where the job has one)
    hierarchical_bytes: int  # from this size up (where it may run)
    forced: Optional[str] = None  # every bucket takes this algorithm (tests, benchmarks)
    table: tuple = ()  # ((below bytes, kind), ...): the cost model's choice by size
    hook_bucket_bytes: int = 0  # the most bytes a bucket handed to a comm hook holds (0: none)
    # the flat ring's pieces grow up to this, a chunk keeping plan.RING_MIN_PIECES of them (0:
    # pieces of subchunk_bytes); and the same for the hierarchical allreduce's ring across nodes
    piece_ceiling: int = 0
    cross_piece_ceiling: int = 0
    # bucket members of this many bytes are reduced where they lie on the host ring, the
    # small ones between them packed (segments.py; 0: every member packed)
    member_bytes: int = 0
    compiled_ring: bool = False  # the table priced the ring's steps compiled
    contention: float = 1.0  # ... and the CPU's work at this many ranks per core
    # ... and offered the allreduce through the node's shared memory in segments of this many
    # bytes (0: the job has none)
    shared: int = 0

    def bucket_bytes(self, hooked=False):
        """The most bytes an optimizer's gradient bucket holds: the fusion threshold, and
        for buckets handed to a comm hook no more than ``hook_bucket_bytes`` either."""
        if hooked and self.hook_bucket_bytes:
            return min(self.fusion_threshold, self.hook_bucket_bytes)
        return self.fusion_threshold

    @classmethod
    def configured(cls, config, size, across_nodes, compiled_ring=False, contention=1.0,
                   shared=0):
        """The route ``config`` sets for a job of ``size`` ranks (``compiled_ring``: every
        rank can run the ring's compiled steps; ``contention``: ranks per core on the
        busiest node, at least 1; ``shared``: the shared-memory allreduce's segment bytes,
        0 where the job has none)."""
        threshold = config.hierarchical_threshold_bytes
        small_bytes = config.small_threshold(size, across_nodes)
        subchunk_bytes = config.subchunk_bytes(across_nodes=across_nodes)
        piece_ceiling = config.piece_ceiling(across_nodes=across_nodes)
        return cls(
            version=0, fusion_threshold=config.fusion_threshold,
            hook_bucket_bytes=config.hook_bucket_bytes, cycle_time_ms=config.cycle_time_ms,
            small_bytes=small_bytes, subchunk_bytes=subchunk_bytes,
            table=algorithm_table(size, across_nodes, small_bytes, subchunk_bytes,
                                  piece_ceiling, compiled_ring, contention, shared),
            compiled_ring=compiled_ring, contention=contention, shared=shared,
            node_subchunk_bytes=config.subchunk_bytes(across_nodes=False),
            cross_subchunk_bytes=config.subchunk_bytes(across_nodes=True),
            piece_ceiling=piece_ceiling,
            cross_piece_ceiling=config.piece_ceiling(across_nodes=True),
            member_bytes=(in_place_member_bytes(size, across_nodes)
                          if config.in_place_member_bytes < 0 else config.in_place_member_bytes),
            # False: the flat ring where hierarchical would run (HOROVOD_HIERARCHICAL_
            # ALLREDUCE=0 under autotuning from the set values, or the autotuner's choice)
            hierarchical=config.hierarchical_allreduce is not False,
            # asked for outright, or no threshold: every bucket the ring would take
            hierarchical_bytes=0 if config.hierarchical_allreduce or threshold is None
            else threshold)


def _links(size, across_nodes):
    """The link between ranks and the ranks per node the cost model prices a job with: 10
    Gbit/s Ethernet between nodes, or a node's memory, shared by every rank, where the job is
    on one node."""
    if across_nodes:
        return cost.PRESETS["10gbe"], 1
    return cost.PRESETS["shm"], size


def in_place_member_bytes(size, across_nodes):
    """The cost model's size from which a bucket member is reduced where it lies."""
    return cost.in_place_member_bytes(size, cost.HOST, _links(size, across_nodes)[0])


def algorithm_table(size, across_nodes, small_bytes, subchunk_bytes, piece_ceiling=0,
                    compiled_ring=False, contention=1.0, shared=0):
    """The cost model's choice of algorithm by size for ``size`` ranks (``cost.choices``):
    the fitted host constants (``cost.HOST``; ``cost.COMPILED_RING`` where the ring's steps
    are compiled on every rank), a node's memory as the link within it (shared by every rank
    where the job is on one node) and 10 Gbit/s Ethernet between nodes; ``contention``:
    ranks per core on the busiest node, where it has more ranks than cores; ``shared``: the
    segment bytes of the job's allreduce through the node's shared memory (0: none), which
    takes the sizes below ``cost.SHARED_LARGEST_BYTES`` that a message algorithm would, or
    every size with segments as large as ``cost.SHARED_CROWDED_SEGMENT_BYTES``
    (``cost.with_shared``, ``cost.shared_largest``).
    The same on every rank: it depends on nothing measured at run time, and its inputs are
    agreed."""
    far, per_node = _links(size, across_nodes)
    host = cost.COMPILED_RING if compiled_ring else cost.HOST
    table = cost.choices(size, host, far, cost.PRESETS["shm"], per_node=per_node,
                         small_bytes=small_bytes, subchunk_bytes=subchunk_bytes,
                         piece_ceiling=piece_ceiling, contention=contention)
    return cost.with_shared(table, cost.shared_largest(shared)) if shared else table


class AllreducePipeline:
    """Runs allreduce buckets on one communicator, on host or device buffers."""

    def __init__(self, comm, config, algorithms, span, route, across_nodes=False):
        """``algorithms``: the host algorithms by kind (their rings read their sub-chunks
        from ``self.route``); ``span(items, activity, started)`` records a timeline activity;
        ``route``: the first Route (``Route.configured``); ``across_nodes``: the ranks span
        several nodes."""
        self.comm = comm
        self.config = config
        self.host = HostBuffers(algorithms, config.output_pool_bytes)
        self.observers = []  # observer(kind, buffer) before each reduction
        self._span = span
        self._device = None
        self.route = route
        self.across_nodes = across_nodes
        self._splits = {}  # (segment counts, itemsize, route version) -> _split_pays

    def reroute(self, **changes):
        """Replace the route by one with ``changes`` (Route's fields), for every bucket from
        now on. Call it on every rank between the same collectives."""
        self.route = self.route._replace(version=self.route.version + 1, **changes)

    def device(self):
        """The device place; made on the first device collective (it imports numba)."""
        if self._device is None:
            from .device import DeviceBuffers

            self._device = DeviceBuffers(self.comm, self.config, self.host.algorithms,
                                         one_node=not self.across_nodes)
        return self._device

    def place_of(self, meta):
        return self.host if meta.device == "cpu" else self.device()

    def force(self, kind):
        """Reduce every bucket with algorithm ``kind`` (None: choose by size again)."""
        if kind is not None and kind not in self.host.algorithms:
            available = ", ".join(sorted(self.host.algorithms))
            raise ValueError(f"no {kind!r} allreduce in this job (available: {available}; "
                             f"hierarchical needs several nodes or HOROVOD_HIERARCHICAL_"
                             f"ALLREDUCE=1, ps needs HORORING_MODE=ps)")
        self.reroute(forced=kind)

    @contextlib.contextmanager
    def watch(self):
        """Record ``(kind, dtype name, element count)`` of every buffer handed to an algorithm
        while the block runs (a fused bucket is one buffer)."""
        seen = []

        def record(kind, buffer):
            seen.append((kind, buffer.dtype.name, buffer.size))
        self.observers.append(record)
        try:
            yield seen
        finally:
            self.observers.remove(record)

    def device_transport(self):
        """How device buckets travel: ``"direct"`` (the ranks of one node reduce in each
        other's device memory), ``"cuda-aware"`` (MPI reads device memory) or ``"staged"``
        (through pinned host memory). Imports numba."""
        return self.device().transport

    def hierarchical_stats(self):
        """The hierarchical allreduce's shape and traffic, or None where it is not in use."""
        hierarchical = self.host.algorithms.get("hierarchical")
        if hierarchical is None:
            return None
        return {"nodes": hierarchical.nodes, "local_size": hierarchical.local_size,
                "parts": hierarchical.parts, "cross_bytes_sent": hierarchical.cross_bytes_sent()}

    def apply_settings(self, settings):
        """Route by the autotuner's ``settings`` (tuning.Settings) from now on."""
        subchunk = settings.subchunk_bytes  # one size for every ring, its pieces' exact size
        small_bytes = settings.small_total_bytes // self.comm.Get_size()
        self.reroute(fusion_threshold=settings.fusion_threshold,
                     cycle_time_ms=settings.cycle_time_ms, small_bytes=small_bytes,
                     subchunk_bytes=subchunk, node_subchunk_bytes=subchunk,
                     cross_subchunk_bytes=subchunk, piece_ceiling=0, cross_piece_ceiling=0,
                     hierarchical=settings.hierarchical,
                     table=algorithm_table(self.comm.Get_size(), self.across_nodes,
                                           small_bytes, subchunk,
                                           compiled_ring=self.route.compiled_ring,
                                           contention=self.route.contention,
                                           shared=self.route.shared))

    def has(self, kind):
        """Whether this job has an allreduce algorithm ``kind`` (``hierarchical`` only where
        the job spans nodes or it is asked for; ``ps`` in PS mode)."""
        return kind in self.host.algorithms

    def hierarchical_runs(self):
        """Whether the hierarchical allreduce runs where sizes call for it."""
        return self.route.hierarchical and "hierarchical" in self.host.algorithms

    def kind_for(self, nbytes):
        """The algorithm kind for a buffer of ``nbytes`` (the same on every rank)."""
        route = self.route
        if route.forced is not None:
            return route.forced
        algorithms = self.host.algorithms
        if "ps" in algorithms:
            return "ps"
        kind = cost.lookup(route.table, nbytes)
        if kind in _BANDWIDTH and route.hierarchical and nbytes >= route.hierarchical_bytes \
                and "hierarchical" in algorithms:
            return "hierarchical"
        return kind

    def run(self, items):
        """Reduce the bucket ``items`` ((response, request) pairs; request None on a rank
        that joined) and complete each request."""
        meta = items[0][0].meta
        place = self.place_of(meta)
        place.prepare(items)
        dtype = numpy_dtype(meta.dtype)
        reduce_dtype = wire_dtype(meta.dtype, meta.wire)
        inputs = [place.input(response, request, dtype) for response, request in items]
        outputs = [place.output(response, request, dtype, source)
                   for (response, request), source in zip(items, inputs)]
        started = time.monotonic()
        source = None  # out of place: the input, read by the algorithm
        packed = False  # the bucket went into the fusion buffer: unpack it after
        unpacking = None  # segments: the packed runs to unpack after
        split = False  # segments reduced one by one
        if len(items) == 1 and reduce_dtype == dtype:
            buffer = outputs[0].reshape(outputs[0].size)
            if inputs[0] is not outputs[0]:
                source = inputs[0].reshape(inputs[0].size)
            ranges = [(0, buffer.size)]
        else:
            # large members are reduced where they lie (the ring cuts its pieces at their
            # ends), gradients that live in one flat tensor, back to back in bucket order,
            # too; anything else is packed into the fusion buffer
            buffer = self._segmented(items, place, dtype, reduce_dtype, inputs, outputs)
            if buffer is not None:
                buffer, unpacking, split = buffer
                ranges = None  # only the ring takes segments: it splits by position
            elif reduce_dtype == dtype:
                buffer = place.span(inputs, outputs)
            if buffer is None:
                buffer = place.fusion_view(reduce_dtype, sum(array.size for array in inputs),
                                           self.route.fusion_threshold)
                ranges = pack(inputs, buffer)
                packed = True
                self._span(items, "MEMCPY_IN_FUSION_BUFFER", started)
            elif unpacking is None:
                ends = np.cumsum([array.size for array in inputs]).tolist()
                ranges = list(zip([0] + ends[:-1], ends))
        # a bucket in segments the cost model prices cheaper one by one: a reduction each
        for part in buffer.parts if split else (buffer,):
            self._reduce(items, meta, place, part, source, ranges)
        if packed or unpacking:
            unpack_started = time.monotonic()
            for view, view_ranges, view_outputs in unpacking or [(buffer, ranges, outputs)]:
                unpack(view, view_ranges, view_outputs)
            self._span(items, "MEMCPY_OUT_FUSION_BUFFER", unpack_started)
        place.finish()
        for (_, request), output in zip(items, outputs):
            complete(request, place.result(request, output))

    def _reduce(self, items, meta, place, buffer, source, ranges):
        """Reduce one flat ``buffer`` (or ``Segmented`` one) of the bucket ``items`` with the
        algorithm its size calls for (out of place from ``source`` where given)."""
        kind = "adasum" if meta.op == Adasum else self.kind_for(buffer.nbytes)
        algorithm = place.algorithms[kind]
        segments = None  # the ring and shared split by position; servers, Adasum by tensor
        if kind in ("ps", "adasum"):
            segments = [(response.name, start, stop) for (response, _), (start, stop)
                        in zip(items, ranges)]
        prescale, finalize = scaling(meta, algorithm.contributors)
        if source is not None and (prescale != 1.0
                                   or not algorithm.out_of_place):
            place.copy(buffer, source)  # the input is never scaled where it lies
            source = None
        for part in buffer.parts if isinstance(buffer, Segmented) else (buffer,):
            scale_into(part, prescale)
        for observe in self.observers:
            observe(kind, buffer)
        collective_started = time.monotonic()
        if source is None:
            algorithm.allreduce(buffer, KERNEL_OP[meta.op], finalize, segments=segments)
        else:
            algorithm.allreduce(buffer, KERNEL_OP[meta.op], finalize, segments=segments,
                                source=source)
        self._span(items, "ALLREDUCE", collective_started)

    def _segmented(self, items, place, dtype, reduce_dtype, inputs, outputs):
        """A host bucket with members of the route's ``member_bytes`` or more, which the
        ring reduces, laid out in segments (``segments.py``): ``(buffer, unpacking, split)``,
        ``split`` where the cost model prices a reduction per segment below one ring over
        them all; else None. Decided by the members' sizes, the same on every rank."""
        if place is not self.host or reduce_dtype != dtype or items[0][0].meta.op == Adasum:
            return None
        plan = segment_plan([array.size for array in inputs], reduce_dtype.itemsize,
                            self.route.member_bytes)
        if plan is None or self.kind_for(plan[-1].stop * reduce_dtype.itemsize) \
                not in _SEGMENTED:
            return None
        started = time.monotonic()
        buffer, unpacking = lay_out(
            plan, inputs, outputs, place,
            lambda count: place.fusion_view(dtype, count, self.route.fusion_threshold))
        if unpacking:
            self._span(items, "MEMCPY_IN_FUSION_BUFFER", started)
        split = self._split_pays(tuple(segment.stop - segment.start for segment in plan),
                                 reduce_dtype.itemsize, self.route)
        return buffer, unpacking, split

    def _split_pays(self, counts, itemsize, route):
        """Whether a reduction per segment of ``counts`` elements, each by the algorithm its
        size calls for, is priced at least ``cost.MARGIN`` below one ring over them all
        (many ranks of one node: a smaller ring's messages stay in the caches). Worked out
        once per bucket shape and route."""
        key = (counts, itemsize, route.version)
        pays = self._splits.get(key)
        if pays is None:
            if len(self._splits) >= 64:  # a training loop repeats a few buckets
                self._splits.clear()
            pays = self._splits[key] = self._priced_split(counts, itemsize, route)
        return pays

    def _priced_split(self, counts, itemsize, route):
        if route.forced is not None or self.hierarchical_runs():
            return False
        if cost.lookup(route.table, sum(counts) * itemsize) == "shared":
            return False  # it goes segment by segment anyway
        size = self.comm.Get_size()
        far, per_node = _links(size, self.across_nodes)
        return split_pays(counts, itemsize, route, size, far, per_node)


# where the hierarchical allreduce may stand in (the shared-memory allreduce only where it
# is asked for on one node: HOROVOD_HIERARCHICAL_ALLREDUCE=1)
_BANDWIDTH = ("ring", "rabenseifner", "shared")
_SEGMENTED = ("ring", "shared")  # the algorithms that reduce a bucket laid out in segments


# cached: numpy builds dtypes from names in Python, and this runs on every allreduce
@functools.cache
def wire_dtype(dtype_name, chosen=""):
    """The dtype a tensor travels and is reduced in: the sender's choice (``Meta.wire``), or
    its own dtype, except the 16-bit floats.

    A 16-bit wire (a compressor's choice) halves the bytes: every hop widens what it
    receives to float32, adds, and rounds the sum to 16 bits before it is sent on."""
    dtype = numpy_dtype(chosen or dtype_name)
    # 16-bit sums of the tensors' own accumulate in float32: a 16-bit partial sum loses
    # precision (and float16 overflows)
    return np.dtype(np.float32) if dtype.name in _HALF and not chosen else dtype


_HALF = ("float16", "bfloat16")


def wire_bytes(meta):
    """The bytes ``meta``'s tensor occupies in a bucket."""
    return math.prod(meta.shape) * wire_dtype(meta.dtype, meta.wire).itemsize


def moved_bytes(responses):
    """The bytes a cycle's ``responses`` moved (what the autotuner scores by)."""
    return sum(wire_bytes(response.meta) for response in responses if response.meta.dtype)


def complete(request, result):
    """Hand ``result`` to ``request``'s handle (through its writeback array, if any)."""
    if request is None:
        return
    if request.writeback is not None:
        request.writeback[...] = result
        result = request.writeback
    request.handle.set_result(result)
