"""A lane's fold cycle compiled with numba: the whole of one folded blocking allreduce, from
this rank's row to the reduced result, in one call.

``engine/fold.py`` runs a repeated small allreduce as one exchange of rows (fields, data):
in Python, writing the row, starting the exchange, testing it, comparing every rank's fields
and reducing the rows cost more than the exchange itself at small sizes. ``cycle`` does the
same steps in machine code on the same buffers. Gathered rows: the same persistent allgather
(started with MPI_Start from here; a persistent request keeps its handle when it completes,
so mpi4py's object and this copy stay one request). Rows in the node's shared memory
(``exchange.SharedRows``): the same fences (MPI_Win_sync) around the same barrier
(MPI_Ibarrier, or the window's flag counts where it has them). Then the reductions of the
compiled ring (``native._combine``), one row after another in rank order, which are numpy's
bit for bit. So a rank running this and a rank running Python's steps exchange the same rows
and get the same result.

It takes the input and the output (the same array in place; 1-D, of the carried dtype,
which selects the compiled version) and an int64 array of ``codes.F_*`` fields.
``F_STAGE`` says where it stands: 0 write the row and start, 1 wait, 2 compare and reduce.
Rows reduced chunk by chunk (``F_RESULT`` not 0, rows of ``fold.chunked_bytes`` and more, as
``fold._Chunked`` reduces them; 0 leaves this rank's chunk out of its row, which only this
rank reads): 2 reduces this rank's chunk (``F_LOW:F_HIGH``) of every row (its own from the
input) into the shared result row and returns FINALIZE where ``F_FINALIZE`` says the caller
finalizes that chunk (an integer Average: each chunk is finalized before the others copy
it), 3 starts a second barrier (the same fences around the same MPI_Ibarrier as
``SharedRows.barrier``), 4 waits for it, then the others' chunks of the result row are
copied out (this rank's went into the output block by block as it was reduced, where the
caller does not finalize it after). It polls as ``transport.wait_until`` does: ``F_SPIN``
tests back to back, then tests separated by sched_yield; it returns SPUN at test ``F_WAKE``
(the caller wakes the peers and calls again) and WAIT after ``F_YIELD`` (the caller sleeps
until the request completes and calls again). Then APART where the ranks'
fields differ (the cycle goes on to the vote), or DONE with the result in the output,
divided by ``F_DIVISOR`` where that is not 0 (a float Average, which the caller would
otherwise finalize in Python).
"""

import numba
from numba import types

from .codes import (APART, DONE, F_CACHE_ID, F_COMM, F_DIVISOR, F_FINALIZE, F_FLAG, F_HALF,
                    F_HIGH, F_LINE, F_LINES, F_LOW, F_MINE, F_OP, F_RANK, F_RESULT, F_ROW, F_ROWS,
                    F_SHARED, F_SIZE, F_SLOT, F_SPIN, F_STAGE, F_STATUS, F_STRIDE, F_TESTS,
                    F_WAKE, F_WIN, F_YIELD, FINALIZE, SPUN, WAIT)
from .native import STAMP, _combine, _pointer, _sched_yield, _test

_HEAD = 16  # the row's fields: two int64 (fold.FIELDS)
# the result is reduced a block of this many bytes at a time, which stays in the L1 cache
# while every rank's row is combined into it (whole rows: the result written, read back and
# written again once per row, through L2 or memory beyond a few hundred KiB)
_BLOCK_BYTES = 16 * 1024
_start = types.ExternalFunction("MPI_Start", types.int32(types.voidptr))
_win_sync = types.ExternalFunction("MPI_Win_sync", types.int32(types.int64))
_ibarrier = types.ExternalFunction("MPI_Ibarrier", types.int32(types.int64, types.voidptr))


@numba.njit(cache=True)
def built_from():
    """The sources' digest this module's cached code was compiled with (``native.STAMP``
    when it was compiled: ``compiled._fresh``)."""
    return STAMP


@numba.njit(cache=True, nogil=True)
def cycle(source, out, p):
    """One folded allreduce: see the module's docstring."""
    dtype = out.dtype
    count = out.size
    if p[F_STAGE] == 0:
        head = numba.carray(_pointer(p[F_ROW]), 2, numba.int64)
        head[0] = -1
        head[1] = p[F_CACHE_ID]
        row, mine = p[F_ROW] + _HEAD, source.ctypes.data
        if p[F_RESULT] == 0:
            _copy(numba.carray(_pointer(row), count, dtype), source)
        else:  # this rank's chunk is reduced from the source (_reduce): no rank reads it here
            low, tail = p[F_LOW], count - p[F_HIGH]  # the values before it and after it
            after = p[F_HIGH] * out.itemsize
            _copy(numba.carray(_pointer(row), low, dtype),
                  numba.carray(_pointer(mine), low, dtype))
            _copy(numba.carray(_pointer(row + after), tail, dtype),
                  numba.carray(_pointer(mine + after), tail, dtype))
        if p[F_SHARED] != 0:  # this rank's row visible to the others, then the barrier
            code = _enter(p)
        else:
            code = _start(p[F_SLOT])
        if code != 0:
            return -code
        p[F_STAGE] = 1
        p[F_TESTS] = 0
    if p[F_STAGE] == 1:
        event = _poll(p, True)
        if event != DONE:
            return event
        p[F_STAGE] = 2
        if p[F_SHARED] != 0:  # the others' rows visible to this rank
            code = _win_sync(p[F_WIN])
            if code != 0:
                return -code
    if p[F_STAGE] == 2:
        width, size = p[F_STRIDE], p[F_SIZE]
        cache_id = p[F_CACHE_ID]
        for rank in range(size):
            head = numba.carray(_pointer(p[F_ROWS] + rank * width), 2, numba.int64)
            if head[0] != -1 or head[1] != cache_id:
                return APART
        if p[F_RESULT] == 0:  # every row reduced whole, into the output
            _reduce(out, p, 0, count, 0, -1, out, False)
            return DONE
        # chunk by chunk: this rank's chunk of every row into the shared result row (and
        # into the output as each block is done, unless the caller finalizes the chunk
        # after), then a second barrier, the others' chunks copied out
        low, high = p[F_LOW], p[F_HIGH]
        _reduce(numba.carray(_pointer(p[F_RESULT]), count, dtype), p, low, high,
                source.ctypes.data, p[F_RANK], out, p[F_FINALIZE] == 0)
        p[F_STAGE] = 3
        if p[F_FINALIZE] != 0 and high > low:
            return FINALIZE
    if p[F_STAGE] == 3:
        code = _enter(p)
        if code != 0:
            return -code
        p[F_STAGE] = 4
        p[F_TESTS] = 0
    if p[F_STAGE] == 4:  # every rank in this cycle: no peer to wake, so never SPUN
        event = _poll(p, False)
        if event != DONE:
            return event
        code = _win_sync(p[F_WIN])  # every chunk visible to this rank
        if code != 0:
            return -code
        result = numba.carray(_pointer(p[F_RESULT]), count, dtype)
        if p[F_FINALIZE] != 0:  # this rank's chunk finalized since: the whole result
            _copy(out, result)
        else:
            low, high = p[F_LOW], p[F_HIGH]
            _copy(out[:low], result[:low])
            _copy(out[high:], result[high:])
    return DONE


@numba.njit(cache=True, nogil=True)
def _enter(p):
    """Fence this rank's writes and enter the shared rows' barrier: this rank's count one
    more where the barriers wait on flags (``F_LINES``), else MPI_Ibarrier into ``F_SLOT``;
    MPI's error code, or 0."""
    code = _win_sync(p[F_WIN])
    if code != 0:
        return code
    if p[F_LINES] == 0:
        return _ibarrier(p[F_COMM], p[F_SLOT])
    mine = numba.carray(_pointer(p[F_MINE]), 1, numba.int64)
    mine[0] += 1
    return 0


@numba.njit(cache=True, nogil=True)
def _entered(p):
    """With flags: whether every rank's count has reached this rank's. The fence before the
    reads (an external call, so no read is kept from an earlier test) also orders them
    before what this rank reads once they say so."""
    _win_sync(p[F_WIN])
    entered = numba.carray(_pointer(p[F_MINE]), 1, numba.int64)[0]
    lines, line = p[F_LINES], p[F_LINE]
    for rank in range(p[F_SIZE]):
        if numba.carray(_pointer(lines + rank * line), 1, numba.int64)[0] < entered:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _poll(p, spun):
    """Test the barrier (the counts, or the request in ``F_SLOT``) until it completes
    (DONE), in the phases of ``transport.wait_until``: ``F_SPIN`` tests back to back, then
    tests with a sched_yield between; SPUN once at test ``F_WAKE`` where ``spun`` (the caller
    wakes the peers), WAIT after ``F_YIELD`` (the caller sleeps)."""
    flag = numba.carray(_pointer(p[F_FLAG]), 1, numba.int32)
    spin, wake, yields = p[F_SPIN], p[F_WAKE], p[F_YIELD]
    while True:
        if p[F_LINES] != 0:
            if _entered(p):
                return DONE
        else:
            flag[0] = 0
            code = _test(p[F_SLOT], p[F_FLAG], p[F_STATUS])
            if code != 0:
                return -code
            if flag[0] != 0:
                return DONE
        tests = p[F_TESTS] + 1
        p[F_TESTS] = tests
        if tests < spin:
            continue
        if spun and tests == wake:
            return SPUN
        if tests >= yields:
            return WAIT
        _sched_yield()


@numba.njit(cache=True, nogil=True)
def _copy(into, source):
    """``into`` = ``source``, one loop over arrays of one size from their first element: the
    form LLVM makes a vectorized copy of (a loop from a bound read in the middle of a row ran
    the 2-rank 1 MiB call at 0.6 of MPI_Allreduce's speed instead of 0.75)."""
    for i in range(into.size):
        into[i] = source[i]


@numba.njit(cache=True, nogil=True)
def _reduce(into, p, low, high, own, mine, twin, mirrored):
    """Values ``low:high`` of every rank's row (``F_ROWS``) combined in rank order into the
    same values of ``into``, a block of the result at a time, those of row ``mine`` (-1:
    none) read at the address ``own`` instead, where this rank's data lies: each value sees
    the same operations in the same order as whole rows would. Divided by ``F_DIVISOR``
    where it is not 0 (a float Average: each value divided in float64 and rounded once,
    which is the correctly rounded float32 quotient too, 53 >= 2 * 24 + 2). Where
    ``mirrored``, each block is copied into the same values of ``twin`` while it is still in
    the L1 cache (the output: a second pass would read it back from L2 or memory)."""
    dtype = into.dtype
    itemsize = into.itemsize
    width, size = p[F_STRIDE], p[F_SIZE]
    op, half, divisor = p[F_OP], p[F_HALF], p[F_DIVISOR]
    step = _BLOCK_BYTES // itemsize
    for start in range(low, high, step):
        n = min(high - start, step)
        block = into[start:start + n]
        rows = p[F_ROWS] + _HEAD + start * itemsize
        mine_at = own + start * itemsize
        first = numba.carray(_pointer(mine_at if mine == 0 else rows), n, dtype)
        for i in range(n):
            block[i] = first[i]
        for rank in range(1, size):
            address = mine_at if rank == mine else rows + rank * width
            _combine(block, numba.carray(_pointer(address), n, dtype), op, half)
        if divisor != 0:
            for i in range(n):
                block[i] = block[i] / divisor
        if mirrored:
            _copy(twin[start:start + n], block)
