"""Moving bytes over MPI on host buffers, and waiting on requests without hogging a core.

MPICH busy-polls inside blocking calls; with more ranks than cores that starves the very
peers a rank is waiting for. Every wait in hororing goes through ``wait`` below: it polls
the request, spins briefly (lowest latency when each rank has a core), then yields the CPU,
then sleeps with a growing interval, so an oversubscribed job still moves forward.
"""

import os
import sys
import time

import numpy as np
from ._mpi import MPI

_SPIN_TESTS = 50
_YIELD_TESTS = 2000
_MAX_SLEEP_S = 0.001


_ABORT_GRACE_S = 1.0


def end_job(message):
    """Write ``message`` to stderr and end every rank of the job with MPI_Abort.

    mpiexec forwards a rank's output through a proxy that the abort kills too: a line written
    just before MPI_Abort is sometimes lost. The rank waits a moment first so that the reason
    the job ended reaches the user.
    """
    sys.stderr.write(message if message.endswith("\n") else message + "\n")
    sys.stderr.flush()
    time.sleep(_ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(1)


def wait(request, deadline=None, unless_soon=None):
    """Block until ``request`` completes, polling with back-off.

    Args:
        deadline: optional ``time.monotonic()`` value; past it, give up.
        unless_soon: optional callable, called once if the request has not completed by
            the end of the spin phase (e.g. to wake peers that are not taking part yet).

    Returns:
        True when the request completed, False when the deadline passed first.
    """
    return wait_until(request.Test, deadline, unless_soon)


def wait_all(requests):
    """Block until every request in the list completes, polling with back-off."""
    if requests:
        wait_until(lambda: MPI.Request.Testall(requests))


def wait_until(done, deadline=None, unless_soon=None):
    """Poll ``done()`` with the same back-off until it is true (or the deadline passes);
    ``unless_soon`` as for ``wait``."""
    tests = 0
    sleep_s = 1e-5
    while not done():
        tests += 1
        if deadline is not None and tests % 64 == 0 and time.monotonic() > deadline:
            return False
        if tests < _SPIN_TESTS:
            continue
        if tests == _SPIN_TESTS and unless_soon is not None:
            unless_soon()
        if tests < _YIELD_TESTS:
            os.sched_yield()
            continue
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)
    return True


def byte_view(array):
    """Return a contiguous array as a flat uint8 view (for byte-counted MPI calls)."""
    return array.reshape(-1).view(np.uint8)
