"""Helpers to launch a whole job under mpiexec with a hard timeout."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

JOBS = pathlib.Path(__file__).parent / "jobs"


def mpiexec():
    beside_python = pathlib.Path(sys.executable).parent / "mpiexec"
    found = str(beside_python) if beside_python.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec: pip install 'hororing[mpi]' or install an MPI")
    return found


@pytest.fixture
def launch():
    def run(ranks, job, *args, env=None, timeout=120):
        environment = dict(os.environ)
        environment.update(env or {})
        command = [mpiexec(), "-n", str(ranks), sys.executable, str(JOBS / job), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                               env=environment)
    return run


EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def run_example(script, ranks, *args, timeout=300, env=None):
    """Run ``examples/<script>`` on ``ranks`` ranks under mpiexec; return the finished job."""
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(EXAMPLES / script),
                           *args], capture_output=True, text=True, timeout=timeout,
                          env=environment)


def reported_accuracy(job):
    """The test accuracy an example printed, once it has exited cleanly."""
    assert job.returncode == 0, job.stderr[-3000:]
    return float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1))
