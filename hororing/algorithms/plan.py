"""The ring's schedule as pure functions: which chunk goes to which peer at which step.

Nothing here touches MPI, so the structure is tested in one process.

With P ranks, a buffer is cut into P chunks. Rank r sends to ``right = r + 1`` and
receives from ``left = r - 1`` (mod P). Scatter-reduce step s (0 <= s < P-1) sends chunk
``r - s - 1`` and receives chunk ``r - s - 2``, which it reduces with its own copy. Chunk c
starts at rank c+1 and travels the whole ring, so after P-1 steps rank r holds chunk r
reduced over every rank, each element combined once in one order. Allgather step s then
sends chunk ``r - s`` and receives chunk ``r - s - 1``, a copy of the final value.
"""

from typing import NamedTuple


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
