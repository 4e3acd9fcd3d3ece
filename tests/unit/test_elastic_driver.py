"""hororun's elastic driver after the survivors of a dead rank went on in process: the dead
ranks' slots are held out (as Horovod blacklists a failed worker's host), for the cooldown or
for good, and never below --min-np; growth is asked for only beyond them."""

import pytest

from hororing.elastic import job
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
    assert made._change(made._running, PLACED) is None


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
    assert made._change(made._running, PLACED) is None
    clock[0] += 5.5
    assert made._change(made._running, PLACED) == "3 slots usable, the job has 2"
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
