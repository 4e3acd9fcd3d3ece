"""Alpha-beta-gamma cost models of allreduce algorithms, and their calibration.

n ranks, S bytes per rank, alpha seconds of latency per message, beta seconds per byte moved,
gamma seconds per byte reduced (see DESIGN.md):

- ring:               2(n-1)·alpha + 2(n-1)/n·S·beta + (n-1)/n·S·gamma
- recursive doubling: log2(n)·(alpha + S·beta + S·gamma)
- lower bound:        2(n-1)/n · S·beta  (bandwidth bound of any allreduce)
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Machine:
    """Calibrated constants: seconds per message, per byte moved, per byte reduced."""

    alpha: float
    beta: float
    gamma: float


def ring_time(machine, ranks, nbytes):
    """Predicted seconds for a ring allreduce of ``nbytes`` per rank over ``ranks`` ranks."""
    if ranks <= 1:
        return 0.0
    steps = ranks - 1
    return (2 * steps * machine.alpha + 2 * steps / ranks * nbytes * machine.beta
            + steps / ranks * nbytes * machine.gamma)


def recursive_doubling_time(machine, ranks, nbytes):
    """Predicted seconds for recursive doubling (log2(n) rounds of whole-buffer exchanges)."""
    if ranks <= 1:
        return 0.0
    return math.ceil(math.log2(ranks)) * (machine.alpha + nbytes * (machine.beta + machine.gamma))


def bandwidth_bound_time(machine, ranks, nbytes):
    """Lower bound on any allreduce's time from bandwidth alone."""
    return 2 * (ranks - 1) / ranks * nbytes * machine.beta if ranks > 1 else 0.0


def bus_bandwidth(ranks, nbytes, seconds):
    """busbw in bytes/s (nccl-tests): algbw · 2(n-1)/n, comparable across algorithms."""
    if seconds <= 0 or ranks <= 1:
        return 0.0
    return nbytes / seconds * 2 * (ranks - 1) / ranks
