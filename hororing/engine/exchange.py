"""How a negotiation cycle talks to its peers: the only messages a cycle sends.

A cycle (``cycle.py``) needs three collectives: a repeated one on fixed buffers (the vote's
bitwise AND, the fold's allgather of rows), an allgather of header rows, and an allgatherv
of variable-length notes. ``MpiExchange`` runs them on a communicator of its own. Each call
returns a request to wait on with ``transport.wait`` (anything with ``Test()``), so a cycle
can also run against an in-process stand-in that plays several ranks in one process (the
unit tests' ``LocalExchange``).
"""

import numpy as np

from .. import faults, transport
from .._mpi import MPI


class MpiExchange:
    """The negotiation's collectives over MPI, on a duplicate of ``comm``."""

    def __init__(self, comm):
        self.comm = faults.track(comm.Dup())
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()

    def repeated(self, kind, sendbuf, recvbuf, op=None):
        """A collective started again and again on the same buffers (``transport.Exchange``):
        ``kind`` "allreduce" (with ``op``) or "allgather". Collective to make."""
        kwargs = {} if op is None else {"op": {"band": MPI.BAND}[op]}
        return transport.Exchange(self.comm, kind, sendbuf, recvbuf, **kwargs)

    def allgather(self, row, rows):
        """Every rank's ``row`` into ``rows`` (one row per rank); the request."""
        return self.comm.Iallgather(row, rows)

    def allgatherv(self, own, gathered, lengths, offsets):
        """Every rank's bytes ``own`` into the uint8 ``gathered`` (rank r's ``lengths[r]``
        bytes at ``offsets[r]``); the request."""
        return self.comm.Iallgatherv(np.frombuffer(own, dtype=np.uint8),
                                     [gathered, lengths, offsets, MPI.BYTE])

    def free(self):
        self.comm.Free()
