"""examples/train_keras.py under mpiexec: Keras 3 model.fit with hororing, ring and PS."""

import pytest

from conftest import reported_accuracy as accuracy
from conftest import run_example

pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")


def run(ranks, *args):
    return run_example("train_keras.py", ranks, *args)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_keras_training_reaches_95_percent(ranks, tmp_path):
    checkpoint = tmp_path / "best.keras"
    job = run(ranks, "--checkpoint", str(checkpoint))
    assert accuracy(job) >= 0.95
    assert f"({ranks} ranks, ring)" in job.stdout
    assert checkpoint.exists()


def test_keras_ps_mode_gives_the_ring_result():
    # 2 workers and 1 server rank: averaging through the server is the ring's arithmetic
    ps = run(3, "--mode", "ps", "--ps-servers", "1", "--epochs", "3")
    ring = run(2, "--epochs", "3")
    assert "PS, 1 server(s)" in ps.stdout and "[hororing PS server 0]" in ps.stdout
    assert accuracy(ps) == accuracy(ring)
