"""Hierarchical allreduce: reduce inside each node, across nodes by slices, gather back.

Three stages on one flat host buffer, in place or from a separate input:

1. inside each node, a ring reduce-scatter: local rank j ends holding its node's sum of
   part j of the buffer;
2. across nodes, a ring allreduce of part j among the ranks with local rank j (one per
   node), so every byte crosses between nodes once per node slice instead of travelling the
   whole flat ring;
3. inside each node, an allgather of the parts.

Nodes of different sizes: the buffer is cut into as many parts as the smallest node has
ranks (P). Every node has a rank for each part; in larger nodes the local ranks from P up
hold an empty part and take no cross-node step. Every rank ends with the same bytes: each
part is reduced once, by the cross-node ring, and copied from there.

"Node" is what MPI calls a shared-memory domain (``MPI_COMM_TYPE_SHARED``): the ranks of one
host, or, under MPICH's ``MPIR_CVAR_NUM_CLIQUES``, one simulated node.
"""

from .._mpi import MPI

from .. import faults, transport
from .base import Algorithm
from .plan import chunk_bounds
from .ring import Ring


def node_layout(comm):
    """Return (local communicator, number of nodes, smallest node's rank count) for ``comm``.

    Collective over ``comm``.
    """
    local = faults.track(comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank()))
    nodes = comm.allreduce(1 if local.Get_rank() == 0 else 0, op=MPI.SUM)
    smallest = comm.allreduce(local.Get_size(), op=MPI.MIN)
    return local, nodes, smallest


class Hierarchical(Algorithm):
    """Executes hierarchical allreduces on one communicator (see the module docstring).

    Collective to construct: every rank of ``comm`` builds one at the same time.
    """

    def __init__(self, comm, subchunk_bytes, layout=None, cross_subchunk_bytes=None,
                 cross_piece_ceiling=0):
        """``subchunk_bytes``: the ring within each node's; ``cross_subchunk_bytes``: the ring
        across nodes' (default: the same), and ``cross_piece_ceiling`` its pieces' ceiling
        (``Ring``'s ``piece_ceiling``); each a size or a function, as ``Ring``'s."""
        self.comm = comm
        self.size = comm.Get_size()
        self.contributors = self.size
        self.local, self.nodes, self.parts = layout or node_layout(comm)
        self.local_rank = self.local.Get_rank()
        self.local_size = self.local.Get_size()
        color = self.local_rank if self.local_rank < self.parts else MPI.UNDEFINED
        self.cross = faults.track(comm.Split(color, key=comm.Get_rank()))
        self.local_ring = Ring(self.local, subchunk_bytes)
        self.cross_ring = Ring(self.cross, cross_subchunk_bytes or subchunk_bytes,
                               piece_ceiling=cross_piece_ceiling) \
            if self.cross != MPI.COMM_NULL else None

    out_of_place = True

    def allreduce(self, buffer, op, finalize=None, segments=None, source=None):
        """Reduce the flat ``buffer`` over all ranks (arguments as ``Ring.allreduce``): out of
        place, the node's reduce-scatter reads ``source`` and the gather writes the rest."""
        parts = chunk_bounds(buffer.size, self.parts)
        empty = (buffer.size, buffer.size)
        bounds = parts + [empty] * (self.local_size - self.parts)
        self.local_ring.reducescatter(buffer, op, bounds, source=source)
        if self.cross_ring is not None:
            start, stop = bounds[self.local_rank]
            self.cross_ring.allreduce(buffer[start:stop], op, finalize)
        self._gather_parts(buffer, bounds)

    def cross_bytes_sent(self):
        """Bytes this rank has sent to other nodes (the cross-node ring's sends)."""
        return self.cross_ring.bytes_sent if self.cross_ring is not None else 0

    def _gather_parts(self, buffer, bounds):
        if self.local_size == 1:
            return
        itemsize = buffer.itemsize
        counts = [(stop - start) * itemsize for start, stop in bounds]
        displacements = [start * itemsize for start, _ in bounds]
        request = self.local.Iallgatherv(
            MPI.IN_PLACE, [transport.byte_view(buffer), counts, displacements, MPI.BYTE])
        transport.wait(request)

    def free(self, clean=True):
        for comm in (self.cross, self.local):
            if comm != MPI.COMM_NULL:
                comm.Free()
