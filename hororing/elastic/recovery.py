"""Going on with the survivors of a rank's death in this process, where the MPI allows it.

Open MPI started with ``--with-ft ulfm`` (hororun passes it in elastic mode when the Open MPI
has the extension) keeps the job alive when a rank dies: the survivors' collectives fail with
``RanksFailedError`` (``faults.py``). ``hvd.elastic.run`` then, on every survivor:

1. rolls the state back to its last commit (in memory: nothing is read from disk);
2. shrinks the job's communicator to the live processes and makes the job anew over them
   (``context.continue_with_survivors``): ranks are renumbered in their old order, so the
   lowest surviving rank is the new rank 0;
3. runs the reset callbacks, syncs the state from the new rank 0 (a rank that died inside a
   commit may have left the survivors one commit apart) and calls the training function again.

A second failure during these steps starts them again. Below hororun's ``--min-np`` the
survivors raise the error instead, and hororun relaunches the job from its newest commit when
the hosts offer enough slots; above it, the new rank 0 reports the size to hororun, which asks
the job to stop at a commit and relaunches it at full size when the hosts offer more slots
(growth needs new processes: it stays a relaunch).
"""

import logging
import sys
import time

from .. import context, faults
from .._mpi import MPI
from ..errors import RanksFailedError
from . import job

log = logging.getLogger("hororing")


def lost_peer(error):
    """Whether ``error`` says a rank of the running job died (and this MPI reports it)."""
    if isinstance(error, RanksFailedError):
        return not error.final
    if isinstance(error, MPI.Exception) and context.is_initialized():
        return faults.peer_lost(error, context.current().comm)
    return False


def go_on(error):
    """Make the job anew over the survivors of ``error``'s failure; raise ``error`` when the
    job cannot go on in process (no ULFM, PS mode) or too few ranks are left.

    Returns (the old size, the new size).
    """
    began = time.monotonic()
    try:
        before, after = context.continue_with_survivors()
    except RuntimeError as refusal:
        raise error from refusal
    if after < job.min_size():
        raise RanksFailedError(
            f"{before - after} rank(s) failed and {after} are left, fewer than --min-np "
            f"{job.min_size()}: the survivors stop; hororun relaunches the job from its newest "
            f"commit when the hosts offer {job.min_size()} slots", final=True) from error
    if context.rank() == 0:
        seconds = time.monotonic() - began
        sys.stderr.write(f"{job.SHRUNK.decode()} {after} ranks ({before - after} of {before} "
                         f"failed; the survivors shrank in {seconds:.2f} s)\n")
        sys.stderr.flush()
    log.info("going on with %d of %d ranks after a failure", after, before)
    return before, after
