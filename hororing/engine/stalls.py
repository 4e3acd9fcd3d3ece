"""What the background thread watches for: a stall (a tensor some ranks submitted and
others, after a while, did not) and a deadlock (every rank blocked on names no other rank
submitted, ``deadlocks.py``).

The driver calls ``Watch.check`` after its cycles; when to look, what is said and when the
job ends is here. Every rank reads the same negotiation table, so every rank names the same
missing ranks.
"""

import logging
import time

from .. import transport
from .negotiation import JOIN_NAME

log = logging.getLogger("hororing")

# How often the stall check runs, and how long a tensor announced by its cache bit may wait
# before its rank asks for a gathered cycle (so the stall warning can name who is missing).
# Not a speed setting: one pass over the pending requests a second costs nothing measurable.
CHECK_EVERY_S = 1.0


class Watch:
    """The checks of one rank's engine.

    Args:
        config: ``config()`` returns the engine's ``Config`` now (its stall and deadlock
            settings are read at each check: a test or the user may replace it).
        cycle: the engine's ``Cycle``.
        blocked: ``blocked(now)`` is True when this rank is blocked (``Engine._blocked``).
        gather: runs a gathered cycle now (asked of the cycle first).
    """

    def __init__(self, config, cycle, rank, blocked, gather):
        self.config = config
        self._cycle = cycle
        self._rank = rank
        self._blocked = blocked
        self._gather = gather
        self.next_stall_check = time.monotonic() + CHECK_EVERY_S
        self._next_deadlock_check = 0.0

    def check(self):
        now = time.monotonic()
        config = self.config()
        if now >= self._next_deadlock_check and self._blocked(now):
            # blocked for the grace: a gathered cycle, in which every rank says whether it is
            # blocked too (once per grace period)
            self._next_deadlock_check = now + config.deadlock_grace_seconds
            self._gather()
        if not config.stall_check_enabled or now < self.next_stall_check:
            return
        self.next_stall_check = now + CHECK_EVERY_S
        if any(now - request.submitted >= CHECK_EVERY_S
               for request in self._cycle.waiting_by_bit()):
            # announced by bit, it is invisible to the table: a gathered cycle puts it there,
            # so the ranks that never submit it can be named
            self._gather()
            now = time.monotonic()
        report(self._cycle.negotiator, self._rank, now, config.stall_check_seconds,
               config.stall_shutdown_seconds)


def report(negotiator, rank, now, check_seconds, shutdown_seconds):
    """Warn of every tensor that has waited at least ``check_seconds`` for some rank (on
    rank 0 and on the missing ranks); end the job when one has waited
    ``shutdown_seconds`` (0: never)."""
    for name, missing, waited in negotiator.stalled(now, check_seconds):
        kind = "join" if name == JOIN_NAME else name
        message = (f"hororing stall: tensor '{kind}' has been waiting {waited:.0f} s for "
                   f"rank(s) {missing} to submit it. One or more ranks may have called a "
                   f"different collective, or none; every rank must call the same "
                   f"collectives in the same order.")
        if rank == 0 or rank in missing:
            log.warning(message)
        if shutdown_seconds > 0 and waited >= shutdown_seconds:
            transport.end_job(f"[rank {rank}] {message} Ending the job: stalled longer than "
                              f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={shutdown_seconds:g}.")
