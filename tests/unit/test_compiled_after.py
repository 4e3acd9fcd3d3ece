"""In "auto" mode a kind of buffer asks for its compiled steps at its ``after``-th call
(Config.compiled_steps_after), not at its first: the ring's kinds and the fold's counted
apart, the lane asking again until it is due; "wait" loads at the first call whatever
``after`` says."""

import numpy as np
import pytest

from hororing.algorithms import compiled
from hororing.config import Config


@pytest.fixture
def asked(monkeypatch):
    """The keys the loader is asked for, none of them loaded, nothing compiled."""
    keys = []
    monkeypatch.setattr(compiled._Loader, "entries", {})
    monkeypatch.setattr(compiled._Loader, "queued", set())
    monkeypatch.setattr(compiled._Loader, "error", None)
    monkeypatch.setattr(compiled, "_ask", keys.append)
    monkeypatch.setattr(compiled, "_compile", lambda key: keys.append(("compiled", key)))
    mode = compiled._Loader.mode, compiled._Loader.after
    yield keys
    monkeypatch.undo()  # the loader's own entries back, then FOLD_READY made from them again
    compiled.configure(*mode)


def test_each_kind_asks_at_its_after_th_call_and_the_lane_until_it_is_due(asked):
    compiled.configure("auto", after=3)
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    assert compiled.status() == "python (until 3 calls of a kind)"
    for _ in range(2):
        assert compiled.ring_entry(f32) is None
        assert compiled.ring_entry(f32, read_only=True) is None
        assert compiled.fold_entry(f64) is None
    assert asked == [] and f64 not in compiled.FOLD_ASKED  # the lane asks again
    assert compiled.ring_entry(f32) is None
    assert asked == [(f32, False)]
    assert compiled.fold_entry(f64) is None
    assert asked == [(f32, False), ("fold", f64)] and f64 in compiled.FOLD_ASKED
    assert compiled.ring_entry(f32, read_only=True) is None
    assert asked[-1] == (f32, True) and len(asked) == 3
    compiled._Loader.queued.add((f32, False))  # as _ask does
    assert compiled.status() == "loading"


def test_a_dtype_the_steps_do_not_take_is_never_asked_for(asked):
    compiled.configure("auto", after=1)
    assert compiled.fold_entry(np.dtype(np.complex64)) is None
    assert compiled.ring_entry(np.dtype(np.bool_)) is None
    assert asked == [] and np.dtype(np.complex64) in compiled.FOLD_ASKED


def test_setting_the_mode_again_starts_the_counts_again(asked):
    compiled.configure("auto", after=2)
    compiled.ring_entry(np.dtype(np.int32))
    compiled.configure("auto", after=2)
    compiled.ring_entry(np.dtype(np.int32))
    assert asked == []
    compiled.ring_entry(np.dtype(np.int32))
    assert asked == [(np.dtype(np.int32), False)]


def test_wait_loads_at_the_first_call(asked):
    compiled.configure("wait", after=1000)
    compiled.ring_entry(np.dtype(np.int8))
    assert asked == [("compiled", (np.dtype(np.int8), False))]


def test_the_setting_comes_from_the_environment_and_is_checked():
    assert Config.from_environ({}).compiled_steps_after == 1000
    assert Config.from_environ({"HORORING_COMPILED_STEPS_AFTER": "1"}).compiled_steps_after == 1
    with pytest.raises(ValueError, match=r"compiled steps after must be >= 1 call "
                                         r"\(HORORING_COMPILED_STEPS_AFTER\), got 0"):
        Config.from_environ({"HORORING_COMPILED_STEPS_AFTER": "0"})
    with pytest.raises(ValueError, match="HORORING_COMPILED_STEPS_AFTER"):
        compiled.configure("auto", after=0)
