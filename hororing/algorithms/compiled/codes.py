"""What the compiled ring and its Python caller share: events, and the fields of the
integer arrays passed between them (no numba here: ring.py reads these at import)."""

# events ``native.ring`` returns (< 0: an MPI error, its code in state[ERROR])
DONE, WAIT, FINALIZE = 0, 1, 2
# the state array's fields: where the schedule stands, what Python is asked to do
PC, INDEX, TAG, POSTED, SLOT, FIN_START, FIN_STOP, ERROR, STATE_FIELDS = range(9)
# the params array's fields
(P_COMM, P_BYTE, P_NULL, P_LEFT, P_RIGHT, P_OP, P_IN_PLACE, P_FINALIZE, P_SPIN, P_YIELD,
 P_LARGEST, P_HALF, PARAMS) = range(13)
OPS = {"sum": 0, "min": 1, "max": 2, "product": 3}
SLOT_BYTES = 8  # a request slot: MPI_Request is 4 bytes in MPICH, 8 in Open MPI

# ``folded.cycle`` (a lane's fold cycle): its events, besides DONE, WAIT and FINALIZE (< 0:
# an MPI error's code, negated)
SPUN, APART = 3, 4
# the fields of its one int64 array: addresses, sizes, what to reduce, where it stands
# (F_RESULT: the address of the shared result row's data where the rows are reduced chunk by
# chunk, else 0; F_LOW:F_HIGH this rank's chunk then, F_RANK its row, and F_FINALIZE whether
# Python finalizes it; F_LINES: the address of the first rank's barrier count where the shared rows' barriers
# wait on flags (``shared_window.SharedWindow``), else 0; F_MINE this rank's, F_LINE the bytes
# from one count to the next; F_SPIN the tests spun, F_WAKE the test after which the caller
# wakes the peers, F_SPIN <= F_WAKE <= F_YIELD, F_YIELD the last before it sleeps)
(F_STAGE, F_TESTS, F_SLOT, F_FLAG, F_STATUS, F_ROW, F_ROWS, F_STRIDE, F_SIZE, F_OP, F_HALF,
 F_CACHE_ID, F_SPIN, F_YIELD, F_SHARED, F_WIN, F_COMM, F_DIVISOR, F_RESULT, F_LOW, F_HIGH,
 F_FINALIZE, F_LINES, F_MINE, F_LINE, F_RANK, F_WAKE, FIELDS) = range(28)
