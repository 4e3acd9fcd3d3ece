"""Alpha-beta-gamma cost models of allreduce algorithms, and their calibration.

n ranks (workers), S bytes per rank, alpha seconds of latency per message, beta seconds per
byte moved, gamma seconds per byte reduced (see DESIGN.md). The ring's, recursive doubling's
and Rabenseifner's messages, bytes and reductions are their shapes as hororing runs them
(``algorithms/cost.py``, where the engine prices them too: one definition of each), so where
n is a power of two:

- ring:               2(n-1)·alpha + 2(n-1)/n·S·beta + (n-1)/n·S·gamma
- recursive doubling: log2(n)·(alpha + S·beta + S·gamma)
- Rabenseifner:       2·log2(n)·alpha + 2(n-1)/n·S·beta + (n-1)/n·S·gamma
                      (recursive-halving reduce-scatter, recursive-doubling allgather)

and elsewhere the extra ranks are folded in first and out last (two more messages, 2S more
bytes, S more reduced). The parameter server's own:

- PS, k dedicated servers, push then pull:
                      2n·alpha + 2(n/k)·S·beta + ((n-1)/k)·S·gamma
                      (each server receives S/k from each of n workers, reduces, sends n
                      copies back: its link carries 2(n/k)·S)
- PS colocated (every rank holds one of n shards; its own shard does not travel):
                      2(n-1)·alpha + 2(n-1)/n·S·beta + (n-1)/n·S·gamma
- lower bound:        2(n-1)/n · S·beta  (bandwidth bound of any allreduce)

Every model is linear in (alpha, beta, gamma), so ``calibrate`` fits them to measured times by
least squares (non-negative, relative residuals) and reports the fit's residuals.
"""

import dataclasses
import itertools

import numpy as np

from .algorithms import cost

ALGORITHMS = ("ring", "recursive_doubling", "rabenseifner", "ps", "ps_colocated")


@dataclasses.dataclass(frozen=True)
class Machine:
    """Calibrated constants: seconds per message, per byte moved, per byte reduced."""

    alpha: float
    beta: float
    gamma: float


def coefficients(algorithm, ranks, nbytes, servers=1):
    """Return (a, b, c) with predicted time = a·alpha + b·beta + c·gamma."""
    n, size = ranks, float(nbytes)
    if n <= 1:
        return 0.0, 0.0, 0.0
    if algorithm in ("ring", "recursive_doubling", "rabenseifner", "ps_colocated"):
        # colocated shards move what the ring moves: each rank's own shard stays put
        work = cost.shape("ring" if algorithm == "ps_colocated" else algorithm, n, size)
        return (float(work.steps + work.mpi_steps), work.near_bytes + work.far_bytes,
                work.reduced)
    if algorithm == "ps":
        if servers < 1:
            raise ValueError(f"PS with dedicated servers needs servers >= 1, got {servers}")
        return 2.0 * n, 2.0 * n / servers * size, (n - 1) / servers * size
    raise ValueError(f"unknown algorithm {algorithm!r}; one of {ALGORITHMS}")


def predict(machine, algorithm, ranks, nbytes, servers=1):
    """Predicted seconds of ``algorithm`` for ``nbytes`` per rank over ``ranks`` ranks."""
    a, b, c = coefficients(algorithm, ranks, nbytes, servers)
    return a * machine.alpha + b * machine.beta + c * machine.gamma


def ring_time(machine, ranks, nbytes):
    """Predicted seconds for a ring allreduce of ``nbytes`` per rank over ``ranks`` ranks."""
    return predict(machine, "ring", ranks, nbytes)


def recursive_doubling_time(machine, ranks, nbytes):
    """Predicted seconds for recursive doubling (log2(n) rounds of whole-buffer exchanges)."""
    return predict(machine, "recursive_doubling", ranks, nbytes)


def rabenseifner_time(machine, ranks, nbytes):
    """Predicted seconds for Rabenseifner's reduce-scatter + allgather."""
    return predict(machine, "rabenseifner", ranks, nbytes)


def ps_time(machine, workers, nbytes, servers):
    """Predicted seconds for a PS push-pull; ``servers=0`` means colocated shards."""
    if servers == 0:
        return predict(machine, "ps_colocated", workers, nbytes)
    return predict(machine, "ps", workers, nbytes, servers)


def bandwidth_bound_time(machine, ranks, nbytes):
    """Lower bound on any allreduce's time from bandwidth alone."""
    return 2 * (ranks - 1) / ranks * nbytes * machine.beta if ranks > 1 else 0.0


def bus_bandwidth(ranks, nbytes, seconds):
    """busbw in bytes/s (nccl-tests): algbw · 2(n-1)/n, comparable across algorithms."""
    if seconds <= 0 or ranks <= 1:
        return 0.0
    return nbytes / seconds * 2 * (ranks - 1) / ranks


@dataclasses.dataclass(frozen=True)
class Fit:
    """A calibration: the machine, and measured/predicted for every sample used."""

    machine: Machine
    ratios: tuple  # measured / predicted, per sample

    @property
    def worst(self):
        """The ratio furthest from 1 (as max(r, 1/r))."""
        return max((max(r, 1 / r) for r in self.ratios if r > 0), default=1.0)


def calibrate(samples):
    """Fit alpha, beta, gamma to measurements by non-negative least squares.

    Args:
        samples: ``(algorithm, ranks, nbytes, servers, seconds)`` tuples; at least three with
            different shapes.

    Returns:
        A Fit. Residuals are relative (each row divided by its measured time), so a 10 us and
        a 100 ms measurement weigh alike; negative constants are excluded by solving every
        subset of the three and keeping the best non-negative solution.
    """
    rows = []
    for algorithm, ranks, nbytes, servers, seconds in samples:
        if seconds <= 0:
            raise ValueError(f"measured times must be > 0, got {seconds} for {algorithm}")
        rows.append(np.array(coefficients(algorithm, ranks, nbytes, servers)) / seconds)
    if len(rows) < 3:
        raise ValueError(f"calibration needs at least 3 samples, got {len(rows)}")
    # each row divided by its measured time: the target is 1 everywhere
    matrix, target = np.array(rows), np.ones(len(rows))
    best = None
    for kept in itertools.chain.from_iterable(
            itertools.combinations(range(3), r) for r in (3, 2, 1)):
        solution = np.zeros(3)
        solution[list(kept)] = np.linalg.lstsq(matrix[:, kept], target, rcond=None)[0]
        if (solution < 0).any():
            continue
        error = float(np.sum((matrix @ solution - target) ** 2))
        if best is None or error < best[0]:
            best = (error, solution)
    machine = Machine(*best[1].tolist())
    ratios = tuple(seconds / predict(machine, algorithm, ranks, nbytes, servers)
                   for algorithm, ranks, nbytes, servers, seconds in samples)
    return Fit(machine, ratios)


def crossover_bytes(machine, first, second, ranks, servers=1, low=1, high=1 << 34):
    """Smallest size (bytes, by bisection) from which ``first`` is faster than ``second``.

    Returns None when the order does not change between ``low`` and ``high``.
    """
    def faster(nbytes):
        return (predict(machine, first, ranks, nbytes, servers)
                < predict(machine, second, ranks, nbytes, servers))

    if faster(low) or not faster(high):
        return None
    while high - low > 1:
        middle = (low + high) // 2
        if faster(middle):
            high = middle
        else:
            low = middle
    return high
