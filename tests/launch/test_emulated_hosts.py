"""Jobs across emulated hosts (scripts/emulated_hosts.sh: network namespaces with shaped links):
ranks on different hosts, a link cut in the middle of a loop of allreduces, the processes of one
host killed. Each job is bounded by a timeout, and no process is left inside the hosts."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import JOBS, mpiexec

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "emulated_hosts.sh"
TIMEOUT = 90


def hosts_tool(*args, check=True):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, check=check)


@pytest.fixture
def hosts(tmp_path):
    """Two emulated hosts with 2 slots each, at 1 Gbit/s; removed (and every process in them
    ended) afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("emulated hosts need root and iproute2 (ip, tc): network namespaces")
    directory = tmp_path / "hosts"
    made = hosts_tool("up", "2", "--slots", "2", "--dir", str(directory), check=False)
    if made.returncode != 0:
        pytest.skip(f"network namespaces cannot be made here: {made.stderr.strip()}")
    try:
        yield directory
    finally:
        left = hosts_tool("pids", "--dir", str(directory)).stdout.split()
        hosts_tool("down", "--dir", str(directory))
        assert not left, f"processes left inside the hosts: {left}"


def hororun(directory, *args):
    mpi_args = (directory / "mpi-args").read_text().strip()
    return [sys.executable, "-m", "hororing.launcher", "--mpiexec", mpiexec(), "--mpi-args",
            mpi_args, *args]


def test_ranks_on_two_hosts_know_their_hosts_and_reduce_across_them(hosts):
    code = ("import json, socket, numpy as np, hororing as hvd; hvd.init(); "
            "total = hvd.allreduce(np.arange(5.0) + hvd.rank(), op=hvd.Sum); "
            "rows = hvd.allgather_object([hvd.rank(), socket.gethostname(), hvd.local_rank(), "
            "hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), total.tolist()]); "
            "hvd.rank() == 0 and print('ROWS', json.dumps(rows), flush=True)")
    job = subprocess.run(hororun(hosts, "-np", "4", "--hostfile", str(hosts / "hostfile"),
                                 sys.executable, "-c", code),
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert job.returncode == 0, job.stderr[-3000:]
    rows = json.loads(job.stdout.split("ROWS", 1)[1])
    assert rows == [[rank, f"hh{rank // 2 + 1}", rank % 2, 2, rank // 2, 2,
                     [4.0 * i + 6 for i in range(5)]] for rank in range(4)]


def start_allreduce_loop(hosts, env):
    return subprocess.Popen(
        hororun(hosts, "-np", "2", "-H", "hh1:1,hh2:1", sys.executable,
                str(JOBS / "allreduce_loop.py")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **env})


def wait_for_steps(process, steps=5):
    for line in process.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= steps:
            return
    raise AssertionError("the job ended before it made progress")


def finish(process, limit):
    try:
        stdout, stderr = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
        raise AssertionError(f"the job did not end within {limit} s")
    return process.returncode, stderr


def test_a_cut_link_is_named_within_the_stall_time_and_ends_the_job(hosts):
    process = start_allreduce_loop(hosts, {"HOROVOD_STALL_CHECK_TIME_SECONDS": "3",
                                           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "8"})
    wait_for_steps(process)
    hosts_tool("cut", "hh2", "--dir", str(hosts))
    status, stderr = finish(process, TIMEOUT)
    assert status != 0
    warnings = [line for line in stderr.splitlines() if "hororing stall: rank 0 (hh1)" in line]
    assert warnings, stderr[-3000:]
    named = re.search(r"has waited (\d+) s in (negotiation cycle \d+|.*allreduce of 'grad')"
                      r".* for rank\(s\) 1 \(hh2\)", warnings[0])
    assert named, warnings
    assert int(named.group(1)) >= 3, warnings  # not before HOROVOD_STALL_CHECK_TIME_SECONDS
    assert "Ending the job: no progress for longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=8." \
        in stderr
    # the rank cut off on hh2 ends by itself too (its abort cannot reach mpiexec): it gives
    # up 10 s after its own stall shutdown; 60 s is a generous bound for that
    deadline = time.monotonic() + 60
    while hosts_tool("pids", "--dir", str(hosts)).stdout.split() and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    assert not hosts_tool("pids", "--dir", str(hosts)).stdout.split(), \
        "the rank cut off on hh2 is still running"


def test_the_processes_of_one_host_killed_end_the_job_with_a_clear_error(hosts):
    process = start_allreduce_loop(hosts, {"HOROVOD_STALL_CHECK_TIME_SECONDS": "3",
                                           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "8"})
    wait_for_steps(process)
    namespace_pids = subprocess.run(["ip", "netns", "pids", "hororing-hh2"], capture_output=True,
                                    text=True, check=True).stdout.split()
    assert namespace_pids
    for pid in namespace_pids:
        os.kill(int(pid), signal.SIGKILL)
    status, stderr = finish(process, TIMEOUT)
    assert status != 0
    assert "hororun: the job failed (exit status" in stderr, stderr[-3000:]
    assert "the processes of a host died, or its link failed" in stderr or \
        "a rank was killed" in stderr, stderr[-3000:]
