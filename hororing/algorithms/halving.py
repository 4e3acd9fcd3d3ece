"""Allreduces whose step count grows as log n: Rabenseifner's and recursive doubling.

``Rabenseifner``: a reduce-scatter by recursive halving, then an allgather by recursive
doubling (``plan.halving_schedule``): 2·log2(n) steps where the ring takes 2(n-1), with the
same bytes on the wire, 2(n-1)/n of the buffer. ``RecursiveDoubling``: log2(n) steps, each
exchanging and combining the whole buffer, for small buffers where the steps are the cost.
Rank counts that are not powers of two fold their extra ranks in first (``plan.fold``);
Rabenseifner's runs on the count's own prime factors instead where they are small
(``plan.halving_factors``).

Both give every rank the same bits: a block is reduced on one rank and copied to the rest
(Rabenseifner), or both partners of a step combine the same two operands in the same order,
the lower virtual rank's first (recursive doubling). Host buffers; the pipeline copies an
out-of-place input into the buffer first.
"""

import functools
import math

import numpy as np

from .. import transport
from ..kernels import reduce_into
from .base import Algorithm, read_at_each_call
from .plan import (chunk_bounds, doubling_partners, fold, halving_factors, halving_schedule,
                   real_rank)
from .ring import copy_flat


class _Recursive(Algorithm):
    """What both share: the fold of extra ranks, scratch memory, send-and-receive."""

    def __init__(self, comm, members, subchunk_bytes=None):
        """``subchunk_bytes``: every message travels in pieces of about this size (a shaped
        link moves pieces faster than one large message, and a reduction combines each piece
        as it arrives): a size, a function that returns the size in effect at each call (the
        engine's route), or None: whole messages."""
        self.chunking = read_at_each_call(subchunk_bytes)
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.members = members
        self.contributors = self.size
        self.fold = fold(self.size, self.rank, members)
        self._scratch = np.empty(0, dtype=np.uint8)
        self.bytes_sent = 0

    def real(self, virtual):
        return real_rank(virtual, self.size, self.members)

    def allreduce(self, buffer, op, finalize=None, segments=None):
        if self.size == 1 or not buffer.size:
            if finalize is not None:
                finalize(buffer)
            return
        piece_bytes = self.chunking()
        with transport.activity(self._describe):
            if self.fold.virtual is None:  # hand the buffer over; take the result back
                partner = self.fold.partner
                self._exchange(piece_bytes, buffer, partner)
                self._exchange(piece_bytes, None, None, buffer, partner)
                return
            if self.fold.partner is not None:
                received = self.scratch(buffer, buffer.size)

                def combine(start, stop):
                    # the partner is the lower rank: its operand first, as recursive
                    # doubling's partners combine
                    reduce_into(received[start:stop], buffer[start:stop], op)
                    copy_flat(buffer[start:stop], received[start:stop])
                self._exchange(piece_bytes, None, None, received, self.fold.partner, combine)
            self._run(buffer, op, finalize, piece_bytes)
            if self.fold.partner is not None:
                self._exchange(piece_bytes, buffer, self.fold.partner)

    def scratch(self, buffer, count):
        needed = count * buffer.itemsize
        if self._scratch.nbytes < needed:
            self._scratch = np.empty(needed, dtype=np.uint8)
        return self._scratch[:needed].view(buffer.dtype)

    def _exchange(self, piece_bytes, send, send_to, recv=None, recv_from=None, combine=None):
        """Send ``send`` to ``send_to`` while receiving ``recv`` from ``recv_from`` (either
        None: that half is skipped), both in pieces; ``combine(start, stop)`` is called for
        each piece of ``recv`` as it arrives. Returns when everything is done."""
        pieces = _pieces(recv, piece_bytes) if recv is not None else []
        receives = [self.comm.Irecv(transport.sendable(recv[start:stop]), recv_from, tag)
                    for tag, (start, stop) in enumerate(pieces)]
        sends = []
        if send is not None:
            self.bytes_sent += send.nbytes
            sends = [self.comm.Isend(transport.sendable(send[start:stop]), send_to, tag)
                     for tag, (start, stop) in enumerate(_pieces(send, piece_bytes))]
        for request, (start, stop) in zip(receives, pieces):
            transport.wait(request)
            if combine is not None:
                combine(start, stop)
        for request in sends:
            transport.wait(request)

    def _describe(self):
        return f"{self.kind} among {self.size} ranks (rank {self.rank})"


class Rabenseifner(_Recursive):
    """Reduce-scatter by recursive halving, allgather by recursive doubling."""

    kind = "Rabenseifner's allreduce"

    def __init__(self, comm, factors=None, subchunk_bytes=None):
        """``factors``: the members' factors (``plan.halving_factors`` by default);
        ``subchunk_bytes``: as ``_Recursive``'s (a reduce-scatter piece is reduced while
        the next ones arrive, as the ring's are)."""
        size = comm.Get_size()
        members, factors = halving_factors(size) if factors is None else (
            math.prod(factors), tuple(factors))
        super().__init__(comm, members, subchunk_bytes)
        self.factors = factors
        self.steps = ()
        if self.fold.virtual is not None:
            self.steps, self.owned = halving_schedule(self.fold.virtual, factors, self.real)

    def _run(self, buffer, op, finalize, piece_bytes):
        bounds = _block_bounds(buffer.size, self.members)

        def elements(blocks):
            return bounds[blocks[0]][0], bounds[blocks[1] - 1][1]
        largest = max((elements(step.recv)[1] - elements(step.recv)[0]
                       for step in self.steps if step.reduce), default=0)
        received = self.scratch(buffer, largest)
        finalized = finalize is None
        for step in self.steps:
            if not step.reduce and not finalized:  # the reduce-scatter is done: own block
                start, stop = elements(self.owned)
                finalize(buffer[start:stop])
                finalized = True
            send_start, send_stop = elements(step.send)
            recv_start, recv_stop = elements(step.recv)
            send = buffer[send_start:send_stop]
            if step.reduce:
                target, scratch = buffer[recv_start:recv_stop], received[:recv_stop - recv_start]

                def combine(start, stop, target=target, scratch=scratch):
                    reduce_into(target[start:stop], scratch[start:stop], op)
                self._exchange(piece_bytes, send, step.send_to, scratch, step.recv_from,
                               combine)
            else:
                self._exchange(piece_bytes, send, step.send_to, buffer[recv_start:recv_stop],
                               step.recv_from)
        if not finalized:  # one member: nothing exchanged
            finalize(buffer)


@functools.lru_cache(maxsize=64)  # a training loop repeats a few buffer lengths
def _block_bounds(count, members):
    return tuple(chunk_bounds(count, members))


def _pieces(array, piece_bytes):
    """The (start, stop) pieces a message of ``array`` travels in: both ends of a message
    work them out from its length alike."""
    parts = 1 if not piece_bytes else max(1, -(-array.nbytes // piece_bytes))
    return chunk_bounds(array.size, parts)


class RecursiveDoubling(_Recursive):
    """log2(n) exchanges of the whole buffer, each partner combining both halves alike."""

    kind = "recursive doubling"

    def __init__(self, comm, subchunk_bytes=None):
        size = comm.Get_size()
        super().__init__(comm, 1 << (size.bit_length() - 1), subchunk_bytes)
        self.partners = () if self.fold.virtual is None else \
            doubling_partners(self.fold.virtual, self.members)

    def _run(self, buffer, op, finalize, piece_bytes):
        received = self.scratch(buffer, buffer.size)
        for partner in self.partners:
            self._exchange(piece_bytes, buffer, self.real(partner), received,
                           self.real(partner))
            if partner > self.fold.virtual:
                reduce_into(buffer, received, op)
            else:  # the partner's operand first, so that both compute the same bits
                reduce_into(received, buffer, op)
                copy_flat(buffer, received)
        if finalize is not None:
            finalize(buffer)

