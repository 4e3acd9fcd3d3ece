"""Helpers to launch a whole job under mpiexec with a hard timeout."""

import os
import pathlib
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
