"""A lane's fold cycle in one compiled call (``algorithms/compiled/folded.py``): the Python
side, which holds the compiled cycle's fields for the fold's rows.

A lane (``lane.py``) runs one fold cycle (``fold.py``) a call. In Python that cycle writes the
row, starts the exchange (the rows' persistent allgather, or the shared rows' fence and
barrier), tests it, compares every rank's fields and reduces the rows, in a dozen calls
costing more than the exchange itself at 4 KiB. Where the compiled cycle is loaded for the
dtype, the whole of it is one call into machine code, which hands back only to wake the
peers, to sleep, or with the result. The rows, the messages and the bits are those of
Python's steps, so ranks may run either (one still loading numba runs Python's steps
meanwhile).
"""

import numpy as np

from .. import transport
from .._mpi import MPI
from ..algorithms.compiled import HALVES, carried, handle
from ..algorithms.compiled.codes import (APART, DONE, F_CACHE_ID, F_COMM, F_DIVISOR,
                                         F_FINALIZE, F_FLAG, F_HALF, F_HIGH, F_LINE, F_LINES,
                                         F_LOW, F_MINE, F_OP, F_RANK, F_RESULT, F_ROW, F_ROWS,
                                         F_SHARED, F_SIZE, F_SLOT, F_SPIN, F_STAGE, F_STATUS,
                                         F_STRIDE, F_WAKE, F_WIN, F_YIELD, FIELDS, FINALIZE, OPS,
                                         SPUN, WAIT)
from ..algorithms.plan import chunk_bounds


# a test of the request from compiled code takes a sixth to a fourth of one from Python here
# (0.07-0.13 against 0.42-0.54 us, the Python loop's own work besides): the spin before the
# peers are woken lasts about as long as Python's when it makes this many times its tests.
# Woken after the same 50 tests, rank 1 of 2 sent a wake-up on 26% of 3000 calls (4% from
# Python); after 400, on 0.2-2%
SPIN_SCALE = 8
# Across nodes a compiled test costs what Python's does (the network module's progress, a
# system call, not the interpreter): it spins Python's count, then yields the core. Spun
# SPIN_SCALE times that, 4 ranks two to a host on 2 cores ran a 4 KiB fold at 0.22-0.28 of
# MPI_Allreduce's speed (Python's steps 0.33-0.48); spun this, 0.64-0.75. The peers are
# still woken after SPIN_SCALE times the tests, as on one node: woken after Python's count,
# one rank a host ran 16 KiB at 0.78-0.85 against 0.90-0.93, a wake-up sent on most calls
# while the link carried the rows (docs/compiled.md)
NETWORK_SPIN_SCALE = 1
# a test of the window's flag counts (MPI_Win_sync and a load a rank) takes 0.012 us here,
# a tenth of a compiled MPI_Test: spun SPIN_SCALE times the tests, a 64 KiB fold over shared
# rows at 2 ranks woke its peer from Python often enough to cost 14 Python calls a call
# instead of 11 (scripts/bench_call_cost.py); at eight times that, 11 in every run
FLAG_SPIN_SCALE = 8 * SPIN_SCALE
# Where the node's ranks outnumber its cores (the back-off's ``wake_late``, which every wait
# follows), the cycle wakes the peers only at the last test before the sleep: there a
# barrier waits for every rank to be scheduled in turn, long past the spin, and a wake-up
# then wakes each peer's engine thread, which takes a core from the callers and the drive
# lock from the next call (which then goes the usual way, with a vote cycle more). At 16 ranks on 2 cores a lone 1 MiB
# call ran 4.6-6.4 ms so against 14.3-18.1 woken after the spin, 2 of 23 calls taking the
# lane against 0-8; at 8 ranks 4 KiB 0.25-0.32 against 0.37-0.38 ms, 64 KiB 0.40-0.43
# against 0.51-0.54, 1 MiB 1.21-1.26 against 1.84-1.88 (docs/benchmarks.md, "The wake-up
# where ranks crowd the cores"). A peer whose caller does not come (its engine thread
# drives an asynchronous call) is still woken, at the end of the yields, and its engine
# thread polls on its own meanwhile.
# the fields a plan sets, in the order ``_settings`` gives them (one numpy assignment a
# change of plan: set one by one, with the chunk's bounds and view worked out again, a
# change cost 5 us here, paid on every call of a loop reducing two tensors in turn)
_PLAN_FIELDS = np.array([F_OP, F_HALF, F_DIVISOR, F_LOW, F_HIGH, F_FINALIZE])
# the plans whose fields are kept (a loop's tensors have a plan each; beyond this many
# plans the settings are worked out again)
KEPT_PLANS = 64


class CompiledFold:
    """The compiled cycle over one set of rows: gathered ones (``gathered``) or the sets of
    ``exchange.SharedRows`` (``shared``). Made with the rows, dropped with them."""

    def __init__(self, sets, keep):
        """``sets``: (this rank's row, every rank's rows) of each set of rows, used in turn
        (``turn``); ``keep``: what holds them and the handles (the request, the window)."""
        self._keep = keep
        self._slot = np.array([handle(MPI.REQUEST_NULL)], dtype=np.int64)
        self._flag = np.zeros(1, dtype=np.int32)
        self._status = np.zeros(16, dtype=np.int64)  # larger than either MPI's MPI_Status
        fields = self.fields = np.zeros(FIELDS, dtype=np.int64)
        fields[F_SLOT] = self._slot.ctypes.data
        fields[F_FLAG] = self._flag.ctypes.data
        fields[F_STATUS] = self._status.ctypes.data
        # each set's addresses, worked out once (``ctypes.data`` costs 1-2 us a call here)
        self._sets = [(row.ctypes.data, rows.ctypes.data, rows.strides[0])
                      for row, rows in sets]
        self.turn(0)
        fields[F_SIZE] = sets[0][1].shape[0]
        # the plan and cache id the fields were last set for, and the plan's bits; each
        # plan's settings (``_settings``) by its id, with the plan, which keeps the id its own
        self._plan = self._bits = self._cache_id = None
        self._plans = {}
        self._test = None
        self._entered = None  # where the barrier waits on flags: whether every rank entered
        self._backoff = -1  # the back-off's version the spin fields were set from
        # its tests a Python test's worth of spinning, and of testing before it wakes the peers
        self._scale = self._wake_scale = SPIN_SCALE
        # rows reduced chunk by chunk (``shared``): the shared result row, this rank's place
        # among the rows, and its chunk of the result as the plan's dtype (what it finalizes)
        self._result, self._rank, self._chunk = None, 0, None

    def turn(self, index):
        """Run the next cycle on set ``index`` of the rows."""
        fields = self.fields
        fields[F_ROW], fields[F_ROWS], fields[F_STRIDE] = self._sets[index]

    @classmethod
    def gathered(cls, row, rows, exchange, one_node):
        """The compiled cycle over rows gathered by ``exchange`` (``transport.Exchange``), or
        None where that is not one persistent request (an MPI without persistent
        collectives). ``one_node``: whether every rank is on this node (its tests spin as
        long as Python's then at ``SPIN_SCALE`` times their count, else at
        ``NETWORK_SPIN_SCALE``; either way the peers are woken after ``SPIN_SCALE`` times)."""
        persistent = getattr(exchange, "persistent", None)
        if persistent is None:
            return None
        compiled = cls([(row, rows)], persistent)
        compiled._slot[0] = handle(persistent)
        compiled._scale = SPIN_SCALE if one_node else NETWORK_SPIN_SCALE
        return compiled

    @classmethod
    def shared(cls, sets, shared_window, result=None, rank=0):
        """The compiled cycle over ``sets`` of rows (as ``__init__`` takes them) in
        ``shared_window`` (the SharedRows' ``shared_window.SharedWindow``), a barrier of its node
        the exchange: MPI's, or its flags where it has them. ``result``: the data of the
        window's result row (uint8) where the rows are reduced chunk by chunk
        (``fold._Chunked``), ``rank`` this rank's chunk (its rank in the node)."""
        window = shared_window.window
        compiled = cls(sets, window)
        fields = compiled.fields
        fields[F_SHARED] = 1
        fields[F_WIN] = handle(window)
        fields[F_COMM] = handle(shared_window.node)
        lines = shared_window.flag_lines()
        if lines is not None:
            fields[F_LINES], fields[F_MINE], fields[F_LINE] = lines
            compiled._entered = shared_window.all_entered
            compiled._scale = compiled._wake_scale = FLAG_SPIN_SCALE
        if result is not None:
            fields[F_RESULT], fields[F_RANK] = result.ctypes.data, rank
            compiled._result, compiled._rank = result, rank
        return compiled

    def run(self, entry, source, output, plan, cache_id, wake, activity, turn=None):
        """One fold cycle, compiled: this rank's row of ``source`` (folding ``cache_id``),
        the exchange, and where every rank folded the same, the rows reduced with ``plan``
        into ``output`` (divided by ``plan.divisor`` where it is not 0; whole rows not
        otherwise finalized, chunks finalized by ``plan.after_compiled`` too). True then;
        False where the ranks' fields differ (the rows are exchanged: the cycle goes on to
        the vote). ``wake``: called once if the exchange is not complete after the spin;
        ``activity`` (``transport.activity``): entered around the sleeping wait; ``turn``: the
        set of rows to run on (``turn``, without the call), or None: the last one."""
        fields = self.fields
        if turn is not None:
            fields[F_ROW], fields[F_ROWS], fields[F_STRIDE] = self._sets[turn]
        if plan is not self._plan or cache_id != self._cache_id:
            kept = self._plans.get(id(plan))  # (kept with the plan: its id stays its own)
            if kept is None:
                kept = self._settings(plan)
            _, fields[_PLAN_FIELDS], self._bits, self._chunk = kept
            fields[F_CACHE_ID] = self._cache_id = cache_id
            self._plan = plan
        backoff = transport.Backoff
        if backoff.version != self._backoff:  # set (again) since the last cycle
            spin = backoff.spin_tests * self._scale
            yields = backoff.yield_tests - backoff.spin_tests + spin
            fields[F_SPIN], fields[F_YIELD] = spin, yields
            # woken once, before the sleep (at the first test where there is no spin; where
            # the back-off wakes late, as where ranks crowd the node's cores, at the last)
            fields[F_WAKE] = max(1, yields if backoff.wake_late else
                                 min(max(backoff.spin_tests * self._wake_scale, spin), yields))
            self._backoff = backoff.version
        fields[F_STAGE] = 0
        if source.ndim != 1:
            source, output = source.reshape(-1), output.reshape(-1)
        bits = self._bits
        if bits is not plan.dtype:
            source, output = source.view(bits), output.view(bits)
        while True:
            event = entry(source, output, fields)
            if event == DONE:
                return True
            if event == APART:
                return False
            if event == FINALIZE:  # this rank's chunk, before the others copy it
                plan.after_compiled(self._chunk)
            elif event == SPUN:
                if wake is not None:
                    wake()
            elif event == WAIT:  # then tested once more, compiled: done
                with activity:  # what the stall watchdog names, should it stall
                    transport.wait_until(self._done, asleep=True)
            else:
                raise MPI.Exception(-int(event))

    def _settings(self, plan):
        """(``plan``, its fields' values in ``_PLAN_FIELDS``' order, the dtype the cycle
        sees its data as, this rank's chunk of the shared result as ``plan``'s dtype or
        None), kept for the next change back to ``plan``. Rows reduced chunk by chunk: this
        rank's chunk is the one ``chunk_bounds`` cuts, as ``fold._Chunked`` reduces them."""
        low = high = 0
        chunk = None
        if self._result is not None:
            itemsize = plan.dtype.itemsize
            low, high = chunk_bounds(plan.nbytes // itemsize,
                                     int(self.fields[F_SIZE]))[self._rank]
            chunk = self._result[low * itemsize:high * itemsize].view(plan.dtype)
        values = np.array([OPS[plan.op], HALVES.get(plan.dtype, 0), plan.divisor, low, high,
                           plan.after_compiled is not None], dtype=np.int64)
        if len(self._plans) >= KEPT_PLANS:
            self._plans.clear()
        kept = self._plans[id(plan)] = (plan, values, carried(plan.dtype), chunk)
        return kept

    def _done(self):
        """One test of the exchange's request, compiled (the sleeping phase's), or of the
        flags' counts."""
        if self._entered is not None:
            return self._entered()
        if self._test is None:
            from ..algorithms.compiled import module
            self._test = module().test_slot
        return self._test(self._slot, 0, self._flag, self._status)
