"""hororun's elastic driver after the survivors of a dead rank went on in process: the dead
ranks' slots are held out (as Horovod blacklists a failed worker's host), for the cooldown or
for good, and never below --min-np; growth is asked for only beyond them."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from hororing.elastic import commits, job
from hororing.runner.elastic import ElasticDriver

HOSTS = [("localhost", 3)]
PLACED = [("localhost", 3)]


def driver(min_np=1, max_np=None, cooldown=None):
    made = ElasticDriver(lambda *args: [], ["true"], lambda: HOSTS, min_np, max_np,
                         in_process=True, cooldown=cooldown)
    made._running = 3  # a launch of 3 ranks is running
    return made


def report(made, size, lost, of):
    made._shrunk(job.SHRUNK + f" {size} ranks ({lost} of {of} failed; the survivors shrank "
                               f"in 0.01 s)\n".encode())


def test_a_dead_ranks_slot_is_held_out_for_the_rest_of_the_job_by_default():
    made = driver()
    report(made, 2, 1, 3)
    assert made._running == 2
    assert made._size(HOSTS) == 2
    assert made._change(made._running, PLACED, HOSTS) is None


def test_two_deaths_hold_out_two_slots():
    made = driver()
    report(made, 2, 1, 3)
    report(made, 1, 1, 2)
    assert made._running == 1 and made._size(HOSTS) == 1


def test_after_the_cooldown_the_slot_is_offered_again_and_the_job_grows(monkeypatch):
    made = driver(cooldown=(5.0, 5.0))
    clock = [100.0]
    monkeypatch.setattr("hororing.runner.elastic.time.monotonic", lambda: clock[0])
    report(made, 2, 1, 3)
    assert made._change(made._running, PLACED, HOSTS) is None
    clock[0] += 5.5
    assert made._change(made._running, PLACED, HOSTS) == "3 slots usable, the job has 2"
    assert made._size(HOSTS) == 3


def test_held_out_slots_are_used_again_when_min_np_needs_them():
    made = driver(min_np=3)
    report(made, 2, 1, 3)
    assert made._size(HOSTS) == 3


@pytest.mark.parametrize("line", [job.SHRUNK + b"\n", job.SHRUNK + b" many ranks\n"])
def test_a_garbled_report_changes_nothing(line):
    made = driver()
    made._shrunk(line)
    assert made._running == 3 and made._size(HOSTS) == 3


# ---- a growing job's bigger launch, started ahead (handover) ---------------------------------

class FakeMpiexec:
    """A launch's mpiexec: it runs until the test ends it; the signals it was sent."""

    def __init__(self, env, acknowledged):
        self.env, self.acknowledged = env, acknowledged
        self.signals, self.returncode, self._done = [], None, threading.Event()

    def wait(self, timeout=None):
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("mpiexec", timeout)
        return self.returncode

    def poll(self):
        return self.returncode

    def send_signal(self, number):
        self.signals.append(number)
        if number == signal.SIGTERM:
            self.end(-signal.SIGTERM)

    def kill(self):
        self.end(-signal.SIGKILL)

    def end(self, status):
        if self.returncode is None:
            self.returncode = status
            self._done.set()


class Job:
    """An elastic driver with handover running in a thread over fake launches."""

    def __init__(self, tmp_path, hosts, handover_timeout=120.0):
        self.hosts, self.launches, self.status = list(hosts), [], None
        self.driver = ElasticDriver(lambda *args: ["mpiexec"], ["python", "train.py"],
                                    lambda: self.hosts, 2, 3, directory=str(tmp_path),
                                    interval=0.01, start=self._start, handover=True,
                                    handover_timeout=handover_timeout)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _start(self, command, env, acknowledged):
        self.launches.append(FakeMpiexec(env, acknowledged))
        return self.launches[-1], lambda: None

    def _run(self):
        self.status = self.driver.run()

    def launch(self, number):
        until(lambda: len(self.launches) > number)
        return self.launches[number]

    def finished(self):
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        return self.status


def until(condition, limit=30.0):
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "the driver did not get there"
        time.sleep(0.005)


def entered(made):
    made.driver._marked(job.ENTERED + b"\n")


@pytest.mark.parametrize("said", [True, False], ids=["commit-written", "job-ended"])
def test_the_bigger_launch_starts_ahead_and_takes_over_once_ready_and_the_job_stopped(tmp_path,
                                                                                      said):
    # the go comes as rank 0 says the commit is on every host, or, failing that, when the
    # stopped job has ended
    made = Job(tmp_path, [("localhost", 2)])
    first = made.launch(0)
    assert job.HANDOVER_ENV not in first.env
    entered(made)  # rank 0 is inside hvd.elastic.run: the script commits
    made.hosts = [("localhost", 3)]
    ahead = made.launch(1)
    assert ahead.env[job.HANDOVER_ENV] == "1" and ahead.env[job.LAUNCH_ENV] == "1"
    time.sleep(0.1)
    assert first.signals == [] and ahead.signals == []  # the job trains on meanwhile
    made.driver._marked(job.READY + b"\n")
    until(lambda: job.NOTICE_SIGNAL in first.signals)
    assert ahead.signals == []  # the ranks ahead wait until the job stopped at its commit
    first.acknowledged.set()
    if said:
        made.driver._marked(job.STOPPED + b"\n")
        until(lambda: ahead.signals == [job.NOTICE_SIGNAL])  # while the stopped job exits
        assert first.returncode is None
    first.end(job.RESCALE_STATUS)
    until(lambda: ahead.signals == [job.NOTICE_SIGNAL])  # go on from the commit
    entered(made)
    ahead.end(0)
    assert made.finished() == 0
    assert len(made.launches) == 2 and made.driver._running == 3


def growing(tmp_path):
    """A job of 2 ranks inside hvd.elastic.run whose hosts grew to 3: (the job, its running
    launch, the launch started ahead)."""
    made = Job(tmp_path, [("localhost", 2)])
    first = made.launch(0)
    entered(made)
    made.hosts = [("localhost", 3)]
    return made, first, made.launch(1)


def test_the_commit_a_job_stopped_at_is_the_one_its_rank_0_named(tmp_path, capsys):
    # the launch ahead goes on at once and commits while the stopped job's mpiexec exits: the
    # log names the commit the job stopped at, not the newest on disk when it ended
    made, first, ahead = growing(tmp_path)
    made.driver._marked(job.READY + b"\n")
    until(lambda: job.NOTICE_SIGNAL in first.signals)
    first.acknowledged.set()
    commits.write(tmp_path, 7, {"commits": 7})
    made.driver._marked(job.STOPPED + b" 7\n")
    until(lambda: ahead.signals == [job.NOTICE_SIGNAL])
    commits.write(tmp_path, 8, {"commits": 8})  # the launch ahead's first commit
    first.end(job.RESCALE_STATUS)
    entered(made)
    ahead.end(0)
    assert made.finished() == 0
    said = capsys.readouterr().err
    assert "launch 0 stopped at commit 7 for the new hosts" in said, said
    assert "launch 1 takes over from commit 7" in said, said


def stopped_and_relaunched(made, first):
    """The running launch ``first`` stops at its commit; the job's next launch is a plain one
    (not started ahead) that takes the ended launch's number and finishes."""
    first.acknowledged.set()
    first.end(job.RESCALE_STATUS)
    third = made.launch(2)
    assert job.HANDOVER_ENV not in third.env and third.env[job.LAUNCH_ENV] == "1"
    third.end(0)
    assert made.finished() == 0


def test_a_launch_ahead_that_fails_is_ended_and_the_job_grows_by_a_relaunch(tmp_path):
    made = Job(tmp_path, [("localhost", 2)])
    first = made.launch(0)
    entered(made)
    made.hosts = [("localhost", 3)]
    made.launch(1).end(1)  # e.g. a rank that raised before hvd.elastic.run
    until(lambda: job.NOTICE_SIGNAL in first.signals)
    time.sleep(0.1)
    assert len(made.launches) == 2  # not started ahead again for this launch
    stopped_and_relaunched(made, first)


def test_a_launch_ahead_never_ready_is_ended_at_the_handover_timeout_and_the_job_relaunched(
        tmp_path, capsys):
    # a rank stuck in its start must not hold the growth back for ever
    made = Job(tmp_path, [("localhost", 2)], handover_timeout=0.3)
    first = made.launch(0)
    entered(made)
    made.hosts = [("localhost", 3)]
    ahead = made.launch(1)
    until(lambda: ahead.signals == [signal.SIGTERM])
    until(lambda: job.NOTICE_SIGNAL in first.signals)  # then the job stops at a commit
    stopped_and_relaunched(made, first)
    said = capsys.readouterr().err
    assert "launch 1, started ahead, was not ready within --handover-timeout 0.3 s; ending it" \
        in said, said


def test_a_launch_ahead_is_ended_when_the_job_finishes_first(tmp_path):
    made, first, ahead = growing(tmp_path)
    made.driver._marked(job.RETURNED + b"\n")
    first.end(0)
    assert made.finished() == 0
    assert ahead.signals == [signal.SIGTERM] and len(made.launches) == 2


def test_a_launch_ahead_on_a_host_that_went_away_is_ended(tmp_path):
    made = Job(tmp_path, [("localhost", 2)])
    first = made.launch(0)
    entered(made)
    made.hosts = [("localhost", 2), ("127.0.0.1", 1)]
    ahead = made.launch(1)
    made.hosts = [("localhost", 2)]
    until(lambda: ahead.signals == [signal.SIGTERM])
    time.sleep(0.1)
    assert first.signals == []  # nothing to grow into: the job goes on
    first.end(0)
    assert made.finished() == 0


def test_no_launch_starts_ahead_before_the_script_is_inside_hvd_elastic_run(tmp_path):
    # a script without hvd.elastic.run would run a second time beside the first
    made = Job(tmp_path, [("localhost", 2)])
    first = made.launch(0)
    made.hosts = [("localhost", 3)]
    until(lambda: job.NOTICE_SIGNAL in first.signals)
    assert len(made.launches) == 1
    first.end(0)
    assert made.finished() == 0


WAITER = """
import sys, time
from hororing.elastic import commits, job
met = []


def barrier():
    met.append("barrier")
    print("at the barrier", file=sys.stderr, flush=True)


job.await_handover(barrier, int(sys.argv[1]))
print("went on", met, flush=True)
job.await_handover(lambda: met.append("again"), int(sys.argv[1]))  # once per process
print("and again at once", met, flush=True)
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_started_ahead_meets_the_others_says_ready_and_waits_for_the_signal(rank):
    env = {**os.environ, job.HANDOVER_ENV: "1"}
    with subprocess.Popen([sys.executable, "-c", WAITER, str(rank)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as waiter:
        try:
            # the signal is taken from before the barrier on
            assert waiter.stderr.readline() == b"at the barrier\n"
            if rank == 0:  # rank 0 says READY once past the barrier; the others say nothing
                assert waiter.stderr.readline() == job.READY + b"\n"
            time.sleep(0.5)
            assert waiter.poll() is None  # still waiting
            waiter.send_signal(job.NOTICE_SIGNAL)
            out, err = waiter.communicate(timeout=60)
        finally:
            waiter.kill()
    assert waiter.returncode == 0, err.decode()
    assert out.decode().splitlines() == ["went on ['barrier']",
                                         "and again at once ['barrier']"]


def test_outside_a_launch_started_ahead_nothing_waits(monkeypatch):
    monkeypatch.delenv(job.HANDOVER_ENV, raising=False)
    met = []
    job.await_handover(lambda: met.append("barrier"), 0)
    assert met == []


def test_the_driver_looks_at_the_hosts_again_as_a_held_out_slot_comes_back(monkeypatch):
    made = driver(cooldown=(0.3, 0.3))
    made.interval = 1.0
    clock = [100.0]
    monkeypatch.setattr("hororing.runner.elastic.time.monotonic", lambda: clock[0])
    assert made._until_next_poll() == 1.0
    report(made, 2, 1, 3)
    assert made._until_next_poll() == pytest.approx(0.31)
    clock[0] += 0.31
    assert made._until_next_poll() == 1.0
