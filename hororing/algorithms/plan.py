"""Schedules as pure functions: which chunk goes to which peer at which step (the ring's,
and recursive halving and doubling's, below).

Nothing here touches MPI, so the structure is tested in one process.

With P ranks, a buffer is cut into P chunks. Rank r sends to ``right = r + 1`` and
receives from ``left = r - 1`` (mod P). Scatter-reduce step s (0 <= s < P-1) sends chunk
``r - s - 1`` and receives chunk ``r - s - 2``, which it reduces with its own copy. Chunk c
starts at rank c+1 and travels the whole ring, so after P-1 steps rank r holds chunk r
reduced over every rank, each element combined once in one order. Allgather step s then
sends chunk ``r - s`` and receives chunk ``r - s - 1``, a copy of the final value.
"""

import math
from typing import NamedTuple, Optional


class RingStep(NamedTuple):
    send_chunk: int
    recv_chunk: int
    reduce: bool  # True in scatter-reduce (combine), False in allgather (copy)


class RingSchedule(NamedTuple):
    left: int
    right: int
    steps: tuple  # scatter-reduce steps, then allgather steps

    @property
    def scatter_reduce(self):
        return tuple(step for step in self.steps if step.reduce)

    @property
    def allgather(self):
        return tuple(step for step in self.steps if not step.reduce)


RING_MIN_PIECES = 4  # pieces a chunk keeps where a ring's pieces may grow


def ring_pieces(chunk_bytes, subchunk_bytes, ceiling=0):
    """How many pieces a ring cuts a chunk of ``chunk_bytes`` into: pieces of
    ``subchunk_bytes``, or, with a ``ceiling`` above it, pieces that grow toward the ceiling
    while the chunk still has ``RING_MIN_PIECES`` of them (fewer, larger messages for large
    buffers; a pipeline still for small ones)."""
    piece = subchunk_bytes
    if ceiling > subchunk_bytes:
        piece = min(ceiling, max(subchunk_bytes, -(-chunk_bytes // RING_MIN_PIECES)))
    return max(1, math.ceil(chunk_bytes / piece))


def chunk_bounds(count, parts):
    """Split ``count`` items into ``parts`` contiguous ranges; the first ``count % parts`` get one more.

    Returns:
        list of (start, stop) pairs, one per part (empty ranges when count < parts).
    """
    if parts <= 0:
        raise ValueError(f"parts must be > 0, got {parts}")
    base, extra = divmod(count, parts)
    bounds = []
    start = 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_schedule(size, rank, allgather=True):
    """Return rank's ring schedule: P-1 scatter-reduce steps, then (optionally) P-1 allgather steps.

    Args:
        size: number of ranks P in the ring.
        rank: this rank, 0 <= rank < size.
        allgather: False gives the scatter-reduce alone (reducescatter).
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    steps = []
    # scatter-reduce: after it, rank owns chunk `rank` fully reduced
    for step in range(size - 1):
        steps.append(RingStep((rank - step - 1) % size, (rank - step - 2) % size, True))
    if allgather:
        # allgather: pass each owned chunk once around the ring
        for step in range(size - 1):
            steps.append(RingStep((rank - step) % size, (rank - step - 1) % size, False))
    return RingSchedule(left=(rank - 1) % size, right=(rank + 1) % size, steps=tuple(steps))


# --- recursive halving and doubling ------------------------------------------------------
#
# Rabenseifner's allreduce and recursive doubling run among ``members`` ranks, a product of
# small factors: for m ranks that are a power of two, m itself with factors (2, 2, ...); any
# other count either runs as the product of its own prime factors or folds its extra ranks
# in first (the standard extra step): with n = m + e ranks (e < m), each of the ranks
# 0, 2, ..., 2e-2 hands its whole buffer to the next rank up, which reduces it and takes
# part for both; at the end it hands the result back.
#
# A rank's place among the members (its virtual rank v) is written in mixed radix, the
# first factor the least significant digit. Reduce-scatter phase i groups the f_i members
# whose virtual ranks differ only in digit i (for f_i = 2, v and v XOR 2^i): they cut the
# range of blocks they hold into f_i parts and pass parts round their small ring for f_i - 1
# steps, so that member d keeps part d, reduced over the group. After every phase a member
# holds one block of the m, reduced over all; the allgather runs the phases backwards,
# copying. Each block is reduced on one rank only, so every rank ends with the same bits.


class Fold(NamedTuple):
    """How a rank of ``size`` takes part in a schedule among ``members`` ranks."""

    virtual: Optional[int]  # its virtual rank; None: it hands its buffer to ``partner``
    partner: Optional[int]  # the rank it folds with (hands to, or takes from); None: none


def fold(size, rank, members):
    """``rank``'s part when ``size`` ranks run a schedule among ``members`` (<= size < 2m)."""
    extra = size - members
    if not 0 <= extra < members:
        raise ValueError(f"{size} ranks cannot fold onto {members} members")
    if rank < 2 * extra:
        if rank % 2 == 0:
            return Fold(None, rank + 1)
        return Fold(rank // 2, rank - 1)
    return Fold(rank - extra, None)


def real_rank(virtual, size, members):
    """The rank of ``size`` that plays virtual rank ``virtual`` among ``members``."""
    extra = size - members
    return 2 * virtual + 1 if virtual < extra else virtual + extra


def prime_factors(count):
    """``count``'s prime factors, smallest first (none for 1)."""
    factors, divisor = [], 2
    while divisor * divisor <= count:
        while count % divisor == 0:
            factors.append(divisor)
            count //= divisor
        divisor += 1
    if count > 1:
        factors.append(count)
    return tuple(factors)


def halving_factors(size):
    """The members and factors Rabenseifner's allreduce runs on for ``size`` ranks.

    A power of two: itself, halved at every phase. Any other count: its own prime factors
    (no fold, every byte moved once: bandwidth-optimal) where their steps, 2·Σ(f-1), are at
    most twice the power-of-two schedule's; else the largest power of two below it, with
    the extra ranks folded in (a few steps, but two whole buffers more on the folded pairs).
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    power = 1 << (size.bit_length() - 1)
    doubling = (2,) * (power.bit_length() - 1)
    if power == size:
        return size, doubling
    own = prime_factors(size)
    if sum(f - 1 for f in own) <= 2 * (len(doubling) + 1):
        return size, own
    return power, doubling


class Exchange(NamedTuple):
    """One step of a halving schedule, in blocks of the buffer (``members`` blocks)."""

    send_to: int     # real ranks
    recv_from: int
    send: tuple      # (first block, end block) sent
    recv: tuple      # (first block, end block) received
    reduce: bool     # combine what is received (reduce-scatter) or copy it (allgather)


def halving_schedule(rank, factors, virtual_to_real):
    """The exchanges of virtual rank ``rank`` among ``prod(factors)`` members: the
    reduce-scatter's, then the allgather's. ``virtual_to_real(v)`` names the ranks.

    Returns (exchanges, owned): ``owned`` is the (first, end) block range this rank holds
    reduced once the reduce-scatter is done (one block)."""
    members = math.prod(factors)
    lo, length, stride = 0, members, 1
    scatter, gather = [], []
    for factor in factors:
        digit = (rank // stride) % factor
        base = rank - digit * stride
        right = virtual_to_real(base + ((digit + 1) % factor) * stride)
        left = virtual_to_real(base + ((digit - 1) % factor) * stride)
        part = length // factor

        def blocks(index, lo=lo, part=part, factor=factor):
            index %= factor
            return (lo + index * part, lo + (index + 1) * part)
        for step in range(factor - 1):
            scatter.append(Exchange(right, left, blocks(digit - step - 1),
                                    blocks(digit - step - 2), True))
        # the allgather of this phase runs after those of the later phases
        gather.insert(0, [Exchange(right, left, blocks(digit - step), blocks(digit - step - 1),
                                   False) for step in range(factor - 1)])
        lo, length, stride = lo + digit * part, part, stride * factor
    return tuple(scatter) + tuple(step for phase in gather for step in phase), (lo, lo + 1)


def doubling_partners(rank, members):
    """Virtual partners of ``rank`` in recursive doubling among ``members`` (a power of two):
    ``rank XOR 1``, ``rank XOR 2``, ..."""
    if members & (members - 1):
        raise ValueError(f"recursive doubling needs a power of two, got {members}")
    return tuple(rank ^ (1 << bit) for bit in range(members.bit_length() - 1))
