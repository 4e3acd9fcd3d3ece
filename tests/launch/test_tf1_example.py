"""examples/train_tf1.py under mpiexec: a TF1 graph with MonitoredTrainingSession, ring and PS."""

import re

import pytest

from conftest import reported_accuracy as accuracy
from conftest import run_example

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")


def run(ranks, *args):
    return run_example("train_tf1.py", ranks, *args)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_tf1_graph_training_reaches_95_percent(ranks, tmp_path):
    job = run(ranks, "--checkpoint-dir", str(tmp_path))
    assert accuracy(job) >= 0.95
    assert f"({ranks} ranks, ring)" in job.stdout
    assert list(tmp_path.glob("model.ckpt-*.index"))  # rank 0's session saved a checkpoint


def test_tf1_ps_mode_gives_the_ring_result():
    # 2 workers and 1 server rank: averaging through the server is the ring's arithmetic
    ps = run(3, "--mode", "ps", "--ps-servers", "1", "--epochs", "3")
    ring = run(2, "--epochs", "3")
    assert "(2 ranks, PS, 1 server(s))" in ps.stdout
    assert accuracy(ps) == accuracy(ring)


def test_tf1_ps_mode_aggregates_the_first_replicas():
    # 3 workers, a server averaging the first 2 pushes of each step: one push per step is late
    job = run(4, "--mode", "ps", "--ps-servers", "1", "--replicas-to-aggregate", "2",
              "--epochs", "3")
    assert accuracy(job) > 0.5
    steps, dropped = re.search(r"(\d+) steps from 3 workers.*late pushes dropped: (\d+)",
                               job.stdout + job.stderr).groups()
    assert int(dropped) == int(steps)
