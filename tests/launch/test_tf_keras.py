"""tf-keras (TF_USE_LEGACY_KERAS=1): hororing.keras's optimizer and callbacks with the Keras 2 line.

A job of its own: the switch must be set before TensorFlow is imported.
"""

import re

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("tf_keras")


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_tf_keras_fit_equals_large_batch_training(launch, ranks):
    job = launch(ranks, "tf_keras_fit.py", env={"TF_USE_LEGACY_KERAS": "1",
                                                "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=180)
    assert job.returncode == 0, job.stderr[-3000:]
    difference = float(re.search(r"large-batch training ([0-9.e+-]+)", job.stdout).group(1))
    assert difference < 1e-5


@pytest.mark.parametrize("ranks", [1, 3])
def test_tf_keras_gradient_paths_aggregation_and_local_variables(launch, ranks):
    job = launch(ranks, "tf_keras_aggregation.py", env={"TF_USE_LEGACY_KERAS": "1",
                                                        "TF_CPP_MIN_LOG_LEVEL": "2"},
                 timeout=180)
    assert job.returncode == 0, job.stderr[-3000:]
    assert f"agree with the references on {ranks} rank(s)" in job.stdout


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_tf_keras_broadcast_callback_makes_every_rank_train_rank_zeros_model(launch, ranks, mode):
    # models built before fit and on their first batch, each rank seeded differently
    job = launch(ranks, "keras_broadcast.py", mode, env={"TF_USE_LEGACY_KERAS": "1",
                                                         "TF_CPP_MIN_LOG_LEVEL": "2"},
                 timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert f"keras broadcast ({mode}) agrees on {ranks} rank(s)" in job.stdout
