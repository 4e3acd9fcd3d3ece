"""Wake-ups: how a rank that starts a cycle asks its peers to take part.

A wake-up is one int64 word, the cycle number, sent to every peer on a communicator of its
own. They are received through one pre-posted receive per peer, never a single wildcard
receive: some transports (MPICH over UCX between nodes) can leave a message that has
arrived unmatched by an ``ANY_SOURCE`` receive, which stalled every rank waiting on the
cycle. A receive per peer is matched by that peer's messages in the order they were sent
(MPI's non-overtaking rule), so each wake-up is seen. Each rank counts what it sent to each
peer; at shutdown the counts are exchanged and every wake-up still in flight is received
before the receives are cancelled, so no message is left for the transport to warn about.

Whether a wake-up is answered at once is the engine's choice, with one exception kept here
(``CallerGrace``): a wake-up that finds nothing to do on a rank whose caller is in a loop of
lane calls is left for that caller for a moment.
"""

import time

import numpy as np

from .. import faults, transport
from .._mpi import MPI

WAKE_TAG = 1

# A peer's wake-up that finds nothing queued or pending on a rank whose caller started a lane's
# call within LANE_LOOP_S is left to that caller for up to LANE_GRACE_S (CallerGrace)
LANE_LOOP_S = 0.05
LANE_GRACE_S = 0.002


class Wakeups:
    """This rank's wake-up receives (one per peer) and sends, on its own communicator."""

    def __init__(self, comm):
        self.comm = faults.track(comm.Dup())
        size, rank = self.comm.Get_size(), self.comm.Get_rank()
        self._peers = [peer for peer in range(size) if peer != rank]
        self._inbox = np.zeros((size, 1), dtype=np.int64)  # one slot per peer
        self._receives = [self.comm.Irecv(self._inbox[peer], peer, WAKE_TAG)
                          for peer in self._peers]
        self._sent = np.zeros(size, dtype=np.int64)
        self._received = np.zeros(size, dtype=np.int64)
        self._sends = []
        self._patience = max(2, size)
        self.asked = 0  # the highest cycle a peer has asked for, ever (0: none)

    def latest(self, patience=None):
        """Take in the peers' wake-ups; return the highest cycle any peer has ever asked
        for (0: none). Cumulative: a wake-up taken in by one caller (the background thread,
        which may leave it for this rank's caller) is still known to the next.

        Tests until ``patience`` tests in a row find nothing (default: one per rank, at
        least 2). A progress call of MPICH's shared-memory transport takes in one message,
        looking at one sender's mailbox after another, so a wake-up that arrived behind
        another message (its sender's collective, posted first) or in another sender's
        mailbox is seen only by a later test: measured, 2 tests at 2 and 3 ranks, up to 4
        at 4 ranks and 8 at 8. One test is enough where a cycle runs anyway and only the
        number of a wake-up already taken in is wanted.
        """
        if patience is None:
            patience = self._patience
        latest = self.asked
        if not self._receives:
            return latest
        quiet = 0
        receives = self._receives
        while True:
            if len(receives) == 1:  # one peer: Test is a third of Testsome's cost
                done = (0,) if receives[0].Test() else None
            else:
                done = MPI.Request.Testsome(receives)
            if not done:  # None or empty: nothing has arrived
                quiet += 1
                if quiet >= patience:
                    self.asked = latest
                    return latest
                continue
            quiet = 0
            for index in done:
                peer = self._peers[index]
                latest = max(latest, int(self._inbox[peer, 0]))
                self._received[peer] += 1
                self._receives[index] = self.comm.Irecv(self._inbox[peer], peer, WAKE_TAG)

    def send(self, cycle):
        """Ask every peer to take part in ``cycle``."""
        if self._sends and MPI.Request.Testall(self._sends):
            self._sends = []
        word = np.array([cycle], dtype=np.int64)
        for peer in self._peers:
            self._sends.append(self.comm.Isend(word, peer, WAKE_TAG))
            self._sent[peer] += 1

    def flush(self):
        """Wait until this rank's wake-ups have left it (sends complete locally)."""
        MPI.Request.Waitall(self._sends)
        self._sends = []

    def close(self, drain_deadline=None):
        """Receive what is still in flight (collective; skipped without a deadline, e.g.
        after a failure, when peers may be gone), cancel the receives, free the communicator."""
        if drain_deadline is not None:
            self._drain(drain_deadline)
        for request in self._receives:
            if not request.Test():
                request.Cancel()
                request.Wait()
        self.flush()
        self.comm.Free()

    def _drain(self, deadline):
        """Receive every wake-up the peers sent this rank. The peers' sent counts come in one
        exchange; past the deadline (a peer that died) the rest is left to MPI."""
        if not self._peers:
            return
        sent_to_me = np.zeros_like(self._sent)
        if not transport.wait(self.comm.Ialltoall(self._sent, sent_to_me), deadline=deadline):
            return

        def all_received():
            self.latest()
            return not (sent_to_me > self._received).any()
        transport.wait_until(all_received, deadline=deadline)


class CallerGrace:
    """Whether a peer's wake-up is left for this rank's caller.

    A peer whose lane call spun out sends a wake-up; answered by the background thread while
    this rank's caller is between two calls, the cycle is empty here, and the peers' lane
    calls go the usual way, as does this rank's own call a moment later. So while the caller
    is in a loop of lane calls (it started one within ``LANE_LOOP_S``: the engine sets
    ``lane_at``) a wake-up younger than ``LANE_GRACE_S`` is left for it. A caller that does
    not come costs its peers the grace once per cycle they start.
    """

    def __init__(self):
        self.lane_at = -LANE_LOOP_S  # when this rank's caller last started a lane's call
        self._deferred = (0, 0.0)  # (the wake-up left for the caller, since when)

    def leave(self, asked):
        """True while the wake-up for cycle ``asked`` (nothing queued or pending here) is
        left for the caller."""
        now = time.monotonic()
        if now - self.lane_at > LANE_LOOP_S:
            return False
        number, since = self._deferred
        if number != asked:
            self._deferred = (asked, now)
            return True
        return now - since < LANE_GRACE_S
