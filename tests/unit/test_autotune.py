"""The autotuner's search (Gaussian process, Bayesian optimisation) and its sampling, on one
rank with a clock the test controls (tests/mpi/test_autotune.py runs it in a job)."""

import csv
import dataclasses
import math

import numpy as np
import pytest
from mpi4py import MPI

from hororing.config import Config
from hororing.tuning import autotune
from hororing.tuning.autotune import DIMENSIONS, SUBSAMPLES, Autotuner, Settings
from hororing.tuning.bayes import BayesianOptimizer, GaussianProcess, expected_improvement

MiB = 1024 * 1024


def test_gaussian_process_interpolates_and_is_unsure_away_from_samples():
    x = np.array([[0.1], [0.4], [0.7], [0.9]])
    y = np.sin(3 * x[:, 0])
    process = GaussianProcess(noise=1e-6).fit(x, y)
    mean, deviation = process.predict(x)
    np.testing.assert_allclose(mean, y, atol=1e-3)
    assert deviation.max() < 0.01
    _, far = process.predict(np.array([[0.55], [5.0]]))
    assert far[0] < far[1] and 0.5 < far[1] <= 1.0


def test_expected_improvement_against_a_hand_computed_value():
    # gain 1, deviation 1: 1 * Phi(1) + phi(1)
    phi = math.exp(-0.5) / math.sqrt(2 * math.pi)
    cdf = 0.5 * math.erfc(-1 / math.sqrt(2))
    value = expected_improvement(np.array([1.0]), np.array([1.0]), 0.0, xi=0.0)[0]
    assert value == pytest.approx(cdf + phi)


def test_bayesian_optimizer_finds_the_top_of_a_smooth_hill():
    top = np.array([0.3, 0.8])

    def score(point):
        return 10.0 - 20.0 * ((np.asarray(point) - top) ** 2).sum()

    optimizer = BayesianOptimizer(2, noise=0.01, seed=3)
    for point in ([0.5, 0.5], [0.9, 0.1], [0.1, 0.9]):
        optimizer.add(point, score(point))
    for _ in range(15):
        point = optimizer.propose()
        assert point.shape == (2,) and (0 <= point).all() and (point <= 1).all()
        optimizer.add(point, score(point))
    best = optimizer.points[optimizer.ranked()[0]]
    assert np.linalg.norm(best - top) < 0.08, best  # 18 random points: 0.12-0.18 here


def test_bayesian_optimizer_refuses_a_point_of_the_wrong_dimension():
    with pytest.raises(ValueError, match="3 coordinates"):
        BayesianOptimizer(3).add([0.5, 0.5], 1.0)


def test_dimensions_map_the_unit_interval_onto_a_log_scale():
    fusion = DIMENSIONS["fusion_threshold"]
    assert fusion.value(0.0) == fusion.low and fusion.value(1.0) == fusion.high
    assert fusion.value(0.5) == round(math.sqrt(fusion.low * fusion.high))
    for value in (fusion.low, 4 * MiB, fusion.high):
        assert fusion.value(fusion.unit(value)) == pytest.approx(value, rel=1e-6)
    assert fusion.unit(1) == 0.0 and fusion.unit(10 ** 12) == 1.0  # clipped


class FakeClock:
    """time.monotonic for the tuner: each training step costs what ``step_us`` says of the
    settings in effect."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@dataclasses.dataclass
class Response:
    name: str


def step_us(settings):
    """A made-up job: fastest at 8 MiB fusion and a 2 ms cycle, ranks of the other two
    settings do not matter."""
    fusion = math.log2(settings.fusion_threshold / (8 * MiB))
    cycle = math.log2(settings.cycle_time_ms / 2.0)
    return 1000.0 * (1.0 + 0.05 * fusion * fusion + 0.05 * cycle * cycle)


def run_job(monkeypatch, tmp_path, tunable, steps_per_sample=2, warmups=1, max_samples=12,
            hierarchical=False, cost=step_us):
    clock = FakeClock()
    monkeypatch.setattr(autotune.time, "monotonic", clock)
    start = Settings(MiB, 5.0, MiB, MiB, False)
    applied = []
    log_path = tmp_path / "autotune.csv"
    tuner = Autotuner(MPI.COMM_SELF.Dup(), start, tunable, hierarchical, applied.append,
                      warmup_samples=warmups, steps_per_sample=steps_per_sample,
                      max_samples=max_samples, noise=0.1, log_path=str(log_path))
    responses = [Response("grad.a"), Response("grad.b")]
    steps = 0
    while tuner.active:
        clock.now += cost(tuner.settings) / 1e6
        if hierarchical and tuner.settings.hierarchical:
            clock.now -= 100e-6  # the hierarchical switch saves a tenth
        tuner.observe(responses, 4096)
        steps += 1
        assert steps < 10000, "tuning never ended"
    tuner.close()
    with open(log_path) as handle:
        rows = list(csv.DictReader(handle))
    return tuner, applied, rows, steps


def test_the_tuner_moves_to_the_best_settings_and_logs_each_one(monkeypatch, tmp_path):
    tuner, applied, rows, steps = run_job(monkeypatch, tmp_path, list(DIMENSIONS))
    # warm-up (not logged), max_samples settings, the 3 finalists and the (poor) start
    # again, then the best
    assert len(rows) == 12 + 4 + 1
    assert steps == (1 + 12 + 4) * SUBSAMPLES * 2 + 1
    assert list(rows[0]) == list(autotune.LOG_COLUMNS)
    first = rows[0]  # the starting settings, in Horovod's units
    assert float(first["tensor_fusion_threshold"]) == 1.0 and float(first["cycle_time_ms"]) == 5
    # score: bytes per microsecond; each step moves 4096 bytes
    assert float(first["score"]) == pytest.approx(4096 / step_us(tuner.history[0]), rel=1e-5)
    best = tuner.settings
    assert tuner.best[0] == best and applied[-1] == best
    assert step_us(best) < 1.05 * step_us(Settings(8 * MiB, 2.0, MiB, MiB, False))
    assert step_us(best) < 0.95 * step_us(tuner.history[0])
    final = rows[-1]
    assert float(final["tensor_fusion_threshold"]) == pytest.approx(best.fusion_threshold / MiB)
    # the tuner ran every setting it applied, in order
    assert tuner.history[-1] == best and len(tuner.history) == 1 + 1 + 12 + 4


def test_fixed_settings_stay_and_the_hierarchical_switch_is_tried_last(monkeypatch, tmp_path):
    tuner, _, rows, _ = run_job(monkeypatch, tmp_path, ["fusion_threshold"], max_samples=5,
                                hierarchical=True)
    for settings in tuner.history:
        assert (settings.cycle_time_ms, settings.small_total_bytes, settings.subchunk_bytes) == \
            (5.0, MiB, MiB)
    # the winner without, then with the switch flipped; it saves time here, so it is kept
    assert [row["hierarchical_allreduce"] for row in rows[-3:]] == ["0", "1", "1"]
    assert tuner.settings.hierarchical


def test_where_no_setting_is_better_the_start_stays(monkeypatch, tmp_path):
    tuner, applied, rows, _ = run_job(monkeypatch, tmp_path, list(DIMENSIONS),
                                      cost=lambda settings: 1000.0)
    assert len({row["tensor_fusion_threshold"] for row in rows}) > 3  # it did look around
    assert tuner.settings == tuner.history[0] and applied[-1] == tuner.history[0]


def test_nothing_to_tune_measures_the_start_once_and_ends(monkeypatch, tmp_path):
    tuner, applied, rows, _ = run_job(monkeypatch, tmp_path, [])
    assert applied == [] and tuner.settings == tuner.history[0]
    assert len(rows) == 2  # the start, then it again as the best


def test_a_sample_ends_when_a_name_comes_back_steps_per_sample_times(monkeypatch, tmp_path):
    clock = FakeClock()
    monkeypatch.setattr(autotune.time, "monotonic", clock)
    tuner = Autotuner(MPI.COMM_SELF.Dup(), Settings(MiB, 1.0, MiB, MiB, False), [], False,
                      lambda settings: None, warmup_samples=1, steps_per_sample=3)
    for step in range(3):  # three steps: the third name's repeat has not come yet
        clock.now += 1.0
        tuner.observe([Response("x")], 10)
    assert tuner._scores == []
    clock.now += 1.0
    tuner.observe([Response("x")], 10)  # the 4th: the first sample was 3 steps, 30 bytes
    assert tuner._scores == [pytest.approx(30 / 3e6)]
    tuner.close()


def test_autotune_settings_come_from_horovods_variables_and_are_checked():
    config = Config.from_environ({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/x.csv",
                                  "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0",
                                  "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
                                  "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "7",
                                  "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.3",
                                  "HOROVOD_FUSION_THRESHOLD": "1048576"})
    assert (config.autotune, config.autotune_log, config.autotune_warmup_samples,
            config.autotune_steps_per_sample, config.autotune_bayes_opt_max_samples,
            config.autotune_gaussian_process_noise) == (True, "/tmp/x.csv", 0, 4, 7, 0.3)
    assert "fusion_threshold" in config.explicit and "cycle_time_ms" not in config.explicit
    with pytest.raises(ValueError, match="STEPS_PER_SAMPLE must be >= 1"):
        Config.from_environ({"HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "0"})
    with pytest.raises(ValueError, match="no tunable setting named"):
        Autotuner(MPI.COMM_SELF, Settings(1, 1.0, 1, 1, False), ["speed"], False, print)
