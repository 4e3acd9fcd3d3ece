"""A peer process that died, as an MPI with the ULFM extension reports it, and what every
survivor does about it at once.

Open MPI started with ``--with-ft ulfm`` keeps a job alive when one of its processes dies: an
operation that involved the dead process fails with MPI_ERR_PROC_FAILED (or
MPI_ERR_PROC_FAILED_PENDING), and any operation on a communicator that some rank revoked fails
with MPI_ERR_REVOKED. Survivors whose operations never involve the dead process (two neighbours
in a ring step, waiting on each other) would not learn of it, so the first rank to see the
failure revokes every communicator hororing made (``track``); each survivor's next or current
operation then fails as well, and its pending collectives fail with ``RanksFailedError``.

What happens next, going on with the survivors, is the elastic layer's (``elastic/recovery``).
An MPI without the extension (MPICH from PyPI, Open MPI without ``--with-ft``) ends the job
itself when a process dies; nothing here applies to it.
"""

import threading

from ._mpi import MPI, leave_without_finalize
from .errors import RanksFailedError


class _Tracked:
    lock = threading.Lock()
    comms = []  # every communicator hororing made for the job now running
    lost = None  # the error classes of a dead peer (empty: this MPI has no ULFM); at first use


def _lost():
    """The error classes that say a peer died (read from MPI once; MPI is up by then)."""
    if _Tracked.lost is None:
        values = {getattr(MPI, name, None) for name in
                  ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")}
        values.discard(None)
        # an MPI without the extension gives the three names one placeholder value (MPICH: 13)
        _Tracked.lost = frozenset(values) if len(values) == 3 else frozenset()
    return _Tracked.lost


def supported():
    """Whether the loaded MPI has the ULFM extension (it may still run without it enabled)."""
    return bool(_lost()) and hasattr(MPI.Comm, "Revoke") and hasattr(MPI.Comm, "Shrink")


def track(comm):
    """Remember ``comm`` (one hororing made) to revoke when a peer dies; returns it."""
    if _lost():
        with _Tracked.lock:
            _Tracked.comms.append(comm)
    return comm


def forget_all():
    """The job's communicators are gone (shutdown, or a recovery made new ones)."""
    with _Tracked.lock:
        _Tracked.comms = []


def peer_lost(error, comm):
    """Whether ``error`` (any exception) says a process of ``comm``'s job died."""
    lost = _lost()
    if not lost or not isinstance(error, MPI.Exception):
        return False
    error_class = error.Get_error_class()
    if error_class in lost:
        return True
    # a Testall/Testsome reports a failed request's error in its status only, and Open MPI's
    # nonblocking collectives (a persistent allgather's schedule that met the dead peer)
    # complete with MPI_ERR_OTHER: a peer's death this process knows of, or a communicator a
    # survivor revoked, says which
    return error_class in (MPI.ERR_IN_STATUS, MPI.ERR_OTHER) and \
        (bool(failed_ranks(comm)) or _any_revoked())


def _any_revoked():
    with _Tracked.lock:
        comms = list(_Tracked.comms)
    for comm in comms:
        try:
            if comm.Is_revoked():
                return True
        except Exception:  # freed: not the one
            continue
    return False


def failed_ranks(comm):
    """The ranks of ``comm`` this process knows to have failed (ULFM's local knowledge)."""
    try:
        failed = comm.Get_failed()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return []
    try:
        count = failed.Get_size()
        if count == 0:
            return []
        group = comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(failed, list(range(count)), group)
        finally:
            group.Free()
    finally:
        failed.Free()
    return sorted(rank for rank in ranks if rank is not None and rank >= 0)


def revoke_all():
    """Revoke every communicator hororing made: every survivor's operations on them fail
    now, wherever it waits, instead of waiting for a peer that left them. A peer died: this
    process will exit without MPI_Finalize (``_mpi.py``)."""
    leave_without_finalize()
    with _Tracked.lock:
        comms = list(_Tracked.comms)
    for comm in comms:
        try:
            comm.Revoke()
        except Exception:  # already revoked, or freed: nothing more to tell
            pass


def error_for(error, comm, rank):
    """The ``RanksFailedError`` the survivors' collectives fail with, for the MPI ``error``
    this rank saw (``comm``: the job's communicator, ``rank``: this rank in it)."""
    ranks = failed_ranks(comm)
    which = (f"rank(s) {', '.join(map(str, ranks))} of {comm.Get_size()}" if ranks else
             "a peer rank (another survivor saw it first and revoked the job)")
    return RanksFailedError(
        f"{which} failed: the process is gone (MPI: {error.Get_error_string()}). Rank {rank}'s "
        f"collectives fail until the job goes on with the survivors: hvd.elastic.run does that "
        f"in this process (ULFM), and hororun's elastic mode relaunches where it cannot.", ranks)
