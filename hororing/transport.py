"""Moving bytes over MPI on host buffers, and waiting on requests without hogging a core.

MPICH busy-polls inside blocking calls; with more ranks than cores that starves the very
peers a rank is waiting for. Every wait in hororing goes through ``wait`` below: it polls
the request, spins briefly (lowest latency when each rank has a core), then yields the CPU,
then sleeps with a growing interval, so an oversubscribed job still moves forward.
"""

import logging
import os
import sys
import threading
import time

import numpy as np

from ._mpi import MPI
from .ops import CARRIED_AS, is_bfloat16

_ABORT_GRACE_S = 1.0
# a rank whose MPI_Abort has not ended it by then (its proxy cut off) exits by itself
_ABORT_GIVE_UP_S = 10.0

log = logging.getLogger("hororing")


class _Local(threading.local):
    activity = None  # the innermost ``activity`` this thread is in (a class default: no raise)


_local = _Local()


class _Waits:
    """The waits that have reached the sleeping phase, by thread: what they wait for."""

    lock = threading.Lock()
    active = {}  # thread id -> [since, what, peers, warned_at]


class _Backoff:
    """How ``wait_until`` polls; one per process, set from Config by ``hororing.init``."""

    spin_tests = 50
    yield_tests = 2000
    max_sleep_s = 0.001
    wake_late = False  # the peers woken before the first sleep, not after the spin
    version = 0  # counts ``set_backoff``'s changes (a compiled wait copies the counts once)


Backoff = _Backoff  # read by a compiled wait (``engine/compiled_fold.py``) without a call


def set_backoff(spin_tests, yield_tests, max_sleep_s, wake_late=False):
    """Set how every wait polls: ``spin_tests`` tests back to back, then tests separated by
    ``sched_yield`` up to ``yield_tests``, then sleeps doubling up to ``max_sleep_s``
    (Config.wait_spin_tests, wait_yield_tests, wait_max_sleep_us). ``wake_late``: a wait
    wakes the peers (``wait``'s ``unless_soon``) at the last test before its first sleep, not
    at the end of the spin: where a node's ranks outnumber its cores, a woken engine thread
    takes a core from the callers a wait is for."""
    _Backoff.spin_tests = int(spin_tests)
    _Backoff.yield_tests = int(yield_tests)
    _Backoff.max_sleep_s = float(max_sleep_s)
    _Backoff.wake_late = bool(wake_late)
    _Backoff.version += 1


def backoff():
    """The waits' back-off in effect: (spin tests, yield tests, longest sleep in seconds,
    whether the peers are woken late), as ``set_backoff`` takes it."""
    return _Backoff.spin_tests, _Backoff.yield_tests, _Backoff.max_sleep_s, _Backoff.wake_late


def end_job(message):
    """Write ``message`` to stderr and end every rank of the job with MPI_Abort.

    mpiexec forwards a rank's output through a proxy that the abort kills too: a line written
    just before MPI_Abort is sometimes lost. The rank waits a moment first so that the reason
    the job ended reaches the user.
    """
    sys.stderr.write(message if message.endswith("\n") else message + "\n")
    sys.stderr.flush()
    time.sleep(_ABORT_GRACE_S)
    # MPI_Abort goes through this host's proxy to mpiexec; cut off from it (a failed link),
    # it may never return, and this rank must end all the same
    threading.Timer(_ABORT_GIVE_UP_S, os._exit, args=(1,)).start()
    MPI.COMM_WORLD.Abort(1)


class activity:
    """``with activity(what, peers):`` names what this thread's waits are for, and the ranks
    (of the job's communicator) they wait on, for the stall watchdog. ``what`` is a string or
    a function returning one (formatted only if a wait stalls). Nested activities add detail
    to the outer one; an inner one without peers keeps the outer one's."""

    __slots__ = ("what", "peers", "outer")

    def __init__(self, what, peers=None):
        self.what = what
        self.peers = peers

    def __enter__(self):
        self.outer = _local.activity
        _local.activity = self
        return self

    def __exit__(self, *exc):
        _local.activity = self.outer
        return False

    def describe(self):
        """(what, peers) of this activity and the ones it is nested in."""
        parts, peers, current = [], None, self
        while current is not None:
            parts.append(current.what() if callable(current.what) else current.what)
            if peers is None:
                peers = current.peers
            current = current.outer
        return ", ".join(reversed(parts)), peers


class _World:
    group = None  # the job's communicator's group: peers are named by their rank in it


def set_world(comm):
    """Name peers in the stall watchdog's warnings by their rank in ``comm`` (the job's)."""
    _World.group = comm.Get_group()


def world_ranks(comm, ranks):
    """``ranks`` of ``comm`` as ranks of the job's communicator (as given if unknown)."""
    if _World.group is None:
        return list(ranks)
    group = comm.Get_group()
    try:
        return [rank if rank >= 0 else None
                for rank in MPI.Group.Translate_ranks(group, list(ranks), _World.group)]
    finally:
        group.Free()


def _register_wait():
    current = _local.activity
    what, peers = current.describe() if current is not None else ("an MPI operation", None)
    with _Waits.lock:
        _Waits.active[threading.get_ident()] = [time.monotonic(), what, peers, None]


def _unregister_wait():
    with _Waits.lock:
        _Waits.active.pop(threading.get_ident(), None)


class StallWatchdog:
    """Warns when a wait makes no progress for ``check_s`` seconds: a failed link or host
    leaves a rank waiting inside a collective, where the engine's own stall check (which
    looks at ranks that never submit) cannot run. The warning names the collective or the
    negotiation cycle, and the ranks and hosts waited on. Past ``shutdown_s`` (> 0) it ends
    the job. ``check_s`` 0: no warnings (HOROVOD_STALL_CHECK_DISABLE).

    ``peers`` (``liveness.LocalPeers``, or None): once a wait has lasted ``DEAD_PEER_AFTER_S``,
    a rank of this host whose process has ended ends the job, named: the launcher should
    have, and waiting longer cannot help. One per process, a daemon thread that checks once
    a second."""

    DEAD_PEER_AFTER_S = 5.0

    def __init__(self, rank, hosts, check_s, shutdown_s, interval_s=1.0, peers=None):
        self.rank = rank
        self.hosts = hosts
        self.check_s = check_s
        self.shutdown_s = shutdown_s
        self.interval_s = interval_s
        self.peers = peers if peers is not None and peers.watched else None
        self._gone = {}  # the waited-on peers seen ended at the last check: rank -> pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hororing-stall-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _watch(self):
        check_s = self.check_s if self.check_s > 0 else float("inf")
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            with _Waits.lock:
                waits = [list(entry) for entry in _Waits.active.values()]
                for entry in _Waits.active.values():
                    if now - entry[0] >= check_s and \
                            (entry[3] is None or now - entry[3] >= check_s):
                        entry[3] = now
            for since, what, peers, warned_at in waits:
                waited = now - since
                if 0 < self.shutdown_s <= waited:
                    end_job(f"{self.describe(waited, what, peers)} Ending the job: no progress "
                            f"for longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="
                            f"{self.shutdown_s:g}.")
                if waited >= check_s and (warned_at is None or now - warned_at >= check_s):
                    log.warning(self.describe(waited, what, peers))
            if self.peers is not None:
                self._check_peers(now, waits)

    def _check_peers(self, now, waits):
        """End the job where a rank of this host that a wait of ``DEAD_PEER_AFTER_S`` or more
        waits on has ended, seen so at two checks in a row (a peer that sent its last bytes
        and exited a moment ago ends no wait that is about to complete). Waits that name no
        peers are not judged: a rank that finished and left may not be what they wait on."""
        waited_on = {}  # rank -> the longest wait on it: (seconds, what)
        for since, what, peers, _ in waits:
            if now - since >= self.DEAD_PEER_AFTER_S and peers:
                for peer in peers:
                    if peer in self.peers.watched and now - since > waited_on.get(peer, (0,))[0]:
                        waited_on[peer] = (now - since, what)
        gone = self.peers.gone(waited_on) if waited_on else {}
        confirmed = {peer: pid for peer, pid in gone.items() if peer in self._gone}
        self._gone = gone
        if confirmed:
            waited, what = max(waited_on[peer] for peer in confirmed)
            named = ", ".join(f"rank {peer} (pid {pid})" for peer, pid in sorted(confirmed.items()))
            end_job(f"hororing: rank {self.rank} ({self._host()}) has waited {waited:.0f} s "
                    f"in {what} on {named}, whose process on this host has ended without the "
                    f"launcher ending the job. Ending it now; that rank's own output says why "
                    f"it stopped.")

    def _host(self):
        """This rank's host, as the warnings name it ("?" where the layout lacks it)."""
        return self.hosts[self.rank] if self.rank < len(self.hosts) else "?"

    def describe(self, waited, what, peers):
        if peers:
            peers = sorted(set(peer for peer in peers if peer is not None))
            on = ", ".join(f"{peer} ({self.hosts[peer]})" if 0 <= peer < len(self.hosts)
                           else str(peer) for peer in peers[:8])
            more = f" and {len(peers) - 8} more" if len(peers) > 8 else ""
            waits_on = f"rank(s) {on}{more}"
        else:
            waits_on = "every rank of the collective"
        return (f"hororing stall: rank {self.rank} ({self._host()}) has waited {waited:.0f} s "
                f"in {what} for {waits_on}, and no data came. A link or a host may have failed.")


def wait(request, deadline=None, unless_soon=None):
    """Block until ``request`` completes, polling with back-off.

    Args:
        deadline: optional ``time.monotonic()`` value; past it, give up.
        unless_soon: optional callable, called once if the request has not completed by
            the end of the spin phase (e.g. to wake peers that are not taking part yet);
            with the back-off's ``wake_late``, by the last test before the first sleep.

    Returns:
        True when the request completed, False when the deadline passed first.
    """
    return wait_until(request.Test, deadline, unless_soon)


def wait_all(requests):
    """Block until every request in the list completes, polling with back-off."""
    if requests:
        wait_until(lambda: MPI.Request.Testall(requests))


def wait_until(done, deadline=None, unless_soon=None, asleep=False):
    """Poll ``done()`` with the same back-off until it is true (or the deadline passes);
    ``unless_soon`` as for ``wait``; ``asleep``: start in the sleeping phase (the caller
    has spun and yielded already: the compiled ring's steps)."""
    spin_tests, yield_tests, max_sleep_s = (_Backoff.spin_tests, _Backoff.yield_tests,
                                            _Backoff.max_sleep_s)
    # the test from which the peers are woken: the spin's end, or the yields' last
    wake_at = max(spin_tests, yield_tests - 1) if _Backoff.wake_late else spin_tests
    tests = yield_tests if asleep else 0
    sleep_s = min(1e-5, max_sleep_s)
    registered = False
    try:
        while not done():
            tests += 1
            if deadline is not None and tests % 64 == 0 and time.monotonic() > deadline:
                return False
            if tests < spin_tests:
                continue
            if unless_soon is not None and tests >= wake_at:  # once
                unless_soon()
                unless_soon = None
            if tests < yield_tests:
                os.sched_yield()
                continue
            if not registered:  # a real wait now: the stall watchdog may look at it
                _register_wait()
                registered = True
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, max_sleep_s)
        return True
    finally:
        if registered:
            _unregister_wait()


class Exchange:
    """A collective started again and again on the same buffers (a cycle's vote, the fold's
    rows): one persistent request (MPI-4 ``MPI_Allreduce_init``, ``MPI_Allgather_init``)
    started each time, which skips the argument handling and request set-up of a fresh
    nonblocking call (measured: 1.5 against 2.4 us a 4 KiB allgather at 2 ranks), or the
    nonblocking call itself where the MPI has no persistent collectives.

    Making one is collective over ``comm``, in the same order on every rank as its other
    collectives.
    """

    def __init__(self, comm, kind, sendbuf, recvbuf, **kwargs):
        """``kind``: "allreduce" or "allgather"; ``kwargs`` as the mpi4py call's (op=)."""
        # MPI writes into the buffers on every start: they live as long as the exchange
        # (mpi4py's persistent request does not hold them; a caller's temporary was freed
        # and its memory reused while the request still wrote into it)
        self._buffers = (sendbuf, recvbuf)
        self._persistent = None
        try:
            self._persistent = getattr(comm, kind.capitalize() + "_init")(sendbuf, recvbuf,
                                                                           **kwargs)
        except (AttributeError, NotImplementedError):
            nonblocking = getattr(comm, "I" + kind)
            self._start = lambda: nonblocking(sendbuf, recvbuf, **kwargs)

    @property
    def persistent(self):
        """The persistent request, or None where the MPI has no persistent collectives."""
        return self._persistent

    def start(self):
        """Start the collective; return the request to wait on."""
        persistent = self._persistent
        if persistent is None:
            return self._start()
        persistent.Start()
        return persistent

    def free(self):
        """Release the persistent request, unless it is still running (after a failure,
        when peers may be gone: then it is left to MPI)."""
        if self._persistent is not None and self._persistent.Test():
            self._persistent.Free()
        self._persistent = None


def byte_view(array):
    """Return a contiguous array as a flat uint8 view (for byte-counted MPI calls)."""
    return array.reshape(-1).view(np.uint8)


def sendable(array):
    """``array`` as MPI takes it: itself, or a view of its memory as unsigned integers of
    its width where MPI has no type for its dtype (bfloat16)."""
    if not isinstance(array, np.ndarray):
        return array
    bits = CARRIED_AS.get(array.dtype)
    if bits is None and array.dtype.kind == "V" and is_bfloat16(array.dtype):
        bits = CARRIED_AS[array.dtype]  # ml_dtypes' bfloat16 from outside hororing, now known
    return array if bits is None else array.view(bits)
