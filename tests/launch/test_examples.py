"""The README's main job: the digits training example under mpiexec."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import mpiexec, reported_accuracy, run_example

pytest.importorskip("torch")
pytest.importorskip("sklearn")
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train.py"


def run(ranks, *args, timeout=300, env=None):
    return subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(EXAMPLE), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


@pytest.mark.parametrize("ranks", [1, 3])
def test_training_reaches_95_percent(ranks, tmp_path):
    job = run(ranks, "--checkpoint", str(tmp_path / "checkpoint.pt"))
    assert job.returncode == 0, job.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1))
    assert accuracy >= 0.95


def test_training_across_two_simulated_nodes_finishes_without_transport_warnings():
    # MPICH splits the 4 ranks into two shared-memory groups that talk through its network
    # module, as between hosts (other MPIs ignore the variable)
    job = run(4, env={"MPIR_CVAR_NUM_CLIQUES": "2"})
    assert job.returncode == 0, job.stderr[-3000:]
    assert float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1)) >= 0.95
    assert "UCX WARN" not in job.stderr + job.stdout


def test_resume_continues_from_the_checkpoint(tmp_path):
    checkpoint = str(tmp_path / "checkpoint.pt")
    assert run(2, "--checkpoint", checkpoint, "--epochs", "2").returncode == 0
    job = run(2, "--checkpoint", checkpoint, "--epochs", "4", "--resume")
    assert job.returncode == 0, job.stderr[-3000:]
    # stdout is a pipe: one line an epoch, no progress bar
    epochs = [int(epoch) for epoch in re.findall(r"^epoch\s+(\d+) \d+ steps, last loss [0-9.]+"
                                                 r"  train", job.stdout, re.M)]
    assert epochs == [2, 3] and "\r" not in job.stdout


def test_numpy_example_trains_without_torch(tmp_path):
    example = EXAMPLE.parent / "train_numpy.py"
    # torch made unimportable, as on a machine without it
    code = ("import sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "import runpy\n"
            f"runpy.run_path({str(example)!r}, run_name='__main__')\n")
    job = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1))
    assert accuracy >= 0.95


SHARDED = EXAMPLE.parent / "sharded_files.py"


def test_sharded_files_example_trains_through_per_rank_channels():
    job = subprocess.run([mpiexec(), "-n", "4", sys.executable, str(SHARDED)], capture_output=True,
                         text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "every one of the 16 files was read by exactly one rank" in job.stdout
    assert len(re.findall(r"rank +\d reads digits-\d\d\.rec, ", job.stdout)) == 4
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1))
    assert accuracy >= 0.95


def test_sharded_files_example_runs_one_file_per_rank_at_16_ranks():
    job = subprocess.run([mpiexec(), "-n", "16", sys.executable, str(SHARDED), "--epochs", "1"],
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "every one of the 16 files was read by exactly one rank" in job.stdout
    assert len(re.findall(r"rank +\d+ reads digits-\d\d\.rec \(", job.stdout)) == 16


def test_ps_mode_trains_to_the_same_parameters_as_the_ring(tmp_path):
    import numpy as np
    ring = run(3, "--checkpoint", str(tmp_path / "ring.pt"), "--save-params",
               str(tmp_path / "ring.npz"))
    ps = run(4, "--mode", "ps", "--ps-servers", "1", "--checkpoint", str(tmp_path / "ps.pt"),
             "--save-params", str(tmp_path / "ps.npz"))
    assert ring.returncode == 0 and ps.returncode == 0, (ring.stderr + ps.stderr)[-3000:]
    assert "3 ranks, PS, 1 server(s)" in ps.stdout  # 3 workers; rank 3 served and exited
    accuracies = [float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1))
                  for job in (ring, ps)]
    assert accuracies[0] >= 0.95 and abs(accuracies[0] - accuracies[1]) <= 0.01
    ring_params, ps_params = np.load(tmp_path / "ring.npz"), np.load(tmp_path / "ps.npz")
    for name in ring_params:
        np.testing.assert_allclose(ps_params[name], ring_params[name], atol=1e-4)


def assert_same_parameters(path, reference):
    import numpy as np
    wanted = np.load(reference)
    got = np.load(path)
    assert sorted(got) == sorted(wanted)
    for name in wanted:
        np.testing.assert_allclose(got[name], wanted[name], rtol=1e-4, atol=1e-5)


def test_sharded_optimizer_state_trains_to_the_same_parameters(tmp_path):
    """examples/train.py --sharded (ZeRO stage 1): the same training as the unsharded
    optimizer, within float tolerance, and a checkpoint of its full state that resumes."""
    import numpy as np
    import torch
    args = ("--epochs", "2")
    plain = run(3, *args, "--checkpoint", str(tmp_path / "plain.pt"), "--save-params",
                str(tmp_path / "plain.npz"))
    sharded = run(3, *args, "--sharded", "--checkpoint", str(tmp_path / "sharded.pt"),
                  "--save-params", str(tmp_path / "sharded.npz"))
    assert plain.returncode == 0 and sharded.returncode == 0, \
        (plain.stderr + sharded.stderr)[-3000:]
    assert_same_parameters(tmp_path / "sharded.npz", tmp_path / "plain.npz")
    # the checkpoint holds the full momentum, as the unsharded optimizer's does
    saved = [torch.load(tmp_path / f"{kind}.pt")["optimizer"] for kind in ("plain", "sharded")]
    assert sorted(saved[0]["state"]) == sorted(saved[1]["state"])
    for index, state in saved[0]["state"].items():
        np.testing.assert_allclose(saved[1]["state"][index]["momentum_buffer"].numpy(),
                                   state["momentum_buffer"].numpy(), rtol=1e-4, atol=1e-5)
    resumed = run(3, "--epochs", "3", "--sharded", "--resume", "--checkpoint",
                  str(tmp_path / "sharded.pt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "epoch   2" in resumed.stdout and "epoch   1" not in resumed.stdout


def test_sharded_stage_2_example_trains_to_the_same_parameters(tmp_path):
    """examples/train.py --sharded 2 (gradients sharded too): the unsharded training's
    parameters."""
    args = ("--epochs", "2", "--checkpoint", str(tmp_path / "checkpoint.pt"))
    plain = run(3, *args, "--save-params", str(tmp_path / "plain.npz"))
    stage_2 = run(3, *args, "--sharded", "2", "--save-params", str(tmp_path / "stage_2.npz"))
    assert plain.returncode == 0 and stage_2.returncode == 0, \
        (plain.stderr + stage_2.stderr)[-3000:]
    assert_same_parameters(tmp_path / "stage_2.npz", tmp_path / "plain.npz")


def test_asynchronous_ps_training_converges_on_digits(tmp_path):
    job = run(4, "--mode", "ps", "--ps-servers", "1", "--ps-async", "--checkpoint",
              str(tmp_path / "async.pt"))
    assert job.returncode == 0, job.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1))
    assert accuracy >= 0.93
    # three workers pushing in turn: each update saw about two others land first
    means = [float(mean) for mean in re.findall(r"asynchronous updates, staleness mean ([0-9.]+)",
                                                 job.stdout)]
    assert len(means) == 3 and all(0.5 <= mean <= 4 for mean in means)


def test_cuda_without_a_gpu_says_so_on_every_rank(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tests/gpu runs the example on it")
    job = run(2, "--device", "cuda", "--checkpoint", str(tmp_path / "checkpoint.pt"), timeout=120)
    assert job.returncode != 0
    assert job.stderr.count("--device cuda: this torch sees no CUDA device") == 2, job.stderr[-2000:]


def test_the_ddp_example_trains_over_the_hororing_backend_at_three_ranks():
    """examples/train_ddp.py: a DDP script whose only change is the backend's name."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    job = run_example("train_ddp.py", 3)
    assert "3 ranks, DDP over hororing" in job.stdout
    assert reported_accuracy(job) >= 0.95
