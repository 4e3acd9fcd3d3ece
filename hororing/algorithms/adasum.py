"""Adasum: adaptive summation of gradients (Maleki et al., 2021), over any number of ranks.

Two vectors combine as ``a (1 - a.b / 2|a|^2) + b (1 - a.b / 2|b|^2)``: orthogonal vectors
add, parallel ones average, and everything between is weighed by how much they agree. Ranks
combine pairwise up a binary tree: at level l the partial result of ranks [2k 2^l, (2k+1) 2^l)
(``a``) meets that of [(2k+1) 2^l, (2k+2) 2^l) (``b``).

The tree runs as a recursive vector halving, distance doubling exchange: at each level a rank
and its partner (rank XOR 2^l) each keep one half of the range they hold and swap the other
half, so each holds both sides' values of its half; the three dot products a.b, |a|^2 and
|b|^2 are summed, per tensor, over the ranks that share the level's subtree (a bucket of
several tensors keeps one triple per tensor); each rank then combines its half. After the
last level every rank holds 1/size of the result, and the halving is undone in reverse to
gather it everywhere. Every rank ends with the same bytes.

Any number of ranks: with n = P + m (P the largest power of two <= n), rank P + i first sends
its vector to rank i, which combines them (its own as ``a``) before the tree over the first P
ranks, and gets the result back at the end. The arithmetic runs in float64 (the dot products
of float16 or tiny float32 values would underflow or overflow in their own precision) and is
rounded to the tensor's dtype once, at the end.
"""

import numpy as np

from .. import faults, transport
from .._mpi import MPI
from .base import Algorithm

TAG = 7


class Adasum(Algorithm):
    """Adasum allreduce on one communicator. Collective to construct."""

    contributors = 1  # nothing to divide by: Adasum is its own scaling

    def __init__(self, comm):
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.core = 1 << (self.size.bit_length() - 1)  # the largest power of two <= size
        self.in_core = self.rank < self.core
        core_comm = faults.track(comm.Split(0 if self.in_core else MPI.UNDEFINED, key=self.rank))
        self._levels = []  # per level: (distance, the communicator of the level's subtree)
        if self.in_core:
            distance = 1
            while distance < self.core:
                group = faults.track(core_comm.Split(self.rank // (2 * distance), key=self.rank))
                self._levels.append((distance, group))
                distance *= 2
            core_comm.Free()

    def allreduce(self, buffer, op, finalize=None, segments=None):
        """Adasum-reduce the flat float ``buffer`` in place; ``segments`` (name, start, stop)
        are the bucket's tensors, each combined with its own dot products."""
        bounds = [(start, stop) for _, start, stop in segments] if segments else \
            [(0, buffer.size)]
        work = buffer.astype(np.float64)
        with transport.activity(lambda: f"an Adasum allreduce over {self.size} ranks"):
            extra = self.rank - self.core  # this rank's partner below, if it is an extra
            if extra >= 0:
                self._send(work, extra)
                self._recv(work, extra)
            else:
                if self.rank + self.core < self.size:  # fold in an extra rank's vector
                    theirs = np.empty_like(work)
                    self._recv(theirs, self.rank + self.core)
                    combine(work, work, theirs, bounds)
                self._tree(work, bounds)
                if self.rank + self.core < self.size:
                    self._send(work, self.rank + self.core)
        buffer[...] = work
        if finalize is not None:
            finalize(buffer)

    def _tree(self, work, bounds):
        lo, hi = 0, work.size
        held = []  # (lo, hi) before each level's halving, to undo it
        scratch = np.empty_like(work)
        for distance, group in self._levels:
            partner = self.rank ^ distance
            mid = lo + (hi - lo) // 2
            lower = self.rank < partner
            keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
            received = scratch[keep[0]:keep[1]]
            self._exchange(work[give[0]:give[1]], received, partner)
            mine = work[keep[0]:keep[1]]
            # a is the lower subtree's vector, b the upper one's
            a, b = (mine, received) if lower else (received, mine)
            combine(mine, a, b, bounds, keep, group)
            held.append((lo, hi))
            lo, hi = keep
        for distance, _ in reversed(self._levels):  # undo the halving: gather the result
            partner = self.rank ^ distance
            outer_lo, outer_hi = held.pop()
            theirs = (hi, outer_hi) if self.rank < partner else (outer_lo, lo)
            self._exchange(work[lo:hi], work[theirs[0]:theirs[1]], partner)
            lo, hi = outer_lo, outer_hi

    def _exchange(self, send, receive, partner):
        requests = [self.comm.Irecv(receive, partner, TAG), self.comm.Isend(send, partner, TAG)]
        transport.wait_all(requests)

    def _send(self, array, peer):
        transport.wait(self.comm.Isend(array, peer, TAG))

    def _recv(self, array, peer):
        transport.wait(self.comm.Irecv(array, peer, TAG))

    def free(self, clean=True):
        for _, group in self._levels:
            group.Free()


def combine(target, a, b, bounds, held=None, group=None):
    """Write Adasum(a, b) into ``target``, tensor by tensor.

    ``a``, ``b`` and ``target`` cover the element range ``held`` of the bucket (None: all of
    it); ``bounds`` are the tensors' ranges. The dot products are summed over ``group`` (a
    communicator whose ranks hold the rest of each tensor; None: this rank holds it all).
    """
    offset, end = held if held is not None else (0, target.size)
    pieces = [(max(start, offset), min(stop, end)) for start, stop in bounds]
    dots = np.zeros((len(bounds), 3))
    for index, (start, stop) in enumerate(pieces):
        if stop > start:
            piece_a, piece_b = a[start - offset:stop - offset], b[start - offset:stop - offset]
            # einsum, not BLAS: OpenBLAS threads of ranks sharing cores spin against each
            # other (measured: 17 ms for what takes 30 us here, from 32 K elements)
            dots[index] = (np.einsum("i,i->", piece_a, piece_b),
                           np.einsum("i,i->", piece_a, piece_a),
                           np.einsum("i,i->", piece_b, piece_b))
    if group is not None and group.Get_size() > 1:
        transport.wait(group.Iallreduce(MPI.IN_PLACE, dots, op=MPI.SUM))
    for (start, stop), (ab, aa, bb) in zip(pieces, dots):
        if stop > start:
            coefficient_a = 1.0 - ab / (2.0 * aa) if aa > 0 else 1.0
            coefficient_b = 1.0 - ab / (2.0 * bb) if bb > 0 else 1.0
            piece = slice(start - offset, stop - offset)
            target[piece] = coefficient_a * a[piece] + coefficient_b * b[piece]

