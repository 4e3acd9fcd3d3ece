"""The cost formulas on hand-checked values."""

import pytest

from hororing.costmodel import (Machine, bandwidth_bound_time, bus_bandwidth,
                                recursive_doubling_time, ring_time)

MACHINE = Machine(alpha=1e-6, beta=1e-9, gamma=5e-10)


def test_ring_time_formula():
    # n=4, S=4000: 2*3*1e-6 + 2*3/4*4000*1e-9 + 3/4*4000*5e-10
    assert ring_time(MACHINE, 4, 4000) == pytest.approx(6e-6 + 6e-6 + 1.5e-6)
    assert ring_time(MACHINE, 1, 4000) == 0.0


def test_recursive_doubling_and_bound():
    assert recursive_doubling_time(MACHINE, 4, 1000) == pytest.approx(2 * (1e-6 + 1000 * 1.5e-9))
    assert recursive_doubling_time(MACHINE, 3, 1000) == pytest.approx(2 * (1e-6 + 1000 * 1.5e-9))
    assert bandwidth_bound_time(MACHINE, 2, 1000) == pytest.approx(1e-6)


def test_bus_bandwidth_matches_nccl_tests_convention():
    assert bus_bandwidth(2, 1000, 1e-6) == pytest.approx(1e9)
    assert bus_bandwidth(4, 1000, 1e-6) == pytest.approx(1.5e9)
    assert bus_bandwidth(1, 1000, 1e-6) == 0.0
