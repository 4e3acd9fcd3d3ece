"""Wake-ups: a peer that starts a cycle is seen by this rank's next poll, even when another
message of that peer's (the first of its cycle's collective) arrived just before it."""

import os
import tempfile
import time

import numpy as np
import pytest
from mpi4py import MPI

from hororing.engine.wakeups import Wakeups

SINGLE = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="a wake-up needs two ranks")


@SINGLE
def test_a_wake_up_behind_another_message_is_seen_by_one_poll():
    world = MPI.COMM_WORLD
    rank, last = world.Get_rank(), world.Get_size() - 1
    other = world.Dup()  # stands for the negotiation communicator
    wakeups = Wakeups(world)
    folder = world.bcast(tempfile.mkdtemp() if rank == 0 else None)
    sent_flag = os.path.join(folder, "sent")
    world.Barrier()
    first = np.full(4, 3.0)
    if rank == last:
        # the late rank's cycle: its collective's first message, then the wake-up, sent
        # while the peer is not calling MPI at all
        request = other.Isend(first, 0, tag=5)
        wakeups.send(9)
        request.Wait()
        wakeups.flush()  # both are on their way: only the peer's polling is left
        with open(sent_flag, "w"):
            pass
    seen = None
    if rank == 0:
        # learn that both were sent without calling MPI (which would receive them)
        deadline = time.monotonic() + 120.0
        while not os.path.exists(sent_flag) and time.monotonic() < deadline:
            time.sleep(0.001)
        seen = wakeups.latest()  # one poll, as the engine makes between its sleeps
        received = np.zeros(4)
        other.Recv(received, last, tag=5)
        np.testing.assert_array_equal(received, first)
        os.remove(sent_flag)
        os.rmdir(folder)
    wakeups.close(time.monotonic() + 60.0)
    other.Free()
    assert world.bcast(seen) == 9, "the peer's wake-up was not seen by one poll"
