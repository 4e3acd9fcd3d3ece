"""The stall warning: a tensor some ranks submitted and others, after a while, did not.

The driver looks once a second (``Engine._check_stalls``); what it says, and when it ends
the job, is here. Every rank reads the same negotiation table, so every rank names the
same missing ranks.
"""

import logging

from .. import transport
from .negotiation import JOIN_NAME

log = logging.getLogger("hororing")


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
