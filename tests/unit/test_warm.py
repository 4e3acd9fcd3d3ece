"""Warm starts (hororing/runner/warm.py): a rank forked from a process that imported its modules
ahead behaves, to mpiexec and to itself, as the command started fresh would: its argv, working
directory, environment, stdio, signals, exit status, traceback; what cannot be started warm is
exec'd as it is."""

import os
import signal
import subprocess
import sys
import time

import pytest

from hororing.runner import warm, warm_shim

PRELOADED = "colorsys"  # imported by the warm process; a fresh interpreter does not import it
JOB = """
import json, os, signal, sys, time
mode = sys.argv[1]
if mode == "wait":  # before the report: a test signals the rank once it has read it
    signal.signal(signal.SIGUSR1, lambda *_: (print("got SIGUSR1", flush=True), sys.exit(7)))
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "file": __file__, "name": __name__,
                  "x": os.environ.get("WARM_X"), "warm": "colorsys" in sys.modules,
                  "usr2_ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN,
                  "pid": os.getpid()}), flush=True)
sys.stderr.write("to stderr\\n")
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise ValueError("raised by the job")
if mode == "wait":
    time.sleep(60)
"""


def wait_for(path, process):
    for _ in range(600):  # a warm process listens once its modules are imported
        if os.path.exists(path) or process.poll() is not None:
            break
        time.sleep(0.05)
    assert os.path.exists(path), f"nothing listens at {path}"


@pytest.fixture
def cold(tmp_path):
    """hororun's warm-start process, with no warm process for any key yet."""
    path = str(tmp_path / "warm.sock")
    process = subprocess.Popen([sys.executable, "-m", "hororing.runner.warm", path, PRELOADED],
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(path, process)
        yield path, process
    finally:
        process.kill()  # its warm processes and their ranks die with it
        process.wait()


@pytest.fixture
def server(cold):
    """... and a warm process for this environment's key."""
    path, process = cold
    warm_shim.prepare(path, warm_shim.key_of(os.environ))
    wait_for(f"{path}.{warm_shim.key_name(warm_shim.key_of(os.environ))}", process)
    return path


@pytest.fixture
def job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return script


def cpu_ticks(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def shim(path, *command, **kwargs):
    return subprocess.Popen(warm.wrap(sys.executable, path, list(command)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)


def report(process):
    import json

    return json.loads(process.stdout.readline())


def test_a_forked_rank_has_its_command_directory_environment_and_exit_status(
        server, job, tmp_path):
    process = shim(server, sys.executable, "job.py", "exit", "3", cwd=tmp_path,
                   env={**os.environ, "WARM_X": "from the shim"})
    seen = report(process)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 3
    assert seen["warm"], "the rank was not forked from the warm process"
    assert seen["argv"] == ["job.py", "exit", "3"]
    assert seen["cwd"] == str(tmp_path) and seen["file"] == str(job)
    assert seen["name"] == "__main__" and seen["x"] == "from the shim"
    assert stderr == "to stderr\n"


def test_a_module_runs_as_main_with_python_dash_m(server, tmp_path):
    (tmp_path / "warm_job_module.py").write_text(JOB)
    process = shim(server, sys.executable, "-m", "warm_job_module", "exit", "0", cwd=tmp_path)
    seen = report(process)
    process.communicate(timeout=60)
    assert process.returncode == 0 and seen["warm"] and seen["name"] == "__main__"
    assert seen["argv"][1:] == ["exit", "0"]


def test_an_exception_is_reported_from_the_script_on_with_status_1(server, job, tmp_path):
    process = shim(server, sys.executable, str(job), "raise", cwd=tmp_path)
    assert report(process)["warm"]
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1
    lines = stderr.splitlines()
    assert lines[1] == "Traceback (most recent call last):", stderr
    assert lines[2].startswith(f'  File "{job}"'), stderr  # no frame of the warm process
    assert lines[-1] == "ValueError: raised by the job"


def test_signals_reach_the_rank_and_its_death_by_a_signal_is_the_shims(server, job):
    process = shim(server, sys.executable, str(job), "wait")
    seen = report(process)
    process.send_signal(signal.SIGUSR1)  # as mpiexec forwards one
    assert process.stdout.readline() == "got SIGUSR1\n"
    process.communicate(timeout=60)
    assert process.returncode == 7

    process = shim(server, sys.executable, str(job), "wait")
    seen = report(process)
    os.kill(seen["pid"], signal.SIGKILL)  # the rank itself, as a fault or the OOM killer
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL


def test_a_rank_whose_shim_is_killed_dies_too(server, job):
    process = shim(server, sys.executable, str(job), "wait")
    seen = report(process)
    process.kill()  # mpiexec ending the job
    process.communicate(timeout=60)
    for _ in range(600):
        if _gone_or_zombie(seen["pid"]):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the rank outlived its shim")


def _gone_or_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped, also while it is read
        return True


def test_a_signal_ignored_at_the_shim_is_ignored_in_the_rank(server, job):
    process = shim(server, sys.executable, str(job), "exit", "0",
                   preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
    seen = report(process)
    process.communicate(timeout=60)
    assert seen["warm"] and seen["usr2_ignored"]


@pytest.mark.parametrize("case", ["other interpreter settings", "not python", "no warm process"])
def test_what_cannot_start_warm_is_run_as_it_is(server, job, tmp_path, case):
    env, path = dict(os.environ), server
    command = [sys.executable, str(job), "exit", "4"]
    if case == "other interpreter settings":
        env["PYTHONHASHSEED"] = "7"  # read at the interpreter's start: a fork cannot have it
    elif case == "not python":
        command = ["sh", "-c", f'exec "{sys.executable}" "$0" exit 4', str(job)]
    else:
        path = str(tmp_path / "nothing-listens-here")
    process = shim(path, *command, env=env)
    seen = report(process)
    process.communicate(timeout=60)
    assert process.returncode == 4 and not seen["warm"]


def test_a_rank_with_no_warm_process_for_its_key_starts_fresh_and_has_one_made(cold, job):
    path, process = cold
    env = {**os.environ, "MPI_LOCALNRANKS": "3"}  # as mpiexec says: 3 ranks on this host
    first = shim(path, sys.executable, str(job), "exit", "0", env=env)
    assert not report(first)["warm"]
    first.communicate(timeout=60)
    wait_for(f"{path}.{warm_shim.key_name({'MPI_LOCALNRANKS': '3'})}", process)
    second = shim(path, sys.executable, str(job), "exit", "0", env=env)
    assert report(second)["warm"]
    second.communicate(timeout=60)
    assert first.returncode == second.returncode == 0


def test_warm_processes_of_two_keys_serve_their_ranks_side_by_side(cold, job):
    path, process = cold
    keys = [{"MPI_LOCALNRANKS": "2"}, {"MPI_LOCALNRANKS": "1"}]  # ranks on two host names
    for key in keys:
        warm_shim.prepare(path, key)
    for key in keys:
        wait_for(f"{path}.{warm_shim.key_name(key)}", process)
    for round in range(3):
        ranks = [shim(path, sys.executable, str(job), "exit", str(round + index),
                      env={**os.environ, **key}) for index, key in enumerate(keys)]
        assert all(report(rank)["warm"] for rank in ranks)
        for index, rank in enumerate(ranks):
            rank.communicate(timeout=60)
            assert rank.returncode == round + index
    # between launches they wait (they once shared one epoll instance through the fork, and
    # each woke for the other's descriptors for ever)
    warm_processes = [int(pid) for pid in
                      open(f"/proc/{process.pid}/task/{process.pid}/children").read().split()]
    assert len(warm_processes) == 2
    before = [cpu_ticks(pid) for pid in warm_processes]
    time.sleep(1.0)
    spent = [cpu_ticks(pid) - ticks for pid, ticks in zip(warm_processes, before)]
    assert max(spent) < 0.2 * os.sysconf("SC_CLK_TCK"), f"idle warm processes spent {spent} ticks"


def test_the_rank_takes_the_shims_cores(server, job):
    process = shim(server, sys.executable, "-c", "pass")  # declined: not a script
    process.communicate(timeout=60)
    script = job.parent / "cores.py"
    script.write_text("import os, sys\nprint(sorted(os.sched_getaffinity(0)), "
                      "'colorsys' in sys.modules)\n")
    process = shim(server, sys.executable, str(script),
                   preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    stdout, _ = process.communicate(timeout=60)
    assert stdout == "[0] True\n"


def test_auto_takes_the_heavy_modules_the_script_imports(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os\nimport torch\nfrom hororing import torch as hvd\n"
                      "def main():\n    import numpy as np\n    from . import local\n")
    assert warm.auto_modules(["python", str(script)])[:3] == ["torch", "hororing", "numpy"]
    assert "torch._dynamo" in warm.auto_modules(["python", str(script)])  # torch.optim's
    assert warm.auto_modules(["python", "-c", "import torch"]) == []
    assert not warm.is_python(["sh", "-c", "python x.py"])
    assert warm.is_python(["python3", "x.py"]) and warm.is_python(["python", "-m", "pkg"])


def test_a_ranks_end_and_its_shims_connection_ready_together_are_both_handled(tmp_path):
    # handling the rank's end closes the shim's connection; the connection's own event in
    # the same select() must then be skipped, not read from a closed socket (which ended the
    # warm process, and every later rank of its key started fresh)
    import selectors
    import socket

    server = warm.Server(str(tmp_path / "warm.sock"), [])
    server.selector = selectors.DefaultSelector()
    conn, shim_end = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    pidfd = os.pidfd_open(pid)
    server.ranks[conn] = pid
    server.selector.register(conn, selectors.EVENT_READ, "rank")
    server.selector.register(pidfd, selectors.EVENT_READ, (pid, conn))
    shim_end.shutdown(socket.SHUT_WR)  # the shim exits: its connection reads as ended too
    events = []
    while len(events) < 2:
        events = server.selector.select(timeout=10)
        assert events, "neither event came"
    events.sort(key=lambda event: event[0].fd != pidfd)  # the rank's end first
    server._dispatch(events, listener=None)
    assert server.ranks == {} and not server.selector.get_map()
    assert warm_shim.receive(shim_end) == {"exit": 3}
    shim_end.close()


def test_the_warm_process_preloads_the_compiled_steps_or_says_why_not():
    # before MPI is imported (hororun's warm process): loaded, None; after, or off: why not
    script = ("import sys\n"
              "from hororing.algorithms import compiled\n"
              "if sys.argv[1] == 'imported': import mpi4py.MPI\n"
              "print(compiled.preload(sys.argv[2]))\n"
              "print(compiled._Loader.error is None and all(\n"
              "    (dtype, False) in compiled._Loader.entries for dtype in compiled.PRELOADED))\n")
    pytest.importorskip("numba")

    def preload(state, mode):
        done = subprocess.run([sys.executable, "-c", script, state, mode], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()
    assert preload("fresh", "auto") == ["None", "True"]
    assert preload("imported", "auto")[0] == "MPI is imported already"
    assert preload("fresh", "off")[0] == "the compiled steps are off, or numba is not installed"
