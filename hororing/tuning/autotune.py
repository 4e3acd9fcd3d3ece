"""Online autotuning of the engine's performance settings (HOROVOD_AUTOTUNE=1).

What is tuned (``Settings``): the fusion threshold, the cycle time, the small-message total
(the latency path takes an allreduce below total / ranks bytes), the ring's sub-chunk and,
where the job spans nodes, the hierarchical switch. A setting given explicitly in the
environment is fixed, as in Horovod (HORORING_AUTOTUNE_FROM_SET=1: it is where tuning
starts instead).

How a setting is scored: the engine reports every cycle's responses. A sub-sample ends when
a tensor name has been seen ``steps_per_sample`` more times (a training step reduces each
gradient once); its score is the bytes reduced per microsecond of wall time over it, so in a
training loop the score is proportional to steps per second. A setting's score is the median
of ``SUBSAMPLES`` sub-samples. The boundaries follow from the responses alone, which every
rank executes alike, so every rank reaches each one in the same cycle.

What is tried (decided on rank 0, broadcast at each boundary, applied by every rank before
its next cycle, so every rank runs every cycle with the same values):
1. ``warmup_samples`` settings' worth of samples at the starting values, not scored;
2. the starting values, then a few points spread over the space, then points proposed by
   Bayesian optimisation (``bayes.py``), ``bayes_opt_max_samples`` in all;
3. the ``CONFIRM`` best by the model's posterior mean, and the starting values, each
   measured again: the best mean of its two measurements wins (one lucky sample does not),
   but only if it beats the start's by more than the noise (the mean relative difference
   between the repeats, at least ``MIN_MARGIN``); else the start stays. Where the
   settings matter little, tuning therefore leaves a job as it was;
4. where the hierarchical switch is tunable, the winner and the winner with the switch
   flipped, measured once more each (the flip must win by the same margin);
then the winner is applied for the rest of the job, and tuning stops.

The log (HOROVOD_AUTOTUNE_LOG, rank 0) is Horovod's CSV: one row per scored setting, then the
best, with Horovod's columns (fusion threshold in MiB, score in bytes per microsecond)
followed by hororing's two extra settings.
"""

import dataclasses
import logging
import math
import statistics
import time

import numpy as np

from .. import faults, transport
from .bayes import BayesianOptimizer

log = logging.getLogger("hororing")

SUBSAMPLES = 5  # a setting's score is the median of this many (Horovod's)
CONFIRM = 3
# the least a change must gain over the start to be kept (the measured noise, where larger)
MIN_MARGIN = 0.01
KiB = 1024
MiB = 1024 * KiB
LOG_COLUMNS = ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce",
               "cache_enabled", "cycle_time_ms", "tensor_fusion_threshold", "score",
               "small_allreduce_total_bytes", "ring_subchunk_bytes")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the autotuner sets; the same on every rank at every cycle."""

    fusion_threshold: int
    cycle_time_ms: float
    small_total_bytes: int
    subchunk_bytes: int
    hierarchical: bool

    def encode(self, active):
        return np.array([float(active), self.fusion_threshold, self.cycle_time_ms,
                         self.small_total_bytes, self.subchunk_bytes,
                         float(self.hierarchical)], dtype=np.float64)

    @classmethod
    def decode(cls, words):
        active, fusion, cycle, small, subchunk, hierarchical = words.tolist()
        return bool(active), cls(int(fusion), cycle, int(small), int(subchunk), bool(hierarchical))


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One continuous setting, searched on a log scale between ``low`` and ``high``."""

    field: str
    low: float
    high: float
    integer: bool = True

    def value(self, unit):
        value = self.low * (self.high / self.low) ** float(np.clip(unit, 0.0, 1.0))
        return int(round(value)) if self.integer else round(value, 3)

    def unit(self, value):
        value = min(max(value, self.low), self.high)
        return math.log(value / self.low) / math.log(self.high / self.low)


DIMENSIONS = {
    "fusion_threshold": Dimension("fusion_threshold", 256 * KiB, 128 * MiB),
    "cycle_time_ms": Dimension("cycle_time_ms", 0.1, 25.0, integer=False),
    "small_total_bytes": Dimension("small_total_bytes", 64 * KiB, 8 * MiB),
    "subchunk_bytes": Dimension("subchunk_bytes", 64 * KiB, 8 * MiB),
}
# Spread points tried after the starting values, in the unit cube (one coordinate per
# dimension, in DIMENSIONS' order): the middle, and two opposite corners of the inner half.
SPREAD = ((0.5, 0.5, 0.5, 0.5), (0.75, 0.25, 0.25, 0.75), (0.25, 0.75, 0.75, 0.25))


class Autotuner:
    """Scores settings from the engine's cycles and moves every rank to the next together.

    Args:
        comm: a communicator of the engine's ranks for the tuner's broadcasts (owned: freed
            by ``close``).
        initial: the settings in effect when tuning starts.
        tunable: the names of the ``DIMENSIONS`` to tune (the rest stay as in ``initial``).
        tune_hierarchical: also try the hierarchical switch flipped.
        apply: ``apply(settings)``, called on every rank at the same cycle.
        warmup_samples, steps_per_sample, max_samples, noise: Horovod's settings of those
            names (HOROVOD_AUTOTUNE_*).
        log_path: rank 0 writes the CSV log there ("" for none).
    """

    def __init__(self, comm, initial, tunable, tune_hierarchical, apply, *, warmup_samples=3,
                 steps_per_sample=10, max_samples=20, noise=0.8, log_path="", seed=0):
        if steps_per_sample < 1:
            raise ValueError(f"HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE must be >= 1, got "
                             f"{steps_per_sample}")
        if warmup_samples < 0 or max_samples < 1:
            raise ValueError(f"HOROVOD_AUTOTUNE_WARMUP_SAMPLES must be >= 0 and HOROVOD_"
                             f"AUTOTUNE_BAYES_OPT_MAX_SAMPLES >= 1, got {warmup_samples} and "
                             f"{max_samples}")
        unknown = set(tunable) - set(DIMENSIONS)
        if unknown:
            raise ValueError(f"no tunable setting named {sorted(unknown)} "
                             f"(tunable: {sorted(DIMENSIONS)})")
        self._comm = comm
        self._root = comm.Get_rank() == 0
        self._apply = apply
        self._steps = steps_per_sample
        self.settings = initial
        self.active = True
        self.history = [initial]  # every setting applied, in order (the same on every rank)
        self.best = None          # (settings, score) once tuning has ended
        self._dims = [DIMENSIONS[name] for name in DIMENSIONS if name in tunable]
        self._log = None
        if self._root:
            self._plan = self._search(warmup_samples, max_samples, noise, seed,
                                      tune_hierarchical)
            self._scoring = next(self._plan)  # (settings to measure, whether it is scored)
            if log_path:
                self._log = open(log_path, "w", encoding="utf-8")
                self._log.write(",".join(LOG_COLUMNS) + "\n")
                self._log.flush()
        self._message = np.zeros(6, dtype=np.float64)
        self._restart()

    # ---- called by the engine, in every cycle that ran something ------------------------

    def observe(self, responses, nbytes):
        """Count the cycle's responses (the same on every rank) and its ``nbytes`` (what
        they moved); at the end of a setting's samples, move every rank to the next one.

        The clock starts at the first cycle seen; the cycle that ends a sample (a name come
        back) begins the next, so each sample is ``steps_per_sample`` steps' bytes over those
        steps' time."""
        if not self.active:
            return
        now = time.monotonic()
        if self._started is None:
            self._started = now
        ended = False
        for response in responses:
            count = self._counts.get(response.name, 0)
            self._counts[response.name] = count + 1
            if count >= (len(self._scores) + 1) * self._steps:
                ended = True
        if ended:
            self._scores.append(self._bytes / max((now - self._started) * 1e6, 1e-3))
            self._bytes = 0
            self._started = now
            if len(self._scores) == SUBSAMPLES:
                self._next(statistics.median(self._scores))
                self._restart(responses, time.monotonic())
        self._bytes += nbytes

    def close(self):
        if self._log is not None:
            self._log.close()
            self._log = None
        self._comm.Free()

    # ---- the boundary between two settings ----------------------------------------------

    def _next(self, score):
        if self._root:
            measured, scored = self._scoring
            if scored:
                self._write(measured, score)
            try:
                self._scoring = self._plan.send(score)
                active, settings = True, self._scoring[0]
            except StopIteration as done:
                self.best = done.value
                active, settings = False, done.value[0]
                self._write(*done.value)
            self._message[:] = settings.encode(active)
        transport.wait(self._comm.Ibcast(self._message, root=0))
        self.active, settings = Settings.decode(self._message)
        if settings != self.settings:
            self._apply(settings)
            self.settings = settings
        self.history.append(settings)
        if not self.active and self._root:
            log.info("autotune: done; best %s (%.1f bytes/us)", settings, self.best[1])

    def _restart(self, responses=(), now=None):
        """Begin a setting's samples, with ``responses`` as its first step."""
        self._counts = {response.name: 1 for response in responses}
        self._scores = []
        self._bytes = 0
        self._started = now

    def _write(self, settings, score):
        log.info("autotune: %s scored %.1f bytes/us", settings, score)
        if self._log is None:
            return
        row = (int(settings.hierarchical), 0, 0, 1, settings.cycle_time_ms,
               settings.fusion_threshold / MiB, round(score, 6),
               settings.small_total_bytes, settings.subchunk_bytes)
        self._log.write(",".join(str(value) for value in row) + "\n")
        self._log.flush()

    # ---- rank 0's plan --------------------------------------------------------------------

    def _at(self, point):
        changes = {dim.field: dim.value(unit) for dim, unit in zip(self._dims, point)}
        return dataclasses.replace(self.history[0], **changes)

    def _unit(self, settings):
        return [dim.unit(getattr(settings, dim.field)) for dim in self._dims]

    def _search(self, warmup_samples, max_samples, noise, seed, tune_hierarchical):
        """Yields (settings, scored) to measure next and is sent each one's score; returns
        (best settings, its score)."""
        start = self.history[0]
        for _ in range(warmup_samples):
            yield start, False
        best, best_score, margin = start, None, MIN_MARGIN
        if self._dims:
            optimizer = BayesianOptimizer(len(self._dims), noise, seed)
            tried = []
            order = list(DIMENSIONS)
            firsts = [start] + [self._at([point[order.index(dim.field)] for dim in self._dims])
                                for point in SPREAD]
            for index in range(max_samples):
                settings = firsts[index] if index < len(firsts) else \
                    self._at(optimizer.propose())
                score = yield settings, True
                optimizer.add(self._unit(settings), score)
                tried.append(settings)
            # the best few and the start, each measured again: a change must beat the start
            # by more than the noise those repeats show, or the start stays
            finalists = optimizer.ranked()[:CONFIRM]
            if 0 not in finalists:  # tried[0] is the start
                finalists.append(0)
            means, spreads = [], []
            for index in finalists:
                score = yield tried[index], True
                first = optimizer.scores[index]
                means.append((first + score) / 2.0)
                spreads.append(abs(first - score) / max(means[-1], 1e-12))
            margin = max(MIN_MARGIN, statistics.mean(spreads))
            winner = int(np.argmax(means))
            if means[winner] < means[finalists.index(0)] * (1.0 + margin):
                winner = finalists.index(0)
            best, best_score = tried[finalists[winner]], means[winner]
        if tune_hierarchical:
            kept = yield best, True
            flipped = dataclasses.replace(best, hierarchical=not best.hierarchical)
            other = yield flipped, True
            if other > kept * (1.0 + margin):
                best, best_score = flipped, other
            else:
                best_score = kept
        if best_score is None:  # nothing to tune: the starting values, measured once
            best_score = yield start, True
        return best, best_score


# the Config fields that, given explicitly, fix each tuned setting
_FIXED_BY = {"fusion_threshold": ("fusion_threshold",), "cycle_time_ms": ("cycle_time_ms",),
             "small_total_bytes": ("small_allreduce_bytes", "small_allreduce_total_bytes"),
             "subchunk_bytes": ("ring_subchunk_bytes",)}


def attach(engine, comm, config):
    """Give ``engine`` (the job's global engine) an Autotuner started from the settings in
    effect, tuning those not fixed by ``config`` (see the module's docstring)."""
    pipeline = engine.allreduce
    route = pipeline.route
    initial = Settings(route.fusion_threshold, route.cycle_time_ms,
                       route.small_bytes * comm.Get_size(), route.subchunk_bytes,
                       pipeline.hierarchical_runs())
    fixed = set() if config.autotune_from_set else set(config.explicit)
    tunable = [name for name, fields in _FIXED_BY.items() if not fixed.intersection(fields)]
    tune_hierarchical = pipeline.has("hierarchical") and "hierarchical_allreduce" not in fixed
    engine.tuner = Autotuner(
        faults.track(comm.Dup()), initial, tunable, tune_hierarchical, engine.apply_settings,
        warmup_samples=config.autotune_warmup_samples,
        steps_per_sample=config.autotune_steps_per_sample,
        max_samples=config.autotune_bayes_opt_max_samples,
        noise=config.autotune_gaussian_process_noise, log_path=config.autotune_log)
    return engine.tuner
