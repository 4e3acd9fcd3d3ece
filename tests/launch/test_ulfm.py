"""Survivors of a dead rank go on in process: hororun's elastic mode under an Open MPI with
ULFM (started ``--with-ft ulfm``). Each job is bounded by a timeout and must end with the
parameters of an uninterrupted run (to rounding: the job trains on the same global batch at
any size), having run every step, with no relaunch where the survivors are enough.

Runs where the mpiexec beside this Python is such an Open MPI (tests/run.sh runs this file in
its Open MPI environment); the refusal of ``--fault-recovery in-process`` runs under any other.
"""

import json
import pathlib
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import JOBS, mpiexec
from hororing.runner.mpiexec import OPEN_MPI, mpi_flavor, ulfm_support

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
from process_tree import ask_for_stacks, end_job  # noqa: E402

JOB = [sys.executable, str(JOBS / "elastic_train.py")]
TIMEOUT = 180


def ulfm_mpiexec():
    found = mpiexec()
    if mpi_flavor(found) != OPEN_MPI or not ulfm_support(found):
        pytest.skip("needs Open MPI built with ULFM (tests/run.sh runs this in .venv-openmpi)")
    return found


def hororun(found, *args):
    return [sys.executable, "-m", "hororing.launcher", "--mpiexec", found, *args]


def bounded(command):
    """Run ``command`` in its own session; past TIMEOUT the ranks write their threads' stacks
    to stderr (the job registers faulthandler on SIGUSR2) and every process of it is killed
    (hororun, its mpiexec and the ranks), so that nothing outlives a test."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        ask_for_stacks(process, JOB[-1])
        end_job(process)
        stdout, stderr = process.communicate()
        raise AssertionError(f"no end within {TIMEOUT} s: {stderr[-12000:]}") from None
    except BaseException:
        end_job(process)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run(tmp_path, found, *flags, job_args=()):
    out = tmp_path / "result.json"
    finished = bounded(hororun(found, *flags, "--elastic-dir", str(tmp_path / "commits"), *JOB,
                               "--out", str(out), *job_args))
    return finished, json.loads(out.read_text()) if out.exists() else None


def events(finished):
    return [line for line in finished.stderr.splitlines()
            if line.startswith(("hororun[elastic]", "hororing.elastic"))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Parameters after 30 steps on 2 ranks, no faults."""
    found = ulfm_mpiexec()
    out = tmp_path_factory.mktemp("reference") / "result.json"
    finished = bounded(hororun(found, "-np", "2", *JOB, "--out", str(out)))
    assert finished.returncode == 0, finished.stderr[-3000:]
    return np.concatenate(json.loads(out.read_text())["params"])


def release_once_grown(slow, progress, size):
    """Remove ``slow`` once the job's progress shows a relaunch at ``size`` ranks (or once
    ``slow`` is gone)."""
    while slow.exists():
        try:
            launch, now, _ = (int(part) for part in progress.read_text().split())
        except (OSError, ValueError):
            launch = now = 0
        if launch >= 1 and now == size:
            slow.unlink(missing_ok=True)
            return
        time.sleep(0.05)


def same_training(result, reference):
    np.testing.assert_allclose(np.concatenate(result["params"]), reference, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_survivors_of_a_killed_rank_go_on_in_process(tmp_path, reference, seed):
    found = ulfm_mpiexec()
    picker = random.Random(seed)
    rank, step = picker.randrange(3), picker.randrange(1, 29)
    finished, result = run(tmp_path, found, "-np", "3", "--min-np", "1",
                           job_args=["--kill", f"0:{rank}:{step}"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = events(finished)
    assert any("going on in process with 2 ranks" in line for line in lines), lines
    assert not any("failed with exit status" in line for line in lines), lines
    assert result["launch"] == 0 and result["size"] == 2 and result["step"] == 30
    same_training(result, reference)


def test_two_deaths_at_different_steps_shrink_twice(tmp_path, reference):
    found = ulfm_mpiexec()
    finished, result = run(tmp_path, found, "-np", "4", "--min-np", "1",
                           job_args=["--kill", "0:0:7", "--kill", "0:2:19"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = events(finished)
    assert any("with 3 ranks" in line for line in lines), lines
    assert any("with 2 ranks" in line for line in lines), lines
    assert result["launch"] == 0 and result["size"] == 2 and result["step"] == 30
    same_training(result, reference)


def test_a_job_shrunk_to_one_rank_trains_on_alone(tmp_path, reference):
    found = ulfm_mpiexec()
    finished, result = run(tmp_path, found, "-np", "2", "--min-np", "1",
                           job_args=["--kill", "0:0:5"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert any("going on in process with 1 ranks" in line for line in events(finished))
    assert result["launch"] == 0 and result["size"] == 1 and result["step"] == 30
    same_training(result, reference)


def test_too_few_survivors_for_min_np_relaunch_the_job_from_its_commit(tmp_path, reference):
    found = ulfm_mpiexec()
    finished, result = run(tmp_path, found, "-np", "2", "--min-np", "2",
                           job_args=["--kill", "0:1:9"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "fewer than --min-np 2" in finished.stderr, finished.stderr[-3000:]
    lines = events(finished)
    assert any("launch 0 failed with exit status" in line for line in lines), lines
    assert result["launch"] == 1 and result["size"] == 2 and result["step"] == 30
    same_training(result, reference)


def test_a_dead_ranks_slot_comes_back_after_the_cooldown_and_the_job_grows(tmp_path,
                                                                            reference):
    found = ulfm_mpiexec()
    # the bigger launch starts while the job trains: the job steps slowly (1 s) until it has
    # grown back, so that it cannot finish first however slow the machine
    slow, progress = tmp_path / "slow", tmp_path / "progress"
    slow.touch()
    watcher = threading.Thread(target=release_once_grown, args=(slow, progress, 3),
                               daemon=True)
    watcher.start()
    try:
        finished, result = run(tmp_path, found, "-np", "3", "--min-np", "1",
                               "--blacklist-cooldown-range", "1", "1", "--discovery-interval",
                               "0.5", job_args=["--kill", "0:2:3", "--slow-file", str(slow),
                                                "--progress", str(progress)])
    finally:
        slow.unlink(missing_ok=True)  # the watcher ends with it
        watcher.join(timeout=10)
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = events(finished)
    assert any("going on in process with 2 ranks" in line for line in lines), lines
    # the bigger launch starts beside the job and takes over at its next commit
    assert any("launch 1: 3 ranks" in line and "started ahead" in line for line in lines), lines
    assert any("launch 1 takes over from commit" in line for line in lines), lines
    assert result["launch"] == 1 and result["size"] == 3 and result["step"] == 30
    same_training(result, reference)


def test_a_sharded_optimizer_cannot_go_on_in_process_and_is_relaunched(tmp_path, reference):
    found = ulfm_mpiexec()
    finished, result = run(tmp_path, found, "-np", "3", "--min-np", "1",
                           job_args=["--kill", "0:1:11", "--sharded"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "slices are gone with it" in finished.stderr, finished.stderr[-3000:]
    assert result["launch"] == 1 and result["step"] == 30
    same_training(result, reference)


def test_in_process_recovery_is_refused_where_the_mpi_cannot_do_it(tmp_path):
    found = mpiexec()
    if mpi_flavor(found) == OPEN_MPI and ulfm_support(found):
        pytest.skip("this MPI can recover in process")
    finished = bounded(hororun(found, "-np", "2", "--min-np", "1", "--fault-recovery",
                               "in-process", *JOB, "--out", str(tmp_path / "out.json")))
    assert finished.returncode == 2
    assert "--fault-recovery in-process needs Open MPI built with ULFM" in finished.stderr
    assert "Use --fault-recovery relaunch" in finished.stderr


def test_bench_chaos_in_process_loses_nothing(tmp_path):
    ulfm_mpiexec()
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_chaos.py"
    job = bounded([sys.executable, str(script), "--modes", "in-process", "--ranks", "3",
                   "--steps", "120", "--step-ms", "20", "--commit-every", "5", "--every", "1",
                   "--max-faults", "1", "--timeout", "150"])
    assert job.returncode == 0, job.stdout + job.stderr[-3000:]
    row = [line for line in job.stdout.splitlines() if line.startswith("| in-process |")]
    cells = [cell.strip() for cell in row[0].strip("|").split("|")]
    assert cells[-1] == "all steps, equal parameters, commits intact", row[0]
    assert cells[1] == "1 (1)" and cells[9] == "1" and cells[10] == "2", row[0]
