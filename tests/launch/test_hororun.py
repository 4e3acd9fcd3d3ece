"""hororun, as a horovodrun user runs it: the training example and --check-build."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest
from conftest import mpiexec

from hororing.runner import leftovers

ROOT = pathlib.Path(__file__).resolve().parents[2]


def hororun():
    found = pathlib.Path(sys.executable).parent / "hororun"
    if not found.exists() and shutil.which("hororun") is None:
        pytest.skip("hororun is not installed (pip install -e .)")
    return str(found) if found.exists() else shutil.which("hororun")


def test_check_build():
    job = subprocess.run([hororun(), "--check-build"], capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    assert re.search(r"\[X\] MPI \((MPICH|Open MPI), ", job.stdout)


def test_training_example_under_hororun():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    job = subprocess.run([hororun(), "-np", "2", "--verbose", "--start-timeout", "120",
                          sys.executable, str(ROOT / "examples" / "train.py")],
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.startswith("hororun: ") and " -n 2 " in job.stdout.splitlines()[0]
    assert float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1)) >= 0.95


def test_start_timeout_ends_a_job_whose_rank_never_reaches_init():
    late_rank = ("import time\n"
                 "from mpi4py import MPI\n"
                 "if MPI.COMM_WORLD.rank == 1:\n"
                 "    time.sleep(20)\n"
                 "import hororing as hvd\n"
                 "hvd.init()\n")
    job = subprocess.run([hororun(), "-np", "2", "--start-timeout", "2", sys.executable, "-c",
                          late_rank], capture_output=True, text=True, timeout=120)
    assert job.returncode != 0
    assert "not every rank reached hvd.init() within 2 s" in job.stderr



def test_a_ddp_script_runs_under_hororun_over_the_hororing_backend():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    job = subprocess.run([hororun(), "-np", "2", "--start-timeout", "120", sys.executable,
                          str(ROOT / "examples" / "train_ddp.py"), "--hook", "fp16"],
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "2 ranks, DDP over hororing, hook fp16" in job.stdout
    assert float(re.search(r"test accuracy ([0-9.]+)", job.stdout).group(1)) >= 0.95


KILLED_RANK = """
import os, signal
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
if MPI.COMM_WORLD.rank == 1:
    with open("/proc/self/maps") as maps:
        paths = sorted({line[line.index("/dev/shm/"):].strip() for line in maps
                        if " /dev/shm/" in line and not line.rstrip().endswith("(deleted)")})
    print("segments", *paths, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
MPI.COMM_WORLD.Barrier()
"""


def segments_of(job):
    lines = [line for line in job.stdout.splitlines() if line.startswith("segments")]
    assert lines, job.stdout + job.stderr[-3000:]
    return lines[0].split()[1:]


def test_a_killed_ranks_shared_memory_is_left_by_mpiexec_and_removed_by_hororun():
    began = time.time()
    plain = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", KILLED_RANK],
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode != 0
    left = segments_of(plain)
    if not left:
        pytest.skip("this MPI shares no memory through /dev/shm files")
    assert all(os.path.exists(path) for path in left), left  # what hororun is there for
    leftovers.remove_left_behind(began, settle_s=0)
    job = subprocess.run([hororun(), "-np", "2", sys.executable, "-c", KILLED_RANK],
                         capture_output=True, text=True, timeout=120)
    assert job.returncode != 0
    left = segments_of(job)
    assert not any(os.path.exists(path) for path in left), left
    assert re.search(r"hororun: removed \d+ shared-memory files? \([0-9.]+ MiB\) that ended "
                     r"ranks left in /dev/shm", job.stderr), job.stderr[-3000:]
