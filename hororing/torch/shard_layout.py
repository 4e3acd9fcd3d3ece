"""Where a sharded optimizer's parameters and gradients live (``sharded.py`` steps them).

A ``GroupVector`` is one parameter group's parameters of one dtype as one flat parameter
vector (every parameter's data a view into it), cut into ``Bucket``s of whole parameters; each bucket
has a gradient vector (every ``.grad`` a view into it during backward) split over the ranks
as ``reducescatter`` splits it (``zero.Buckets``), and this rank's chunk of each is what its
optimizer steps, as leaf tensors (``leaves``) viewing the parameter vector. Stage 2's buckets
take their gradient vectors from a ``Pool`` and give them back once reduced.
"""

import numpy as np
import torch

from ..engine import assign
from ..zero import Buckets
from .bridge import engine_meta, zeros


class Bucket:
    """A run of a group vector's parameters, back to back in its flat vectors, whose gradients are
    reduce-scattered together as soon as the last of them is ready (during backward)."""

    def __init__(self, index, parameters, low, high, layout, offset):
        self.index = index
        self.parameters = parameters
        self.low, self.high = low, high
        self.layout = layout  # zero.Layout of the bucket: this rank's chunk of it
        self.offset = offset  # where this rank's chunk lies in the group vector's reduced vector
        self.gradients = None  # the bucket's flat gradient vector, while it is held
        self._vector = None  # what ``gradients`` views (a pool's vector)
        self.views = {}  # parameter -> its .grad's view into ``gradients``
        self.launched = None  # (handle, payload dtype, compression ctx) while in flight
        self.collected = False  # reduced this step (until the step's synchronize ends)
        self.reduced = None  # where this rank's chunk of the reduced gradient is kept

    def hold(self, count, dtype, pool):
        """Take a gradient vector (a stage-2 bucket has none between steps): one from
        ``pool`` (vectors let go by buckets whose reduction is done, each as long as the
        largest bucket), else a new one."""
        if self.gradients is None:
            self._vector = pool.take(count, dtype)
            self.gradients = self._vector[:count]
            offset = 0
            for parameter in self.parameters:
                size = parameter.numel()
                self.views[parameter] = self.gradients[offset:offset + size].view_as(parameter)
                offset += size

    def release(self, pool):
        pool.give(self._vector)
        self._vector = self.gradients = None
        self.views = {}


class Pool:
    """Gradient vectors for a stage-2 group vector's buckets, reused from bucket to bucket: a bucket
    takes one at its first gradient and gives it back once its reduction is collected, so
    the vectors in use are as many as buckets are in flight at once (not one per bucket).
    Between steps the pool keeps a few of them (``trim``) (the next step's first buckets pay for no
    fresh pages) and lets the rest go. ``count``: every vector's length (the largest
    bucket's); None: a vector per bucket, held for good (stage 1)."""

    def __init__(self, count):
        self.count = count
        self.free = []
        self.made = []

    def take(self, count, dtype):
        """A vector of at least ``count`` elements."""
        if self.free:
            return self.free.pop()
        vector = zeros(count if self.count is None else self.count, dtype)
        self.made.append(vector)
        return vector

    def give(self, vector):
        if self.count is not None:
            self.free.append(vector)

    def trim(self, keep):
        """Let all but ``keep`` free vectors go (between steps)."""
        while len(self.free) > keep:
            vector = self.free.pop()
            self.made = [made for made in self.made if made is not vector]

    def held_bytes(self):
        return sum(vector.nbytes for vector in self.made)


class GroupVector:
    """One group's parameters of one dtype, as one flat vector: this rank's slice of it."""

    def __init__(self, parameters, rank, size, bucket_bytes, stage, leaf_elements):
        self.parameters = parameters
        self.numel = sum(parameter.numel() for parameter in parameters)
        dtype = parameters[0].dtype
        self.dtype = dtype
        itemsize = parameters[0].element_size()
        # buckets of whole parameters, at most bucket_bytes each (a larger one alone), by the
        # engine's fusion rule
        runs = [[parameters[index] for index in run]
                for run in assign([engine_meta(parameter) for parameter in parameters],
                                  bucket_bytes)]
        counts = [sum(parameter.numel() for parameter in run) for run in runs]
        cuts = np.cumsum(counts)[:-1].tolist()
        self.buckets_layout = Buckets(self.numel, itemsize, rank, size, cuts)
        # The parameters move into one flat vector (each parameter's data a view into it):
        # the wrapped optimizer steps leaf tensors over this rank's chunks of that vector, so
        # the step updates the model in place, and the allgathers fill the rest in place.
        self.values = zeros(self.numel, dtype)
        with torch.no_grad():
            offset = 0
            for parameter in parameters:
                count = parameter.numel()
                data = self.values[offset:offset + count].view_as(parameter)
                data.copy_(parameter.detach())
                parameter.data = data
                offset += count
        # this rank's reduced gradient, its chunk of every bucket: in the buckets' own vectors
        # (stage 1), or back to back in a vector of its own (stage 2, whose buckets let theirs go)
        owned = self.buckets_layout.owned
        self.reduced = None if stage == 1 else \
            zeros(sum(stop - start for start, stop in owned), dtype)
        largest = max(high - low for low, high in self.buckets_layout.ranges)
        self.pool = Pool(None if stage == 1 else largest)
        self.buckets, self.bucket_of, position = [], {}, 0
        for index, (run, (low, high), layout) in enumerate(zip(
                runs, self.buckets_layout.ranges, self.buckets_layout.layouts)):
            bucket = Bucket(index, run, low, high, layout, position)
            position += layout.stop - layout.start
            self.buckets.append(bucket)
            for parameter in run:
                self.bucket_of[parameter] = bucket
            if stage == 1:  # held for good: each step's gradients land in the same memory
                bucket.hold(high - low, dtype, self.pool)
                bucket.reduced = bucket.gradients[layout.start:layout.stop]
            else:
                bucket.reduced = self.reduced[bucket.offset:position]
        # this rank's chunks as leaves of at most ``leaf_elements`` elements each, for the
        # optimizer: torch's CPU optimizers step tensor by tensor with temporaries of the
        # tensor's size, so one leaf over a whole chunk would raise the step's peak memory
        self.leaf_bounds, self.leaf_grads = [], []
        for bucket, (start, stop) in zip(self.buckets, owned):
            for low in range(start, stop, leaf_elements):
                high = min(low + leaf_elements, stop)
                self.leaf_bounds.append((low, high))
                self.leaf_grads.append(bucket.reduced[low - start:high - start])
        if not self.leaf_bounds:  # a rank that owns nothing steps one empty leaf
            self.leaf_bounds.append((owned[0][0], owned[0][0]))
            self.leaf_grads.append(self.buckets[0].reduced[:0])
        self.leaves = [torch.nn.Parameter(self.values[low:high])
                       for low, high in self.leaf_bounds]

    def into_view(self, parameter):
        """Point ``parameter.grad`` at its view in its bucket, copying a gradient autograd
        made anew (after ``zero_grad(set_to_none=True)``) into it; later passes accumulate
        there. Returns the parameter's bucket."""
        bucket = self.bucket_of[parameter]
        bucket.hold(bucket.high - bucket.low, self.dtype, self.pool)
        grad, view = parameter.grad, bucket.views[parameter]
        if grad is not None and grad.layout == torch.strided and \
                grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            parameter.grad = view
        return bucket

    def fill(self, bucket):
        """The bucket's gradient vector with every parameter's gradient (zeros where there is
        none: every rank must contribute, as DistributedOptimizer does for an unused
        parameter)."""
        bucket.hold(bucket.high - bucket.low, self.dtype, self.pool)
        for parameter, view in bucket.views.items():
            grad = parameter.grad
            if grad is None:
                view.zero_()
            elif grad.is_sparse:
                raise ValueError("a sharded optimizer takes dense gradients; this parameter's "
                                 "is sparse (use DistributedOptimizer without sharded=True)")
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
        return bucket.gradients

    def split(self, flat):
        """``flat`` (this group's full vector) as one tensor per parameter, shaped like it."""
        offset, tensors = 0, []
        for parameter in self.parameters:
            count = parameter.numel()
            tensors.append(flat[offset:offset + count].view_as(parameter).clone())
            offset += count
        return tensors

    def in_vector_order(self, gathered, size):
        """Every rank's chunks, gathered rank after rank (each rank's in bucket order), put
        back in the order of the flat vector."""
        full = torch.empty(self.numel, dtype=gathered.dtype)
        position = 0
        for rank in range(size):
            for (low, _), layout in zip(self.buckets_layout.ranges, self.buckets_layout.layouts):
                start, stop = layout.bounds[rank]
                full[low + start:low + stop] = gathered[position:position + stop - start]
                position += stop - start
        return full
