"""transport.wait_until polls in three phases set by Config: spin, yield, then sleep."""

import pytest

from hororing import transport


@pytest.fixture
def phases(monkeypatch):
    """Count the yields and record the sleeps of one wait; restore the back-off after."""
    seen = {"yields": 0, "sleeps": []}
    def count_yield():
        seen["yields"] += 1
    monkeypatch.setattr(transport.os, "sched_yield", count_yield)
    monkeypatch.setattr(transport.time, "sleep", seen["sleeps"].append)
    saved = transport.backoff()
    yield seen
    transport.set_backoff(*saved)


def done_after(failures):
    calls = {"n": 0}

    def done():
        calls["n"] += 1
        return calls["n"] > failures
    return done


@pytest.mark.parametrize("spin,yields,failures", [(3, 8, 20), (0, 0, 5), (50, 2000, 30), (4, 4, 9)])
def test_each_failed_test_spins_yields_or_sleeps_by_its_number(phases, spin, yields, failures):
    transport.set_backoff(spin, yields, 0.004)
    woken = []
    assert transport.wait_until(done_after(failures), unless_soon=lambda: woken.append(1))
    # the k-th failed test (k = 1..failures) spins while k < spin, yields while k < yields,
    # then sleeps
    expected_yields = sum(1 for k in range(1, failures + 1) if spin <= k < yields)
    expected_sleeps = sum(1 for k in range(1, failures + 1) if k >= max(spin, yields))
    assert phases["yields"] == expected_yields
    assert len(phases["sleeps"]) == expected_sleeps
    # unless_soon runs once, when the spin phase ends without success (never if it succeeded)
    assert woken == ([1] if failures >= spin else [])


@pytest.mark.parametrize("spin,yields,failures", [(1, 8, 20), (3, 8, 6), (1, 1, 5), (0, 0, 3)])
def test_a_late_wake_comes_at_the_last_yield_before_the_first_sleep(phases, spin, yields,
                                                                    failures):
    transport.set_backoff(spin, yields, 0.004, wake_late=True)
    assert transport.backoff()[3] is True
    at = []  # the yields made when the peers are woken
    done = done_after(failures)
    assert transport.wait_until(done, unless_soon=lambda: at.append(phases["yields"]))
    # the k-th failed test wakes where k reaches the last yield (yields - 1), or the spin's
    # end where there are no yields; then that test yields (or sleeps)
    wake_test = max(spin, yields - 1)
    expected = [sum(1 for k in range(1, wake_test) if spin <= k < yields)] \
        if failures >= wake_test else []
    assert at == expected
    assert phases["yields"] == sum(1 for k in range(1, failures + 1) if spin <= k < yields)


def test_an_asleep_wait_wakes_at_its_first_failed_test_either_way(phases):
    for late in (False, True):
        transport.set_backoff(2, 50, 0.004, wake_late=late)
        woken = []
        transport.wait_until(done_after(1), unless_soon=lambda: woken.append(1), asleep=True)
        assert woken == [1]
        assert phases["yields"] == 0


def test_sleeps_double_up_to_the_ceiling(phases):
    transport.set_backoff(0, 0, 0.0001)
    transport.wait_until(done_after(6))
    assert phases["sleeps"] == pytest.approx([1e-5, 2e-5, 4e-5, 8e-5, 1e-4, 1e-4])


def test_a_deadline_ends_the_wait(phases):
    transport.set_backoff(0, 0, 0.0)
    assert transport.wait_until(lambda: False, deadline=0.0) is False
