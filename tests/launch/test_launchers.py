"""Launchers that do not start one MPI job: every process refuses at init(), naming the
launcher and the command to use, instead of training alone (hororing/world.py)."""

import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import JOBS

INIT_ONLY = str(JOBS / "init_only.py")


def two_processes(environments, timeout=60):
    """Start ``init_only.py`` once per environment, side by side; return the finished ones."""
    processes = [subprocess.Popen([sys.executable, INIT_ONLY], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, **environment})
                 for environment in environments]
    return [(process.wait(timeout=timeout), *process.communicate()) for process in processes]


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def test_torchrun_with_two_processes_is_refused():
    torchrun = pathlib.Path(sys.executable).parent / "torchrun"
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("no torchrun (pip install torch)")
    job = subprocess.run([str(torchrun) if torchrun.exists() else "torchrun", "--standalone",
                          "--nproc_per_node", "2", INIT_ONLY], capture_output=True, text=True,
                         timeout=120)
    assert job.returncode != 0
    assert "size 1" not in job.stdout  # nobody trained alone
    # torchrun ends the other worker once one has failed, so the second refusal may never be
    # printed: at least one is (every process refuses on its own: the test below, without
    # torchrun's ending of workers)
    assert job.stderr.count("torchrun started 2 processes, but MPI made this one a job of "
                            "size 1") in (1, 2), job.stderr[-3000:]
    assert "hororun -np 2 python SCRIPT" in job.stderr


def test_a_torch_distributor_environment_is_refused_on_every_process():
    # what Spark's TorchDistributor, Kubeflow's PyTorchJob and Ray's TorchTrainer set
    port = free_port()
    finished = two_processes([{"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": port} for rank in range(2)])
    for returncode, stdout, stderr in finished:
        assert returncode != 0 and "size 1" not in stdout
        assert "a torch.distributed launcher (RANK, WORLD_SIZE, MASTER_ADDR are set" in stderr
        assert "started 2 processes, but MPI made this one a job of size 1" in stderr, stderr


def test_open_mpis_variables_over_mpichs_mpi4py_are_refused_on_every_process():
    # Open MPI's mpirun starting a script whose mpi4py loads MPICH: each is a singleton
    finished = two_processes([{"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(rank),
                               "OMPI_COMM_WORLD_LOCAL_SIZE": "2"} for rank in range(2)])
    for returncode, stdout, stderr in finished:
        assert returncode != 0 and "size 1" not in stdout
        assert "Open MPI's mpirun (OMPI_COMM_WORLD_SIZE) started 2 processes" in stderr, stderr
        assert "another MPI library than the one mpi4py loaded" in stderr


def test_separate_jobs_when_asked_for():
    finished = two_processes([{"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                               "HORORING_ALLOW_SINGLETONS": "1"} for rank in range(2)])
    assert [stdout for _, stdout, _ in finished] == ["rank 0 size 1\n"] * 2
