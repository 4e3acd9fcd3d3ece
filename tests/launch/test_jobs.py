"""Whole jobs under mpiexec: failures, stalls, timeline, size 16, subsets of ranks."""

import json
import re
import subprocess
import sys

import pytest
from conftest import JOBS, mpiexec


def test_an_exception_on_one_rank_fails_the_others_with_its_reason(launch):
    job = launch(3, "rank_fails.py", timeout=60)
    assert job.returncode != 0
    assert "KeyError: 'missing batch 17'" in job.stderr
    # the surviving ranks were told why instead of waiting forever (lines may interleave)
    assert job.stdout.count("rank 1 failed: KeyError: 'missing batch 17'") >= 1
    assert "waiting" not in job.stderr


@pytest.mark.parametrize("mode", [[], ["cached"]], ids=["new_name", "cached_name"])
def test_stall_warning_names_the_missing_rank_and_tensor(launch, mode):
    # a cached name is announced by its bit alone: the stall must still name the rank
    job = launch(3, "stall.py", *mode, env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"}, timeout=60)
    assert job.returncode == 0, job.stderr
    assert "tensor 'late.tensor' has been waiting" in job.stderr
    assert "rank(s) [2]" in job.stderr
    assert job.stdout.count("result 3.0") == 3


def test_stall_shutdown_ends_the_job(launch):
    job = launch(2, "stall.py", "never", env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
                                               "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"},
                 timeout=50)
    assert job.returncode != 0
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2" in job.stderr


def test_timeline_is_a_chrome_trace_with_every_phase(launch, tmp_path):
    path = tmp_path / "timeline.json"
    job = launch(2, "timeline.py", env={"HOROVOD_TIMELINE": str(path), "HOROVOD_CYCLE_TIME": "20"})
    assert job.returncode == 0, job.stderr
    events = json.loads(path.read_text())
    rows = {event["pid"]: event["args"]["name"] for event in events
            if event.get("name") == "process_name"}
    # rows as Horovod names them: <kind>.<name>
    assert {"allreduce.layer0.weight", "allreduce.layer7.weight", "allgather.gathered"} <= \
        set(rows.values())
    activities = {event["name"] for event in events if event.get("ph") == "X"}
    assert {"NEGOTIATE_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE",
            "MEMCPY_OUT_FUSION_BUFFER", "NEGOTIATE_ALLGATHER", "ALLGATHER"} <= activities


def test_the_timeline_is_readable_while_the_job_runs(launch, tmp_path):
    path = tmp_path / "timeline.json"
    job = launch(2, "timeline_live.py", env={"HOROVOD_TIMELINE": str(path),
                                            "HOROVOD_TIMELINE_MARK_CYCLES": "1"}, timeout=60)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "live timeline ok rank 0" in job.stdout
    json.loads(path.read_text())  # complete, and closed, at the end


@pytest.mark.parametrize("ranks", [5, 16])
def test_smoke_at_odd_and_oversubscribed_sizes(launch, ranks):
    job = launch(ranks, "smoke.py", timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    # ranks' lines may interleave on the shared stdout: find them, do not split on newlines
    reported = sorted(int(rank) for rank in re.findall(rf"smoke ok rank (\d+) of {ranks}", job.stdout))
    assert reported == list(range(ranks))
    # a few calls of each kind: the compiled steps are never asked for (numba never loads)
    assert job.stdout.count("compiled steps: python (until 1000 calls of a kind)") == ranks, \
        job.stdout
    # nothing before the bfloat16 join imported ml_dtypes (a second of CPU a rank)
    assert job.stdout.count("ml_dtypes before bfloat16: not imported") == ranks, job.stdout


def test_init_with_a_list_of_ranks(launch):
    job = launch(3, "subset.py", timeout=60)
    assert job.returncode == 0, job.stderr
    assert "world 0 rank 0 size 2 sum 2" in job.stdout
    assert "world 2 rank 1 size 2 sum 2" in job.stdout
    assert "world 1 refused: this process (world rank 1) is not in the ranks" in job.stdout


def test_timeline_shows_allreduces_submitted_during_the_backward_pass(launch, tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "timeline.json"
    job = launch(2, "overlap.py", env={"HOROVOD_TIMELINE": str(path)}, timeout=120)
    assert job.returncode == 0, job.stderr[-3000:]
    events = json.loads(path.read_text())
    rows = {event["pid"]: event["args"]["name"] for event in events
            if event.get("name") == "process_name"}
    submitted = {}
    for event in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"]):
        if event["name"] == "NEGOTIATE_ALLREDUCE":  # starts when the gradient was submitted
            submitted.setdefault(rows[event["pid"]], event["ts"])
    # the gradients (six 4 MiB layers) travel in buckets of at most 16 MiB, laid out back to
    # front; each is submitted by the hooks once backward has produced its last gradient (one
    # thread, so the order is fixed): the last layers' bucket first, while backward goes on
    # through the first layers, not both at once when step() is called
    order = sorted(submitted, key=submitted.get)
    assert order == ["allreduce.bucket.10.bias..4.bias.7", "allreduce.bucket.4.weight..0.weight.5"]


def test_a_peer_frozen_inside_a_collective_is_named_then_ends_the_job(launch):
    # no rank is missing from the negotiation: the wait is inside the ring, or in a cycle's
    # vote; the stall watchdog warns (at 2 s, again at 4 s), naming it and the ranks and hosts
    # waited on, then ends the job (at 6 s), the frozen rank included
    job = launch(3, "frozen_peer.py", env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "2",
                                           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "6"},
                 timeout=60)
    assert job.returncode != 0
    assert "Ending the job: no progress for longer than " \
           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=6." in job.stderr, job.stderr[-3000:]
    warnings = [line for line in job.stderr.splitlines()
                if "hororing stall: rank" in line and "Ending the job" not in line]
    assert warnings, job.stderr[-3000:]
    assert any(re.search(r"rank [01] \(\S+\) has waited [0-9]+ s in (negotiation cycle \d+"
                         r"|.*allreduce of 'big.tensor')", line) for line in warnings), warnings
    assert any(re.search(r"rank\(s\) (\d \(\S+\), )?2 \(", line) or
               "every rank of the collective" in line for line in warnings), warnings
    assert all("A link or a host may have failed." in line for line in warnings)


def test_a_rank_whose_process_ended_unseen_by_the_launcher_ends_the_job_named():
    # Hydra told not to clean up a job whose process dies: the ranks waiting on it look
    # (liveness.py) and end it within seconds, each naming rank 1 and its pid
    command = [mpiexec(), "-disable-auto-cleanup", "-n", "3", sys.executable,
               str(JOBS / "dead_peer.py")]
    if "HYDRA" not in subprocess.run([mpiexec(), "--version"], capture_output=True,
                                     text=True).stdout:
        pytest.skip("-disable-auto-cleanup is an option of MPICH's mpiexec (Hydra)")
    job = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert job.returncode != 0
    pid = re.search(r"rank 1 pid (\d+) summed", job.stdout).group(1)
    assert "went on without rank 1" not in job.stdout
    ends = [line for line in job.stderr.splitlines() if "whose process on this host has ended"
            in line]
    assert ends, job.stderr[-3000:]
    for line in ends:
        assert re.search(rf"rank [02] \(\S+\) has waited \d+ s in negotiation cycle \d+ on "
                         rf"rank 1 \(pid {pid}\), whose process on this host has ended without "
                         rf"the launcher ending the job", line), line
