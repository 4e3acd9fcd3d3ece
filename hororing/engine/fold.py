"""A lone small allreduce that repeats, folded into the negotiation exchange: the whole of it,
the exchange's side (``Fold``, which the cycle runs) and the data's (``LatencyFolding``: what
a rank contributes, and the allreduce completed from every rank's row, which the engine runs
when the cycle says the fold was agreed).

A loop of blocking small allreduces runs one per cycle. Once the cycles since the last busier
one each ran one lone allreduce on the latency path, and the size of the last came before
among them (a loop), the next cycle starts with an allgather of rows (fields, data) instead
of the vote: each rank's fields say "folded" and the cache id of the one allreduce it has
waiting, and its data is that allreduce's contribution, in the first bytes of its row. The
rows are as wide as the widest of the last few lone allreduces (``Fold.predict``), so a loop
reducing tensors of different sizes in turn (a scalar loss and a vector of metrics) folds
each of them; the cache id names the call, and so how many of a row's bytes it fills. Where
the rows cross nodes, a call narrower than the rows folds only while what the rows carry
beyond it stays within ``MIXED_EXTRA_BYTES``. When every rank's fields agree, the
allreduce is complete in that one exchange (the executor reduces the rows in rank order, as
the latency path would); otherwise the rows are discarded and the cycle goes on to the
vote. Whether to fold is decided from the responses alone, so every rank decides alike.
Where every rank is on one node, rows of 8 KiB and more (of every width where every rank runs
the compiled cycle and the barrier waits on the window's flags: ``exchange.SHARED_ROWS_MIN``)
are not gathered: each rank writes its row into the node's shared memory and the exchange is
a barrier (``exchange.SharedRows``); the rows, and so the bits, are the same. There the fold
also takes the sizes the shared-memory allreduce would (``algorithms/shared.py``, where the
rows fit ``shared_rows_budget``; not where the rows are gathered), and rows of
``chunked_bytes`` or more are reduced as that allreduce reduces them: rank r combines chunk
r of every row, in rank order, into a result row, and after a second barrier every rank
copies the result out (``_Chunked``; a lane's compiled cycle the same,
``algorithms/compiled/folded.py``), so no rank reduces all n rows. The ranks
agree on the fold from the same fields before any of them reduces, so all enter the second
barrier or none does.
"""

import time
from typing import NamedTuple, Optional

import numpy as np

from ..algorithms.compiled import FOLD_ASKED, FOLD_READY, fold_entry
from ..algorithms.plan import chunk_bounds
from ..algorithms.shared import SHM_PATH, shm_quarter
from ..algorithms.small import REDUCE_BY_NAME, reduce_rows
from ..kernels import scale_into
from ..ops import Adasum, KERNEL_OP, numpy_dtype
from .allreduce import complete, wire_bytes, wire_dtype
from .buffers import OutputPool
from .compiled_fold import CompiledFold
from .scaling import plain_divisor, scaling

# what a lane's cycle gives in place of the rows where it ran compiled and reduced them into
# the output (finalized only by the plan's divisor: ``after_compiled`` is left to apply), or
# reduced and finalized them (rows reduced chunk by chunk: each chunk finalized in the cycle)
REDUCED = "reduced"
FINALIZED = "finalized"
FIELDS = 2  # all ones (or 0: not this time), the cache id (or -1)
_HEAD = FIELDS * 8
# shared rows of this many data bytes or more are reduced chunk by chunk (``_Chunked``);
# smaller ones whole by every rank, with one barrier a call. Whole rows move a rank's row
# in and every other row through each rank's caches; chunks move the others' share of its
# row in (a compiled cycle reads its own chunk where its input lies), the others' share of
# its chunk and of the result through, and wait for a second barrier. Where each rank has a
# core that barrier is a few microseconds: at 2 ranks 1 MiB ran 0.87-1.12 of MPI_Allreduce's
# speed in chunks against 0.74-0.75 whole, 256 KiB 1.00-1.50 against 0.93-1.31, 64 KiB the
# same within the spread (docs/benchmarks.md, "A rank's own chunk where it lies"). Where
# ranks crowd the cores a barrier waits for their turns on them: at 3 ranks on 2 cores
# chunks still won from 256 KiB (1 MiB 1.48-1.75 against 1.43-1.44), as from 4 ranks before
CHUNKED_BYTES = 32 * 1024
CROWDED_CHUNKED_BYTES = 256 * 1024

# the most shared memory the rows of a fold above the latency threshold may take (two sets of
# a row per rank and the result row): a quarter of what the node's /dev/shm had free when the
# job started (the MPI's own shared memory and the shared allreduce's come out of it too, and
# a container's is often 64 MiB, which 16 ranks' 2 MiB rows alone would exceed), at most
# SHARED_ROWS_MOST; SHARED_ROWS_BUDGET where it cannot be read
SHARED_ROWS_BUDGET = 16 << 20
SHARED_ROWS_MOST = 64 << 20

# the lone allreduces (their bytes) the rows' width is taken from: the widest of the last
# this many that went the usual way. Calls that fold are not counted (a lane's cycle runs no
# Python it need not); a call of a loop that misses its fold (a peer's cycle started before
# its caller called) is. A loop of a few tensors in turn keeps its widest among them, and
# the rows are not made again at each miss
RECENT_LONE = 8
# rows for calls of different sizes are a multiple of this many bytes wide, so that every
# rank's data starts aligned for any dtype (rows for one size are that size, as before)
ROW_ALIGN = 16
# where the rows cross nodes, the most bytes a narrower call's rows may carry beyond its own
# data, summed over the ranks: each call folded saves a vote cycle at the price of the rows'
# extra bytes. At 4 ranks across 2 emulated hosts (1 Gbit/s links), two tensors in turn,
# 16 KiB and 16 bytes (64 KiB carried beyond the narrower) ran 0.29-0.30 of MPI_Allreduce's
# speed folded against 0.24-0.25 the usual way, 32 KiB and 32 bytes (128 KiB) 0.31-0.35
# against 0.21-0.28 (docs/benchmarks.md, "Tensors of different sizes in turn"); more was
# not measured. Within a node the extra bytes are a copy in memory (or not moved at all:
# shared rows), and any width folds
MIXED_EXTRA_BYTES = 128 * 1024


def chunked_bytes(contention):
    """The smallest shared rows (data bytes) reduced chunk by chunk, ``contention`` the
    ranks per core on the node (``Route.contention``, the same on every rank)."""
    return CHUNKED_BYTES if contention <= 1.0 else CROWDED_CHUNKED_BYTES


def shared_rows_budget(path=SHM_PATH):
    """This node's budget for the fold's shared rows, in bytes (see above). Every rank of a
    job must use the same: the executor agrees on the smallest."""
    quarter = shm_quarter(path)
    return SHARED_ROWS_BUDGET if quarter is None else min(SHARED_ROWS_MOST, quarter)


class Fold:
    """The fold's state on one rank: whether the next cycle folds, and its buffers.
    ``folding``: the data's side (``LatencyFolding``, or a stand-in in tests)."""

    def __init__(self, exchange, folding):
        self._exchange_with = exchange  # the negotiation's (exchange.py)
        self.size = exchange.size
        self._folding = folding
        self.bytes = None  # the data bytes of the next cycle's rows (None: no fold)
        self.least = None  # the fewest bytes a call folded in them may have
        self._recent = ()  # the bytes of the last lone allreduces (RECENT_LONE at most)
        self._width = 0  # the rows' bytes, head included (0: no rows made)
        self._turns = None  # shared rows: each set's views, used in turn (else None)
        self._turn = 0
        self._row = self._fields = None  # this rank's row, and its fields
        self._heads = None  # every rank's fields, in the gathered rows
        self._data = None  # this rank's contribution, in its row
        self.gathered = None  # every rank's contribution once exchanged: (size, bytes) uint8
        self.received_bytes = 0  # what one exchange of the rows receives
        self._exchange = None  # the repeated allgather of the rows, or the SharedRows
        self._compiled = None  # the rows' cycle in one compiled call (compiled_fold.py)
        # the rows are reduced chunk by chunk (``_Chunked``): each rank's chunk of the shared
        # result is finalized before the others copy it, by whichever steps that rank runs,
        # so a compiled cycle's result is FINALIZED
        self._chunks = False

    def predict(self, responses):
        """Fold the next cycle when the cycles that ran anything since the last that ran
        more each ran one lone allreduce that the latency path would take, and this one's
        size came before among them (a loop: a cycle of several calls between lone ones, as
        asynchronous calls give, would waste the fold's exchange): in rows as wide as the
        widest of the last ``RECENT_LONE`` such allreduces, which take calls of ``least``
        bytes up to that width. Where their sizes differ and the rows cross nodes, every one
        of them must fit within ``MIXED_EXTRA_BYTES`` (else the rows are the last size where
        it repeats). The same on every rank: it is decided from the responses alone.
        Rows of another width are made here (collective: a shared window is made and freed
        with the node's barriers), in the cycle every rank has reached, and not when the
        next cycle starts: a rank starts that one for its own news before waking its peers,
        and a peer with none would never come to the window's barrier."""
        lone = None
        if len(responses) == 1:
            lone = self._folding.lone_bytes(responses[0])
        if lone is None:
            self._recent = ()
            self.bytes = self.least = None
            return
        recent = self._recent = self._recent[1 - RECENT_LONE:] + (lone,)
        if lone not in recent[:-1]:  # not yet a loop: nothing repeats since a busier cycle
            self.bytes = self.least = None
            return
        widest, narrowest = max(recent), min(recent)
        if widest == narrowest:
            self.bytes = self.least = lone
        else:
            width = -(-widest // ROW_ALIGN) * ROW_ALIGN
            least = 0 if self._within_node() else width - MIXED_EXTRA_BYTES // self.size
            if narrowest >= least:
                self.bytes, self.least = width, least
            else:
                self.bytes = self.least = lone if recent[-2] == lone else None
        if self.bytes is not None and self._width != _HEAD + self.bytes:
            self._make(_HEAD + self.bytes)

    def _within_node(self):
        """Whether every rank is on one node (an exchange in one process: True). Collective
        the first time the exchange is asked: ``predict`` asks on every rank alike."""
        one_node = getattr(self._exchange_with, "one_node", None)
        return True if one_node is None else one_node()

    def start(self, waiting, plan=None):
        """Fill this rank's row and start the exchange of every rank's row; return the
        request to wait on. ``waiting``: the one cached request this rank has waiting and
        may fold (None: this rank's row says "not this time"); ``plan``: its plan, where the
        caller holds it (a lane). The same cycle on every rank."""
        turns = self._turns
        if turns is not None:  # shared rows: the other set (a rank writes one set while a
            # slow peer may still read the last), taken without a call: a lone call's path
            turn = self._turn = self._turn ^ 1
            self._row, self._fields, self._data, self.gathered, self._heads = turns[turn]
        fields = self._fields
        if waiting is not None and \
                self._folding.contribute(waiting, self._data, plan, self.least):
            fields[0], fields[1] = -1, waiting.cache_id
        else:
            fields[0], fields[1] = 0, -1  # a row of zeros is never agreed on
        return self._exchange.start()

    def _make(self, width):
        """The rows' buffers and exchange for rows of ``width`` bytes (collective)."""
        self._release()
        self._width = width
        self.received_bytes = self.size * width
        shared_rows = getattr(self._exchange_with, "shared_rows", None)  # not in-process
        shared = shared_rows(width) if shared_rows is not None else None
        if shared is not None:
            self._exchange = shared
            least = chunked_bytes(self._folding.contention)
            chunked = shared if width - _HEAD >= least else None
            rank = self._exchange_with.rank
            self._turns = [self._views(rows[rank], rows, chunked) for rows in shared.sets]
            self._chunks = chunked is not None
            self._compiled = CompiledFold.shared(
                [(rows[rank], rows) for rows in shared.sets], shared.window,
                None if chunked is None else shared.result[_HEAD:], shared.rank)
            return
        rows = np.empty((self.size, width), dtype=np.uint8)  # every rank's row, gathered
        row = np.zeros(width, dtype=np.uint8)
        self._row, self._fields, self._data, self.gathered, self._heads = \
            self._views(row, rows)
        self._exchange = self._exchange_with.repeated("allgather", row, rows)
        self._compiled = CompiledFold.gathered(row, rows, self._exchange, self._within_node())

    @staticmethod
    def _views(row, rows, chunked=None):
        """This rank's ``row``, its fields and data; every rank's data (``_Chunked`` over
        them where ``chunked``, the SharedRows, says so) and fields in ``rows``."""
        data = rows[:, _HEAD:]
        gathered = data if chunked is None else _Chunked(data, chunked)
        return row, row[:_HEAD].view(np.int64), row[_HEAD:], gathered, rows[:, :_HEAD]

    def run_compiled(self, request, response, plan, wake, activity):
        """A lane's cycle (``request``, agreed as ``response``, folded with ``plan``) as one
        compiled call, where it can run: gathered rows on a persistent exchange or rows in
        shared memory (whole or in chunks), the compiled cycle loaded for the dtype, a result
        the data's side writes as it lies (``LatencyFolding.compiled_output``). REDUCED or
        FINALIZED: every rank folded it and its output holds the rows reduced (and
        finalized); False: they did not all fold it (the rows are exchanged; the cycle goes
        on to the vote); None: not run, nothing exchanged. ``activity``: entered around a
        wait that sleeps."""
        compiled = self._compiled
        if compiled is None:
            return None
        entry = FOLD_READY.get(plan.dtype)
        if entry is None and (plan.dtype in FOLD_ASKED or
                              (entry := fold_entry(plan.dtype)) is None):
            return None
        output = request.output  # in place: the lane has found it writeable
        if output is None or not plan.direct:
            output = self._folding.compiled_output(request, response, plan)
            if output is None:
                return None
        turns = self._turns
        turn = None
        if turns is not None:  # shared rows: the other set, as ``start`` takes it
            turn = self._turn = self._turn ^ 1
            self._row, self._fields, self._data, self.gathered, self._heads = turns[turn]
        if not compiled.run(entry, request.tensor, output, plan, request.cache_id, wake,
                            activity, turn):
            return False
        return FINALIZED if self._chunks else REDUCED

    def free(self, clean=True):
        """Free the exchange (``clean`` False: after a failure, as ``SharedRows.free``); no
        cycle folds after it."""
        self._release(clean)
        self.bytes = self.least = None
        self._recent = ()

    def _release(self, clean=True):
        """Free the rows' exchange and buffers (collective where ``clean``)."""
        self._compiled = None
        if self._exchange is not None:
            if self._turns is not None:
                self._exchange.free(clean)
            else:
                self._exchange.free()
            self._exchange = None
        self._turns = None
        self._chunks = False
        self._width = 0

    def agreed(self):
        """The cache id every rank folded in the gathered rows, or None if they did not all
        fold the same one (then the cycle goes on to the vote)."""
        if self._turns is not None:
            self._exchange.arrived()
        if self._fields[0] != -1 or \
                self._heads.tobytes() != self._fields.tobytes() * self.size:
            return None
        return int(self._fields[1])


class _Chunked:
    """Every rank's data in shared rows of ``chunked_bytes`` or more, reduced as the shared
    allreduce reduces them (``reduce``); what the fold hands on in place of the rows."""

    __slots__ = ("rows", "shared")

    def __init__(self, rows, shared):
        self.rows = rows  # (size, bytes) uint8: every rank's data
        self.shared = shared  # the SharedRows: its result row, its rank, its barrier

    def reduce(self, plan, buffer):
        """``buffer`` = the rows reduced with ``plan`` (and finalized): this rank's chunk of
        every row combined in rank order into the result row, a barrier, the result copied
        out. The bits are ``reduce_rows``' over the whole rows."""
        shared = self.shared
        count = buffer.size
        rows = self.rows[:, :count * buffer.itemsize].view(plan.dtype)
        low, high = chunk_bounds(count, len(rows))[shared.rank]
        result = shared.result[_HEAD:_HEAD + count * buffer.itemsize].view(plan.dtype)
        mine = result[low:high]
        reduce_rows(plan.ufunc, rows[:, low:high], mine)
        if plan.finalize is not None and high > low:
            plan.finalize(mine)
        shared.barrier()  # every chunk reduced
        buffer[...] = result


_PLANS = 256  # metadata whose fold plan is kept (a training loop has a few)


class _Plan(NamedTuple):
    nbytes: Optional[int]
    dtype: np.dtype
    prescale: float
    ufunc: object  # the op's numpy ufunc (reduce_rows)
    finalize: object
    version: int  # the version of the route it was made under (allreduce.Route)
    op: Optional[str] = None  # the reduction's name (``REDUCE_BY_NAME``'s key)
    # no prescale, the tensor's own dtype on the wire, in native byte order: a compiled cycle
    # reduces the rows straight into a writeable output (``compiled_output``)
    direct: bool = False
    # what a compiled cycle divides its result by itself (an Average of float32 or float64
    # values, ``scaling.plain_divisor``; 0: nothing), and the finalizer left after it
    divisor: int = 0
    after_compiled: object = None


class LatencyFolding:
    """The data's side of the fold, for the allreduce ``pipeline`` (``AllreducePipeline``) of
    ``size`` ranks; ``recorder`` (the executor) records the timeline's activity with
    ``span(items, activity, started)`` while its ``timeline`` is not None; ``rows_budget``:
    the most bytes of shared memory the rows above the latency threshold may take (the same
    on every rank, ``shared_rows_budget``)."""

    def __init__(self, pipeline, size, recorder, rows_budget=SHARED_ROWS_BUDGET):
        self._pipeline = pipeline
        self._size = size
        self._recorder = recorder
        self.rows_budget = rows_budget
        self._plans = {}  # Meta -> _Plan

    @property
    def contention(self):
        """Ranks per core on the node, as the route prices the CPU's work."""
        return self._pipeline.route.contention

    def lone_bytes(self, response):
        """The bytes ``response`` (a lone allreduce) would put in a gathered negotiation row,
        or None where it must take the executor's own route (the same on every rank)."""
        if response.joined or response.error is not None:
            return None
        return self._plan(response.meta).nbytes

    def contribute(self, request, out, plan=None, least=0):
        """Write this rank's prescaled wire buffer for ``request`` into the first bytes of
        ``out``; False if it is not foldable or its bytes are not between ``least`` and
        ``out``'s (then it goes the usual way). ``plan``: its plan, where the caller holds it
        (a lane)."""
        if plan is None:
            plan = self._plans.get(request.meta)  # the loop's plan, without a call
            if plan is None or plan.version != self._pipeline.route.version:
                plan = self._plan(request.meta)
        nbytes = plan.nbytes
        if nbytes is None or nbytes > out.nbytes or nbytes < least:
            return False
        buffer = (out if nbytes == out.nbytes else out[:nbytes]).view(plan.dtype)
        buffer[...] = request.tensor.ravel()  # contiguous (the door's): a view
        if plan.prescale != 1.0:
            scale_into(buffer, plan.prescale)
        return True

    def finish(self, response, request, rows, plan=None):
        """Complete ``request`` from every rank's contribution (the uint8 ``rows``, one per
        rank): reduced in rank order, as the latency path reduces its gathered rows, so the
        result is bitwise what that path gives; ``REDUCED`` or ``FINALIZED``: a compiled cycle
        has reduced them so into the output (``Fold.run_compiled``). ``plan`` as for
        ``contribute``."""
        timeline = self._recorder.timeline
        started = time.monotonic() if timeline is not None else 0.0
        if plan is None:
            plan = self._plans.get(response.meta)
            if plan is None or plan.version != self._pipeline.route.version:
                plan = self._plan(response.meta)
        output = request.output  # in place: the common case, without a call
        if output is None:
            output = self._pipeline.host.output(response, request, response.meta.dtype, None)
        flat = output.ravel()  # contiguous: a view
        if rows is REDUCED:  # a compiled cycle reduced them into the output (``run_compiled``)
            if plan.after_compiled is not None:
                plan.after_compiled(flat)
        elif rows is not FINALIZED:
            buffer = flat if plan.dtype == flat.dtype else np.empty(flat.size, dtype=plan.dtype)
            if type(rows) is np.ndarray:  # the call's data: the first bytes of each row
                if rows.shape[1] != plan.nbytes:
                    rows = rows[:, :plan.nbytes]
                reduce_rows(plan.ufunc, rows.view(plan.dtype), buffer)
                if plan.finalize is not None:
                    plan.finalize(buffer)
            else:  # shared rows reduced chunk by chunk
                rows.reduce(plan, buffer)
            if buffer is not flat:
                flat[...] = buffer
        if timeline is not None:
            self._recorder.span([(response, request)], "ALLREDUCE", started)
        if request.writeback is None:  # ``complete``, without the call in the common case
            request.handle.set_result(output)
        else:
            complete(request, output)

    def compiled_output(self, request, response, plan):
        """Where a compiled fold cycle (``Fold.run_compiled``) writes ``request``'s rows
        reduced: its output (taken now where out of place), or None where Python's steps
        must run: a prescale, a wire dtype of its own, an input that is not writeable, a
        byte order not native."""
        if not plan.direct or not request.tensor.flags.writeable:
            return None
        output = request.output
        if output is None:  # below the pool's size, as the pool would make it, without calls
            # (np.empty, not empty_like: that one is a Python function; the input is C-contiguous)
            tensor = request.tensor
            output = request.output = np.empty(tensor.shape, tensor.dtype) \
                if plan.nbytes < OutputPool.MIN_BYTES \
                else self._pipeline.host.output(response, request, plan.dtype, None)
        return output

    def plan_of(self, meta):
        """The plan folding ``meta``'s allreduce runs with (a lane keeps it)."""
        return self._plan(meta)

    def _plan(self, meta):
        """What folding ``meta``'s allreduce takes, worked out once per metadata (a loop
        repeats one): its wire bytes where the latency path would take it (else None), the
        wire dtype, the prescale, the reduction and the finalizer. Made again when the
        route changes (the autotuner's threshold, a forced algorithm)."""
        version = self._pipeline.route.version
        plan = self._plans.get(meta)
        if plan is None or plan.version != version:
            if len(self._plans) >= _PLANS:
                self._plans.clear()
            nbytes = self._foldable_bytes(meta)
            if nbytes is None:
                plan = _Plan(None, None, 1.0, None, None, version)
            else:
                prescale, finalize = scaling(meta, self._size)
                op = KERNEL_OP[meta.op]
                wire = wire_dtype(meta.dtype, meta.wire)
                divisor = plain_divisor(meta, self._size) if wire.isnative else 0
                plan = _Plan(nbytes, wire, prescale, REDUCE_BY_NAME[op], finalize, version, op,
                             prescale == 1.0 and wire == numpy_dtype(meta.dtype) and wire.isnative,
                             divisor, None if divisor else finalize)
            self._plans[meta] = plan
        return plan

    def _foldable_bytes(self, meta):
        """The wire bytes of a host allreduce that the shared-memory allreduce would take, or
        that the gathered path would below the latency path's threshold (both combine every
        rank's values in rank order, as the fold does), else None."""
        if meta.kind != "allreduce" or meta.device != "cpu" or meta.op == Adasum:
            return None
        nbytes = wire_bytes(meta)
        kind = self._pipeline.kind_for(nbytes)
        small = nbytes < self._pipeline.route.small_bytes
        if kind == "small" and small:
            return nbytes
        if kind == "shared" and (small or (2 * self._size + 1) * nbytes <= self.rows_budget):
            return nbytes
        return None
