"""overlap_report: reading from a timeline how much reduction work backward hid."""
import json

import pytest

from hororing.timeline import Timeline, overlap_report


def trace(tmp_path, spans):
    """Write ``spans`` (tensor, activity, start_s, end_s) with Timeline; return parsed events."""
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    origin = timeline._origin
    for name, activity, start, end in spans:
        timeline.span(name, activity, origin + start, origin + end)
    timeline.close()
    return json.loads(path.read_text())


def step(offset, reduce_b, reduce_a):
    # backward submits b at 0 ms, a at 10 ms (offset by the step's start)
    return [("b", "NEGOTIATE_ALLREDUCE", offset + 0.000, offset + 0.001),
            ("a", "NEGOTIATE_ALLREDUCE", offset + 0.010, offset + 0.011),
            ("b", "ALLREDUCE", offset + reduce_b[0], offset + reduce_b[1]),
            ("a", "ALLREDUCE", offset + reduce_a[0], offset + reduce_a[1])]


def test_fully_exposed_and_half_hidden_steps(tmp_path):
    events = trace(tmp_path, step(0.0, (0.011, 0.012), (0.012, 0.013))
                   + step(1.0, (0.002, 0.006), (0.012, 0.016)))
    report = overlap_report(events)
    assert report["tensors"] == 2
    (hidden0, total0), (hidden1, total1) = report["steps"]
    assert hidden0 == pytest.approx(0.0, abs=1e-3) and total0 == pytest.approx(2000, rel=1e-3)
    assert hidden1 == pytest.approx(4000, rel=1e-3) and total1 == pytest.approx(8000, rel=1e-3)
    assert report["hidden_fraction"] == pytest.approx(4000 / 10000, rel=1e-3)


def test_fused_spans_count_once(tmp_path):
    # one fused ALLREDUCE reported on both tensors must not double the reduction time
    events = trace(tmp_path, [("b", "NEGOTIATE_ALLREDUCE", 0.0, 0.001),
                              ("a", "NEGOTIATE_ALLREDUCE", 0.004, 0.005),
                              ("a", "ALLREDUCE", 0.002, 0.006), ("b", "ALLREDUCE", 0.002, 0.006)])
    hidden, total = overlap_report(events)["steps"][0]
    assert total == pytest.approx(4000, rel=1e-3) and hidden == pytest.approx(2000, rel=1e-3)


def test_no_reductions(tmp_path):
    assert overlap_report(trace(tmp_path, []))["hidden_fraction"] is None
