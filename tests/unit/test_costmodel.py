"""The cost formulas on hand-checked values."""

import pytest

from hororing.costmodel import (Machine, bandwidth_bound_time, bus_bandwidth, calibrate,
                                crossover_bytes, predict, ps_time, rabenseifner_time,
                                recursive_doubling_time, ring_time)

MACHINE = Machine(alpha=1e-6, beta=1e-9, gamma=5e-10)


def test_ring_time_formula():
    # n=4, S=4000: 2*3*1e-6 + 2*3/4*4000*1e-9 + 3/4*4000*5e-10
    assert ring_time(MACHINE, 4, 4000) == pytest.approx(6e-6 + 6e-6 + 1.5e-6)
    assert ring_time(MACHINE, 1, 4000) == 0.0


def test_recursive_doubling_and_bound():
    assert recursive_doubling_time(MACHINE, 4, 1000) == pytest.approx(2 * (1e-6 + 1000 * 1.5e-9))
    # 3 ranks: the third folded into rank 0 first and out last (2 more messages, 2 S more
    # bytes), one round between the two members, and S reduced in each of the fold and round
    assert recursive_doubling_time(MACHINE, 3, 1000) == pytest.approx(
        3 * 1e-6 + 3 * 1000 * 1e-9 + 2 * 1000 * 5e-10)
    assert bandwidth_bound_time(MACHINE, 2, 1000) == pytest.approx(1e-6)


def test_bus_bandwidth_matches_nccl_tests_convention():
    assert bus_bandwidth(2, 1000, 1e-6) == pytest.approx(1e9)
    assert bus_bandwidth(4, 1000, 1e-6) == pytest.approx(1.5e9)
    assert bus_bandwidth(1, 1000, 1e-6) == 0.0


def test_ps_and_rabenseifner_formulas():
    # PS, n=4 workers, k=2 servers, S=4000: 2*4*1e-6 + 2*(4/2)*4000*1e-9 + (3/2)*4000*5e-10
    assert ps_time(MACHINE, 4, 4000, 2) == pytest.approx(8e-6 + 16e-6 + 3e-6)
    # colocated: each rank's own shard stays put, so it is the ring's traffic, worked by
    # hand as in test_ring_time_formula: 2*3*1e-6 + 2*3/4*4000*1e-9 + 3/4*4000*5e-10
    assert ps_time(MACHINE, 4, 4000, 0) == pytest.approx(13.5e-6)
    assert rabenseifner_time(MACHINE, 8, 8000) == pytest.approx(
        6e-6 + 2 * 7 / 8 * 8000 * 1e-9 + 7 / 8 * 8000 * 5e-10)
    with pytest.raises(ValueError, match="needs servers >= 1"):
        predict(MACHINE, "ps", 4, 10, 0)
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        predict(MACHINE, "tree", 4, 10)


def test_calibration_recovers_the_constants_of_exact_data():
    truth = Machine(alpha=3e-6, beta=2e-10, gamma=4e-10)
    shapes = [(algorithm, n, size, servers) for algorithm, servers in (("ring", 1), ("ps", 1),
                                                                        ("ps", 2))
              for n in (2, 3, 4) for size in (1024, 1 << 20, 1 << 24)]
    fit = calibrate([(*shape, predict(truth, *shape[:3], shape[3])) for shape in shapes])
    assert fit.machine.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fit.machine.beta == pytest.approx(truth.beta, rel=1e-6)
    assert fit.machine.gamma == pytest.approx(truth.gamma, rel=1e-6)
    assert fit.worst == pytest.approx(1.0)


def test_calibration_never_returns_negative_constants():
    # times that fall with size would need beta < 0: the fit drops that term instead
    samples = [("ring", 2, size, 1, 1e-3 / (1 + size / 1e6)) for size in (1e3, 1e5, 1e6, 1e7)]
    fit = calibrate(samples)
    assert min(fit.machine.alpha, fit.machine.beta, fit.machine.gamma) >= 0
    assert len(fit.ratios) == 4
    with pytest.raises(ValueError, match="at least 3 samples"):
        calibrate(samples[:2])


def test_crossover_of_ring_and_recursive_doubling():
    crossing = crossover_bytes(MACHINE, "ring", "recursive_doubling", 8)
    assert predict(MACHINE, "ring", 8, crossing) < predict(MACHINE, "recursive_doubling", 8, crossing)
    assert predict(MACHINE, "ring", 8, crossing - 1) >= predict(MACHINE, "recursive_doubling", 8,
                                                               crossing - 1)
    assert crossover_bytes(MACHINE, "ps", "ring", 4) is None  # PS(k=1) never wins here
