"""The ``run`` decorator: the elastic training loop's entry and its answers to faults.

A dead rank is survived in process where the MPI has ULFM, else by a relaunch
(docs/elastic.md):

- In a launch that hororun started ahead to grow the job, every rank first waits there until
  the job it replaces has stopped at a commit (``job.await_handover``).
- On entry the wrapped function's state is synced: from rank 0 on a fresh job, or, in a job
  that hororun relaunched, from the newest commit that any host kept (then the reset
  callbacks run, since the job may have a new size).
- A rank died and the MPI kept the job alive (ULFM; ``RanksFailedError``): the state rolls
  back to the last commit, the survivors go on in process at the smaller size
  (``recovery.py``), the reset callbacks run, the state is synced and the function is called
  again.
- Any other ``HorovodInternalError`` (a collective failed): the state rolls back to the last
  commit and the error goes on, ending this rank; under hororun's elastic mode hororun
  relaunches the job, which resumes from the newest commit on disk. Without hororun the error
  is the caller's.
- ``HostsUpdatedInterrupt`` (hororun reported new or lost hosts; raised on every rank at the
  same commit): the state is written to disk once more and every rank exits with
  ``job.RESCALE_STATUS`` after a barrier, for hororun to relaunch at the size the hosts allow.
"""

import functools
import sys

from .. import collectives, context
from ..errors import HorovodInternalError, HostsUpdatedInterrupt, RanksFailedError
from . import job, recovery


def run_fn(func):
    """Wrap ``func(state, *args, **kwargs)`` as Horovod's ``hvd.elastic.run`` does."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        job.await_handover(collectives.barrier, context.rank())
        job.listen()
        if context.rank() == 0:
            job.mark(job.ENTERED)
        try:
            if state._resume() >= 0:
                state.on_reset()
            else:
                state.sync()
            failure = None
            while True:
                try:
                    if failure is not None:  # a rank died: go on with the survivors
                        recovery.go_on(failure)
                        state.on_reset()
                        state.sync()
                        failure = None
                    result = func(state, *args, **kwargs)
                    if context.rank() == 0:
                        job.mark(job.RETURNED)
                    return result
                except Exception as error:
                    lost = recovery.lost_peer(error)
                    if not lost and not isinstance(error, HorovodInternalError):
                        raise
                    state.restore()
                    if not lost:
                        raise
                    reason = state.lost_with_a_rank()
                    if reason is not None:
                        raise RanksFailedError(
                            f"{error} The survivors cannot go on in process: {reason}. They "
                            f"stop, and hororun's elastic mode relaunches the job from its "
                            f"newest commit on disk.", getattr(error, "ranks", ()),
                            final=True) from error
                    failure = error
        except HostsUpdatedInterrupt:
            if not job.supervised():
                raise
            _stop_for_relaunch(state)
        finally:
            job.stop_listening()

    return wrapper


run = run_fn


def _stop_for_relaunch(state):
    job.stop_listening()
    state.save()
    state._commits += 1
    if context.rank() == 0:  # hororun stops repeating its notice when it reads this
        sys.stderr.write(f"{job.ACKNOWLEDGEMENT.decode()} {context.size()} ranks stop at "
                         f"commit {state._commits} for hororun to relaunch\n")
        sys.stderr.flush()
    state._persist()
    collectives.barrier()  # every host has written before any rank's exit ends the job
    if context.rank() == 0:
        job.mark(job.STOPPED, state._commits)
    raise SystemExit(job.RESCALE_STATUS)
