"""hvd.checkpoint across job sizes: saved by 4 ranks, resumed by 5 and 3 (sizes the state
does not divide evenly), and a save torn by a rank that died (jobs/checkpoint_sizes.py)."""

import os

import pytest

pytest.importorskip("torch")


def resumed(job, size, step=2):
    assert job.returncode == 0, job.stderr[-3000:]
    for rank in range(size):
        assert f"rank {rank} resumed at {size} ranks from step {step}" in job.stdout, job.stdout


def test_a_checkpoint_of_4_ranks_resumes_at_5_and_3_and_outlives_a_torn_save_over_it(
        launch, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = launch(4, "checkpoint_sizes.py", "save", path, timeout=180)
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert "a plain process reads one Adam's state" in saved.stdout
    resumed(launch(5, "checkpoint_sizes.py", "load", path, timeout=180), 5)
    # a torn save over the complete checkpoint: the complete one stays and loads
    assert launch(4, "checkpoint_sizes.py", "torn", path, timeout=180).returncode != 0
    job = launch(3, "checkpoint_sizes.py", "load", path, timeout=180)
    resumed(job, 3)
    assert "holds a later save that did not finish" in job.stderr


def test_a_save_a_rank_died_in_is_never_loaded(launch, tmp_path):
    path = str(tmp_path / "ckpt")
    # nothing complete at the path: every rank refuses, naming the unfinished save
    torn = launch(4, "checkpoint_sizes.py", "torn", path, timeout=180)
    assert torn.returncode != 0
    assert not os.path.exists(path) and os.path.isdir(path + ".saving")
    refused = launch(2, "checkpoint_sizes.py", "load", path, timeout=180)
    assert refused.returncode == 0, refused.stderr[-3000:]
    for rank in range(2):
        assert f"rank {rank} refused: cannot load {path}: the save of {path} did not " \
               f"finish" in refused.stdout, refused.stdout


@pytest.mark.parametrize("kind", ["LocalSGD", "DiLoCo"])
def test_a_local_sgd_or_diloco_checkpoint_of_3_ranks_resumes_at_2_and_4(launch, tmp_path, kind):
    # saved between syncs (jobs/periodic_sizes.py): rank r reads saved rank r % 3's inner
    # state, and its parameters (LocalSGD) or the global ones (DiLoCo)
    path = str(tmp_path / "ckpt")
    saved = launch(3, "periodic_sizes.py", "save", kind, path, timeout=180)
    assert saved.returncode == 0, saved.stderr[-3000:]
    for size in (2, 4):
        job = launch(size, "periodic_sizes.py", "load", kind, path, timeout=180)
        assert job.returncode == 0, job.stderr[-3000:]
        for rank in range(size):
            assert f"rank {rank} resumed {kind} at {size} ranks from 3" in job.stdout, job.stdout
