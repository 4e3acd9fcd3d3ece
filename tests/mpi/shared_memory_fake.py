"""A stand-in for the GPU's shared device memory, for the device-direct ring on a CPU.

``SharedHostMemory`` has the device memory interface the ring uses (``share``, ``copy``,
``record``, ``wait_pointer``, ``empty_bytes``, ``synchronize``, ``stream``) over numpy arrays;
``share`` allocates an MPI shared-memory window on the node, so each rank really reads and
writes the other processes' memory, as CUDA IPC lets GPU ranks do. Copies run at once (a
stream that has always finished), so the events order nothing here: the fake records which
peer's event each wait names, for the tests to check against the ring's steps. Each copy
first sleeps a random few hundred microseconds (seeded by rank), so a rank that reads a peer's
chunk before the barrier that orders it would read stale values and the test would see it.
"""

import time

import numpy as np
from mpi4py import MPI


class SharedHostMemory:
    name = "shared host memory (test fake)"
    can_share = True

    def __init__(self, rank, refuse=False):
        """``refuse``: this rank's share() fails, as a driver refusing an IPC handle."""
        self.refuse = refuse
        self.rng = np.random.default_rng(rank)
        self.windows = []  # every window made, kept until close()
        self.shares = 0
        self.released = False
        self.recorded, self.waited = [], []  # events, in call order

    stream = "the fake's stream"

    def share(self, comm, nbytes, events=0):
        from hororing.gpu.cupy_memory import SharedBuffers

        window = MPI.Win.Allocate_shared(nbytes, 1, comm=comm)  # collective
        self.windows.append(window)  # freed by close(): MPI frees windows collectively
        self.shares += 1
        if self.refuse:
            raise RuntimeError("cudaErrorMapBufferObjectFailed (pretend)")
        peers = []
        for peer in range(comm.Get_size()):
            memory, _ = window.Shared_query(peer)
            peers.append(np.frombuffer(memory, np.uint8, nbytes))
        self.released = False

        def release():
            self.released = True
        shared = SharedBuffers(peers[comm.Get_rank()], peers, release)
        # an event is (rank, index): what a wait names
        shared.events = [[(peer, index) for index in range(events)]
                         for peer in range(comm.Get_size())]
        return shared

    def record(self, stream, event=None):
        self.recorded.append(event)
        return event

    def wait_pointer(self, stream, event):
        self.waited.append(event)

    def close(self):
        """Free every window made (collective: every rank made the same ones)."""
        for window in self.windows:
            window.Free()
        self.windows = []

    def copy(self, target, source, stream=None):
        time.sleep(self.rng.uniform(0, 3e-4))
        target[...] = source

    @staticmethod
    def empty_bytes(nbytes):
        return np.empty(nbytes, np.uint8)

    @staticmethod
    def synchronize():
        pass
