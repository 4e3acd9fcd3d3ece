"""What both sharded optimizers (ZeRO) share: how a flat vector is split over the ranks, and
the allgather of the updated parameters.

A ring allreduce is a reduce-scatter followed by an allgather. A sharded optimizer keeps a
group's parameters of one dtype as one flat vector, cut into buckets (``Buckets``), each
split over the set's ranks as ``reducescatter`` splits it (``Layout``). Each step every
bucket's gradient vector is reduce-scattered through the engine, in place
(``collectives.reducescatter_async_``), so this rank holds the reduced gradient of its chunk
of every bucket; the optimizer steps those chunks; ``ParameterGather`` allgathers the updated
chunks into every rank's vector, in place. The bindings (``torch/sharded.py``, ``optim.py``)
keep the vectors and the wrapped optimizer.
"""

from . import faults, transport
from ._mpi import MPI
from .algorithms.plan import chunk_bounds


class Layout:
    """How a flat vector of ``numel`` elements of ``itemsize`` bytes is split over ``size``
    ranks; ``start:stop`` is rank ``rank``'s chunk."""

    def __init__(self, numel, itemsize, rank, size):
        self.bounds = tuple(chunk_bounds(numel, size))  # the first numel % size one longer
        self.start, self.stop = self.bounds[rank]
        self.byte_counts = [(stop - start) * itemsize for start, stop in self.bounds]
        self.byte_offsets = [start * itemsize for start, _ in self.bounds]


class Buckets:
    """A flat vector cut into buckets at the element offsets ``cuts``, each bucket split over
    the ranks as ``reducescatter`` splits it (``Layout``): a rank's share of the vector is its
    chunk of every bucket, ``owned`` (one absolute ``(start, stop)`` range per bucket, empty
    where a bucket has fewer elements than ranks). Each bucket is reduce-scattered on its own,
    as soon as its gradients are ready, and still every rank steps 1/n of it."""

    def __init__(self, numel, itemsize, rank, size, cuts=()):
        edges = [0, *cuts, numel]
        self.itemsize = itemsize
        self.ranges = list(zip(edges[:-1], edges[1:]))
        self.layouts = [Layout(high - low, itemsize, rank, size) for low, high in self.ranges]
        self.owned = [(low + layout.start, low + layout.stop)
                      for (low, _), layout in zip(self.ranges, self.layouts)]


class ParameterGather:
    """A process set's allgathers of the updated parameters, on a communicator of its own
    (made collectively over the set's ``group``)."""

    def __init__(self, group):
        self.rank, self.size = group.rank, group.size
        self._comm = faults.track(group.comm.Dup())

    def check_same(self, mine, what):
        """Raise ValueError on every rank unless every rank's ``mine`` (a description of its
        vectors, e.g. their dtypes and lengths) is the same: before any data moves."""
        for rank, theirs in enumerate(self._comm.allgather(mine)):
            if theirs != mine:
                raise ValueError(f"sharded optimizer: rank {rank}'s {what} are {theirs}, this "
                                 f"rank's {mine}; every rank must wrap the same model's "
                                 f"parameters in the same groups")

    def gather(self, values, buckets):
        """Fill the flat ``values`` (its bytes: a uint8 array) with every rank's chunk of each
        bucket of ``buckets`` (a ``Buckets``; this rank's in place), the buckets' allgathers
        in flight together."""
        itemsize = buckets.itemsize
        transport.wait_all([self._comm.Iallgatherv(
            MPI.IN_PLACE, [values[low * itemsize:high * itemsize],
                           (layout.byte_counts, layout.byte_offsets), MPI.BYTE])
            for (low, high), layout in zip(buckets.ranges, buckets.layouts)])

    def free(self):
        self._comm.Free()
