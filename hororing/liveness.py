"""Whether the processes of this host's other ranks are still running.

An MPI without the ULFM extension ends the whole job when one of its processes dies: that is
its launcher's work (mpiexec's proxy sees the exit and kills the rest). Where the launcher does
not (``mpiexec -disable-auto-cleanup``, or one that misses the exit: MPICH 5.0.2's mpiexec
missed one rank's ``_exit`` in 60 runs of a 4-rank job here), the other ranks would wait on the
dead one for ever. A rank can see it for itself where the dead one ran on its own
host: its process is gone.
The stall watchdog (``transport.StallWatchdog``) asks ``LocalPeers.gone`` about the ranks a
wait of a few seconds is on, and ends the job naming those that exited.

A peer counts only where this process saw it running at ``init`` (the same process id and
start time as the peer itself read): ranks in another container or pid namespace that
report the same host name are never taken for dead. Ranks on other hosts are not watched.
"""

import os

__all__ = ["identity", "LocalPeers"]


def _stat(pid):
    """(state, start time in clock ticks) of process ``pid`` from /proc, or None where it is
    not there (gone, or /proc is not Linux's)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2:].split()  # the name may hold spaces and parentheses
    if len(fields) < 20:
        return None
    return fields[0].decode(), int(fields[19])


def identity():
    """This process as its peers will look for it: (pid, start time), the start time None
    where /proc cannot say."""
    pid = os.getpid()
    stat = _stat(pid)
    return pid, None if stat is None else stat[1]


class LocalPeers:
    """The other ranks on this host whose processes this one can watch.

    Args:
        rank: this rank.
        hosts: every rank's host name, by rank.
        identities: every rank's ``identity()``, by rank.
    """

    def __init__(self, rank, hosts, identities):
        self.watched = {}  # rank -> (pid, start time)
        for peer, (host, (pid, started)) in enumerate(zip(hosts, identities)):
            if peer == rank or host != hosts[rank] or started is None:
                continue
            stat = _stat(pid)
            if stat is not None and stat[1] == started:  # the same process, seen from here
                self.watched[peer] = (pid, started)

    def gone(self, ranks=None):
        """{rank: pid} of the watched peers (of ``ranks``, where given) whose process has
        ended (exited, or a zombie its parent has not collected)."""
        ended = {}
        for peer in self.watched if ranks is None else ranks:
            pid, started = self.watched[peer]
            stat = _stat(pid)
            if stat is None or stat[1] != started or stat[0] in ("Z", "X"):
                ended[peer] = pid
        return ended
