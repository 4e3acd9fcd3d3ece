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

_ABORT_GRACE_S = 1.0


class _Backoff:
    """How ``wait_until`` polls; one per process, set from Config by ``hororing.init``."""

    spin_tests = 50
    yield_tests = 2000
    max_sleep_s = 0.001


def set_backoff(spin_tests, yield_tests, max_sleep_s):
    """Set how every wait polls: ``spin_tests`` tests back to back, then tests separated by
    ``sched_yield`` up to ``yield_tests``, then sleeps doubling up to ``max_sleep_s``
    (Config.wait_spin_tests, wait_yield_tests, wait_max_sleep_us)."""
    _Backoff.spin_tests = int(spin_tests)
    _Backoff.yield_tests = int(yield_tests)
    _Backoff.max_sleep_s = float(max_sleep_s)


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
    spin_tests, yield_tests, max_sleep_s = (_Backoff.spin_tests, _Backoff.yield_tests,
                                            _Backoff.max_sleep_s)
    tests = 0
    sleep_s = min(1e-5, max_sleep_s)
    while not done():
        tests += 1
        if deadline is not None and tests % 64 == 0 and time.monotonic() > deadline:
            return False
        if tests < spin_tests:
            continue
        if unless_soon is not None:  # once, at the end of the spin phase
            unless_soon()
            unless_soon = None
        if tests < yield_tests:
            os.sched_yield()
            continue
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, max_sleep_s)
    return True


def byte_view(array):
    """Return a contiguous array as a flat uint8 view (for byte-counted MPI calls)."""
    return array.reshape(-1).view(np.uint8)
