"""The two halves of a sharded optimizer step (ZeRO), on flat numpy vectors.

A ring allreduce is a scatter-reduce followed by an allgather. A sharded optimizer keeps a
group's parameters of one dtype as one flat vector, split over the set's ranks as
``reducescatter`` splits (``Layout``). Each step, ``Halves.reduce`` scatter-reduces the flat
gradient vector so this rank holds the reduced gradient of its slice; the optimizer steps
that slice; ``Halves.gather`` allgathers the updated slices into every rank's vector, in
place. The bindings (``torch/sharded.py``, ``optim.py``) keep the vectors and the wrapped
optimizer; this module moves the bytes. The torch binding cuts its vectors into buckets
(``Buckets``), reduce-scatters each through the engine during backward
(``reducescatter_async_``) and allgathers them here (``Halves.gather_buckets``).
"""

import numpy as np

from . import ops, transport
from ._mpi import MPI
from .algorithms.plan import chunk_bounds
from .algorithms.ring import Ring
from .engine import Meta, scaling
from .kernels import scale_into


class Layout:
    """How a flat vector of ``numel`` elements of ``itemsize`` bytes is split over ``size``
    ranks; ``start:stop`` is rank ``rank``'s slice."""

    def __init__(self, numel, itemsize, rank, size):
        self.numel = numel
        self.bounds = tuple(chunk_bounds(numel, size))  # the first numel % size one longer
        self.start, self.stop = self.bounds[rank]
        self.byte_counts = [(stop - start) * itemsize for start, stop in self.bounds]
        self.byte_offsets = [start * itemsize for start, _ in self.bounds]


class Buckets:
    """A flat vector cut into buckets at the element offsets ``cuts``, each bucket split over
    the ranks as ``reducescatter`` splits it (``Layout``): a rank's slice of the vector is its
    chunk of every bucket, ``owned`` (one absolute ``(start, stop)`` range per bucket, empty
    where a bucket has fewer elements than ranks). Each bucket is reduce-scattered on its own,
    as soon as its gradients are ready, and still every rank steps 1/n of it."""

    def __init__(self, numel, itemsize, rank, size, cuts=()):
        edges = [0, *cuts, numel]
        self.numel, self.itemsize = numel, itemsize
        self.ranges = list(zip(edges[:-1], edges[1:]))
        self.layouts = [Layout(high - low, itemsize, rank, size) for low, high in self.ranges]
        self.owned = [(low + layout.start, low + layout.stop)
                      for (low, _), layout in zip(self.ranges, self.layouts)]


class Halves:
    """A process set's sharded steps: the library's ring scatter-reduces, MPI allgathers,
    on a communicator of their own (made collectively over the set's ``group``)."""

    def __init__(self, group, subchunk_bytes):
        self.rank, self.size = group.rank, group.size
        self._comm = group.comm.Dup()
        self._ring = Ring(self._comm, subchunk_bytes)

    def check_same(self, mine, what):
        """Raise ValueError on every rank unless every rank's ``mine`` (a description of its
        vectors, e.g. their dtypes and lengths) is the same: before any data moves."""
        for rank, theirs in enumerate(self._comm.allgather(mine)):
            if theirs != mine:
                raise ValueError(f"sharded optimizer: rank {rank}'s {what} are {theirs}, this "
                                 f"rank's {mine}; every rank must wrap the same model's "
                                 f"parameters in the same groups")

    def reduce(self, gradients, layout, op=ops.Average, prescale=1.0, postscale=1.0,
               dtype=None, wire=""):
        """Scatter-reduce the flat ``gradients`` (summed in their dtype); return this rank's
        slice of it, scaled as the engine scales an allreduce of ``dtype`` (default: the
        vector's) sent as ``wire`` (``engine.allreduce.scaling``: ``prescale`` before,
        ``postscale`` after, Average's division by the ranks after the sum, or before it for
        a 16-bit wire; a float16 tensor's float32 sum rounded to float16 first). The rest of
        ``gradients`` holds partial sums afterwards."""
        factor, finalize = scaling(Meta("allreduce", dtype=dtype or gradients.dtype.name, op=op,
                                        prescale=prescale, postscale=postscale, wire=wire),
                                   self.size)
        scale_into(gradients, factor)
        self._ring.reducescatter(gradients, "sum", layout.bounds)
        mine = gradients[layout.start:layout.stop]
        if finalize is not None:
            finalize(mine)
        return mine

    def gather(self, values, layout):
        """Fill the flat ``values`` with every rank's slice of it (this rank's in place)."""
        self._comm.Allgatherv(MPI.IN_PLACE, [values.view(np.uint8),
                                             (layout.byte_counts, layout.byte_offsets),
                                             MPI.BYTE])

    def gather_buckets(self, values, buckets):
        """``gather`` for each bucket of ``buckets`` (a ``Buckets``) in the flat ``values``
        (its bytes: a uint8 array), the buckets' allgathers in flight together."""
        itemsize = buckets.itemsize
        transport.wait_all([self._comm.Iallgatherv(
            MPI.IN_PLACE, [values[low * itemsize:high * itemsize],
                           (layout.byte_counts, layout.byte_offsets), MPI.BYTE])
            for (low, high), layout in zip(buckets.ranges, buckets.layouts)])

    def free(self):
        self._comm.Free()
