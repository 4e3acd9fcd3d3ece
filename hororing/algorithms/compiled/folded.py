"""A lane's fold cycle compiled with numba: the whole of one folded blocking allreduce on
gathered rows, from this rank's row to the reduced result, in one call.

``engine/fold.py`` runs a repeated small allreduce as one exchange of rows (fields, data):
in Python, writing the row, starting the persistent allgather, testing it, comparing every
rank's fields and reducing the rows cost more than the exchange itself. ``cycle`` does the
same steps in machine code on the same buffers, the same persistent request (started with
MPI_Start from here; its handle is unchanged by completing, so mpi4py's object and this
copy stay one request) and the same reductions as the compiled ring (``native._combine``),
one row after another in rank order, which are numpy's bit for bit. So a rank running this
and a rank running Python's steps exchange the same rows and get the same result.

It takes the input and the output (the same array in place; 1-D, of the carried dtype,
which selects the compiled version) and an int64 array of ``codes.F_*`` fields.
``F_STAGE`` says where it stands: 0 write the row and start, 1 wait, 2 compare and reduce.
It returns SPUN after ``F_SPIN`` tests (the caller wakes the peers and calls again), WAIT
after ``F_YIELD``, tests separated by sched_yield (the caller sleeps until the request
completes, sets stage 2 and calls again), as ``transport.wait_until`` polls, APART where the ranks' fields differ (the cycle goes on to the vote) and DONE with
the result in ``F_OUT``.
"""

import numba
from numba import types

from .codes import (APART, DONE, F_CACHE_ID, F_FLAG, F_HALF, F_OP, F_ROW,
                    F_ROWS, F_SIZE, F_SLOT, F_SPIN, F_STAGE, F_STATUS, F_TESTS,
                    F_WIDTH, F_YIELD, SPUN, WAIT)
from .native import _combine, _pointer, _sched_yield, _test

_HEAD = 16  # the row's fields: two int64 (fold.FIELDS)
_start = types.ExternalFunction("MPI_Start", types.int32(types.voidptr))


@numba.njit(cache=True, nogil=True)
def cycle(source, out, p):
    """One folded allreduce: see the module's docstring."""
    dtype = out.dtype
    count = out.size
    if p[F_STAGE] == 0:
        head = numba.carray(_pointer(p[F_ROW]), 2, numba.int64)
        head[0] = -1
        head[1] = p[F_CACHE_ID]
        data = numba.carray(_pointer(p[F_ROW] + _HEAD), count, dtype)
        for i in range(count):
            data[i] = source[i]
        code = _start(p[F_SLOT])
        if code != 0:
            return -code
        p[F_STAGE] = 1
        p[F_TESTS] = 0
    if p[F_STAGE] == 1:
        flag = numba.carray(_pointer(p[F_FLAG]), 1, numba.int32)
        spin, yields = p[F_SPIN], p[F_YIELD]
        while True:
            flag[0] = 0
            code = _test(p[F_SLOT], p[F_FLAG], p[F_STATUS])
            if code != 0:
                return -code
            if flag[0] != 0:
                break
            tests = p[F_TESTS] + 1  # the phases of ``transport.wait_until``
            p[F_TESTS] = tests
            if tests < spin:
                continue
            if tests == max(spin, 1):
                return SPUN
            if tests >= yields:
                return WAIT
            _sched_yield()
        p[F_STAGE] = 2
    width, size = p[F_WIDTH], p[F_SIZE]
    cache_id = p[F_CACHE_ID]
    for rank in range(size):
        head = numba.carray(_pointer(p[F_ROWS] + rank * width), 2, numba.int64)
        if head[0] != -1 or head[1] != cache_id:
            return APART
    first = numba.carray(_pointer(p[F_ROWS] + _HEAD), count, dtype)
    for i in range(count):
        out[i] = first[i]
    op, half = p[F_OP], p[F_HALF]
    for rank in range(1, size):
        row = numba.carray(_pointer(p[F_ROWS] + rank * width + _HEAD), count, dtype)
        _combine(out, row, op, half)
    return DONE
