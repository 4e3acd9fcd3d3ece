"""hororun's elastic mode against real faults, recovered by relaunching the job: SIGKILL, a
raising rank, a kill mid-commit, hosts that change. Every job is bounded by a timeout; each
must end with the parameters of an uninterrupted run (bit for bit at the same size, to
rounding after a resize)."""

import io
import json
import os
import pathlib
import pickle
import random
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import JOBS, mpiexec
from hororing.elastic import commits

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
from process_tree import ask_for_stacks, end_job  # noqa: E402

JOB = [sys.executable, str(JOBS / "elastic_train.py")]
TIMEOUT = 180


def hororun(*args):
    # the relaunch path, under every MPI (test_ulfm.py has the survivors going on in process)
    return [sys.executable, "-m", "hororing.launcher", "--mpiexec", mpiexec(), "--fault-recovery",
            "relaunch", *args]


def run_elastic(tmp_path, *flags, job_args=(), timeout=TIMEOUT):
    out = tmp_path / "result.json"
    command = hororun(*flags, "--elastic-dir", str(tmp_path / "commits"), *JOB, "--out",
                      str(out), *job_args)
    finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    result = json.loads(out.read_text()) if out.exists() else None
    return finished, result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Parameters after 30 steps on 2 and on 3 ranks, run without elastic mode."""
    found = {}
    for ranks in (2, 3):
        out = tmp_path_factory.mktemp("reference") / "result.json"
        finished = subprocess.run(hororun("-np", str(ranks), *JOB, "--out", str(out)),
                                  capture_output=True, text=True, timeout=TIMEOUT)
        assert finished.returncode == 0, finished.stderr[-3000:]
        found[ranks] = json.loads(out.read_text())["params"]
        found[ranks, "momentum"] = json.loads(out.read_text())["momentum"]
    return found


def events(finished):
    return [line for line in finished.stderr.splitlines()
            if line.startswith(("hororun[elastic]", "hororing.elastic"))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rank_killed_at_a_random_step_costs_only_the_work_since_the_last_commit(
        tmp_path, reference, seed):
    picker = random.Random(seed)
    rank, step = picker.randrange(3), picker.randrange(1, 29)
    finished, result = run_elastic(tmp_path, "-np", "3", "--min-np", "1",
                                   job_args=["--kill", f"0:{rank}:{step}"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = events(finished)
    assert sum("failed with exit status" in line for line in lines) == 1, lines
    resumed = [line for line in lines if "resumed from commit" in line]
    assert len(resumed) == 1, lines
    commit = int(re.search(r"resumed from commit (\d+)", resumed[0]).group(1))
    assert step <= commit <= step + 1  # the last commit before the kill, or the one in flight
    assert result["launch"] == 1 and result["size"] == 3 and result["step"] == 30
    assert result["params"] == reference[3]


def test_a_rank_that_raises_is_relaunched_from_the_last_commit(tmp_path, reference):
    finished, result = run_elastic(tmp_path, "-np", "2", "--min-np", "2",
                                   job_args=["--raise", "0:1:11"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "RuntimeError: injected failure at step 11" in finished.stderr
    # rank 0 may write commit 12 (step 11 done) before it learns that rank 1 is gone
    assert any(re.search(r"resumed from commit 1[12],", line) for line in events(finished)), \
        events(finished)
    assert result["launch"] == 1 and result["params"] == reference[2]


def test_a_kill_in_the_middle_of_writing_a_commit_leaves_the_previous_one(tmp_path, reference):
    finished, result = run_elastic(tmp_path, "-np", "2", "--min-np", "1",
                                   job_args=["--kill-in-write", "0:9"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    dropped = [line for line in events(finished) if "half-written" in line]
    assert len(dropped) == 1 and ".commit-0000000009.pkl." in dropped[0], events(finished)
    assert int(re.search(r"\((\d+) bytes\)", dropped[0]).group(1)) > 0
    assert any("resumed from commit 8" in line for line in events(finished)), events(finished)
    assert result["launch"] == 1 and result["params"] == reference[2]


def wait_for_progress(path, step, process, limit=TIMEOUT, size=None):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and process.poll() is None:
        try:
            launch, now, done = (int(part) for part in path.read_text().split())
            if done >= step and (size is None or now == size):
                return launch, now, done
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"the job did not reach step {step}" +
                         ("" if size is None else f" at {size} ranks"))


def run_with_changing_hosts(tmp_path, first_hosts, later_hosts, flags, job_args=(),
                            grown=None):
    """Run the job, change its hosts at step 8; ``grown``: the size the job grows to, which
    it is held back for (each step 1 s) until it has (the bigger launch starts while the job
    trains, and must not find it finished)."""
    hosts, progress = tmp_path / "hosts", tmp_path / "progress"
    hosts.write_text(first_hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    out = tmp_path / "result.json"
    command = hororun(*flags, "--host-discovery-script", str(script), "--discovery-interval",
                      "0.2", "--elastic-dir", str(tmp_path / "commits"), *JOB, "--out", str(out),
                      "--progress", str(progress), "--step-sleep", "0.05", "--slow-file",
                      str(tmp_path / "slow"), *job_args)
    # its own session: where it is stuck, it ends with every launch it started (end_job)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as process:
        try:
            wait_for_progress(progress, 8, process)
            if grown is not None:
                (tmp_path / "slow").touch()
            hosts.write_text(later_hosts)
            if grown is not None:
                wait_for_progress(progress, 0, process, size=grown)
                (tmp_path / "slow").unlink()
            stdout, stderr = process.communicate(timeout=TIMEOUT)
        except (AssertionError, subprocess.TimeoutExpired) as stuck:
            ask_for_stacks(process, JOB[-1])  # the ranks' threads, where they are stuck
            end_job(process)
            lines = process.communicate()[1].splitlines()
            said = [line for line in lines if line.startswith(("hororun", "hororing"))]
            raise AssertionError(f"{stuck}; the launcher's events:\n" + "\n".join(said[-40:])
                                 + "\nits output's last lines:\n" + "\n".join(lines[-80:])
                                 ) from stuck
        except BaseException:
            end_job(process)
            process.communicate()
            raise
    finished = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    return finished, json.loads(out.read_text()) if out.exists() else None


def test_a_launch_ahead_that_never_gets_ready_is_ended_and_the_job_grows_by_a_relaunch(
        tmp_path, reference):
    # its ranks sleep before hvd.init(): past --handover-timeout the job stops and relaunches
    finished, result = run_with_changing_hosts(
        tmp_path, "localhost:2\n", "localhost:2\n127.0.0.1:4\n",
        ["-np", "2", "--min-np", "2", "--max-np", "3", "--handover-timeout", "5"],
        job_args=["--stall-ahead", "600"], grown=3)
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = events(finished)
    assert any("launch 1, started ahead, was not ready within --handover-timeout 5 s; "
               "ending it" in line for line in lines), lines
    # the launch that never took over leaves its number to the relaunch
    assert any("launch 1: 3 ranks" in line and "started ahead" not in line
               for line in lines), "\n".join(lines)
    assert result["size"] == 3 and result["launch"] == 1 and result["step"] == 30
    np.testing.assert_allclose(np.concatenate(result["params"]),
                               np.concatenate(reference[2]), rtol=1e-5)


def test_a_host_dropped_from_discovery_stops_the_job_at_a_commit_and_it_goes_on_smaller(
        tmp_path, reference):
    finished, result = run_with_changing_hosts(
        tmp_path, "localhost:1\n127.0.0.1:2\n", "127.0.0.1:2\n", ["-np", "3", "--min-np", "1"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = events(finished)
    assert any("localhost has 0 of the 1 slots in use" in line for line in lines), lines
    assert any("stopped at commit" in line for line in lines), "\n".join(lines)
    assert not any("failed" in line for line in lines), lines
    assert result["size"] == 2 and result["launch"] == 1 and result["step"] == 30
    # the same global batch each step: a resize changes the sums' rounding only
    np.testing.assert_allclose(np.concatenate(result["params"]),
                               np.concatenate(reference[3]), rtol=1e-5)


@pytest.mark.parametrize("handover", ["off", "auto"])
def test_more_slots_discovered_grow_the_job_up_to_max_np(tmp_path, reference, handover):
    # auto: the bigger launch starts beside the job and takes over at its next commit
    finished, result = run_with_changing_hosts(
        tmp_path, "localhost:2\n", "localhost:2\n127.0.0.1:4\n",
        ["-np", "2", "--min-np", "2", "--max-np", "3", "--handover", handover], grown=3)
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = events(finished)
    if handover == "off":
        assert any("3 slots usable, the job has 2" in line for line in lines), lines
        assert not any("started ahead" in line for line in lines), lines
    else:
        assert any("launch 1: 3 ranks" in line and "started ahead" in line for line in lines), \
            lines
        assert any("launch 1, started ahead, is ready; asking launch 0 to stop" in line
                   for line in lines), lines
        assert not any("failed" in line or "ending it" in line for line in lines), lines
        # the commit the job stopped at is the one the bigger launch went on from
        stopped = [line.split("stopped at commit ")[1].split()[0] for line in lines
                   if "launch 0 stopped at commit" in line]
        assert stopped and any(f"launch 1 takes over from commit {stopped[0]}" in line
                               for line in lines), lines
    assert result["size"] == 3 and result["launch"] == 1 and result["step"] == 30
    np.testing.assert_allclose(np.concatenate(result["params"]),
                               np.concatenate(reference[2]), rtol=1e-5)


@pytest.mark.parametrize("before,after,flags,ranks", [
    ("localhost:1\n127.0.0.1:2\n", "127.0.0.1:2\n", ["-np", "3", "--min-np", "1"], 2),
    ("localhost:2\n", "localhost:2\n127.0.0.1:4\n", ["-np", "2", "--min-np", "2", "--max-np", "3"],
     3)], ids=["shrink", "grow"])
def test_a_sharded_optimizer_state_is_laid_out_again_when_the_job_changes_size(
        tmp_path, reference, before, after, flags, ranks):
    # each rank holds its slice of the momentum and a commit writes only that (a checkpoint
    # beside the commit file, one file per rank); the launch at the new size reads its own
    # slices of it
    finished, result = run_with_changing_hosts(tmp_path, before, after, flags,
                                               job_args=["--sharded"],
                                               grown=3 if ranks == 3 else None)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert any("stopped at commit" in line for line in events(finished)), events(finished)
    directory = tmp_path / "commits"
    seq = commits.sequences(directory)[0]
    record = lenient_load(commits.path_of(directory, seq).read_bytes()[:-commits._TRAILER.size])
    assert record["state"]["handlers"]["optimizer"] == {
        "checkpoint": str(directory / f"commit-{seq:010d}.optimizer.shards")}
    kept = sorted(entry.name for entry in directory.iterdir() if entry.name.endswith(".shards"))
    assert kept == [f"commit-{number:010d}.optimizer.shards" for number in (seq - 1, seq)]
    written = sorted(entry.name for entry in (directory / kept[-1]).iterdir())
    assert written == [".metadata"] + [f"__{rank}_0.distcp" for rank in range(ranks)]
    assert result["size"] == ranks and result["launch"] == 1 and result["step"] == 30
    started = 5 - ranks  # the size it started at
    np.testing.assert_allclose(np.concatenate(result["params"]),
                               np.concatenate(reference[started]), rtol=1e-5)
    np.testing.assert_allclose(np.concatenate(result["momentum"]),
                               np.concatenate(reference[started, "momentum"]), rtol=1e-4,
                               atol=1e-6)


def lenient_load(payload):
    """A commit's record, read here (the job's own classes, defined in its __main__, read as
    None)."""
    class Lenient(pickle.Unpickler):
        def find_class(self, module, name):
            try:
                return super().find_class(module, name)
            except AttributeError:
                return lambda *args, **kwargs: None
    return Lenient(io.BytesIO(payload)).load()


def test_a_job_that_fails_before_every_commit_is_not_relaunched_forever(tmp_path):
    finished, result = run_elastic(tmp_path, "-np", "2", "--min-np", "1",
                                   job_args=["--raise", "0:0:0", "--raise-every-launch"])
    assert finished.returncode != 0 and result is None
    lines = events(finished)
    assert sum("failed with exit status" in line for line in lines) == 3, lines
    assert "3 launches in a row failed without a new commit; stopping" in lines[-1]


def test_the_reset_limit_ends_the_job(tmp_path):
    finished, result = run_elastic(tmp_path, "-np", "2", "--min-np", "1", "--reset-limit", "0",
                                   job_args=["--kill", "0:1:5"])
    assert finished.returncode != 0 and result is None
    assert "reset limit 0 reached; stopping" in events(finished)[-1]


def test_too_few_slots_end_the_job_after_the_elastic_timeout(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    finished, result = run_elastic(tmp_path, "-np", "2", "--host-discovery-script",
                                   str(script), "--elastic-timeout", "0.5",
                                   "--discovery-interval", "0.1")
    assert finished.returncode == 1 and result is None
    lines = events(finished)
    assert "waiting for 2 slots: 1 slots on 1 hosts" in lines[0], lines
    assert "no 2 slots within --elastic-timeout 0.5 s" in lines[-1], lines


def test_a_bad_discovery_line_is_named(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho 'localhost:two'\n")
    script.chmod(0o755)
    finished, _ = run_elastic(tmp_path, "-np", "1", "--host-discovery-script", str(script),
                              "--elastic-timeout", "0")
    assert finished.returncode == 1
    assert "line 1: expected 'host' or 'host:slots' with slots >= 1, got 'localhost:two'" in \
        finished.stderr


@pytest.mark.parametrize("legacy", ["0", "1"], ids=["keras3", "tf_keras"])
def test_a_keras_fit_killed_mid_epoch_resumes_with_its_optimizer_state(tmp_path, legacy):
    pytest.importorskip("tensorflow")
    if legacy == "1":
        pytest.importorskip("tf_keras")
    job = [sys.executable, str(JOBS / "elastic_keras.py")]
    env = {**os.environ, "TF_USE_LEGACY_KERAS": legacy, "TF_CPP_MIN_LOG_LEVEL": "2"}
    results = []
    for name, kill in (("uninterrupted", []), ("killed", ["--kill", "2:3"])):
        out = tmp_path / f"{name}.json"
        finished = subprocess.run(
            hororun("-np", "2", "--min-np", "2", "--elastic-dir", str(tmp_path / name), *job,
                    "--out", str(out), *kill), capture_output=True, text=True, timeout=TIMEOUT,
            env=env)
        assert finished.returncode == 0, finished.stderr[-3000:]
        results.append((json.loads(out.read_text()), events(finished)))
    (plain, _), (killed, lines) = results
    # the kill comes in epoch 2 (the third); commits come at epoch ends: 2 epochs are kept
    assert any("resumed from commit 2," in line for line in lines), lines
    assert killed["launch"] == 1 and killed["epoch"] == plain["epoch"] == 4
    assert killed["weights"] == plain["weights"]  # Adam's moments and step count came back
