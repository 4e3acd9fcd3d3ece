"""liveness.LocalPeers sees whether this host's other ranks' processes run, and the stall
watchdog ends the job for one a long wait is on that has ended (two checks in a row)."""

import os
import subprocess
import sys
import time

import pytest

from hororing import liveness, transport

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"),
                                reason="process states are read from Linux's /proc")


@pytest.fixture
def child():
    """A running process standing for a peer rank; killed and collected after the test."""
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait()


def started(pid):
    text = open(f"/proc/{pid}/stat", "rb").read()
    return int(text[text.rfind(b")") + 2:].split()[19])


def test_identity_is_this_process_and_its_start_time():
    assert liveness.identity() == (os.getpid(), started(os.getpid()))


def test_only_a_running_peer_on_this_host_seen_as_it_saw_itself_is_watched(child):
    me, peer = liveness.identity(), (child.pid, started(child.pid))
    hosts = ["a", "a", "b", "a", "a"]
    identities = [me, peer, peer, (child.pid, peer[1] + 1), (child.pid, None)]
    peers = liveness.LocalPeers(0, hosts, identities)
    # rank 2 is on another host; rank 3's start time is not what this host sees for its pid
    # (another pid namespace's process); rank 4 could not say its start time
    assert peers.watched == {1: peer}
    assert peers.gone() == {}


def test_a_peer_that_exited_is_gone_collected_or_a_zombie(child):
    peers = liveness.LocalPeers(0, ["a", "a"], [liveness.identity(),
                                                (child.pid, started(child.pid))])
    child.kill()
    for _ in range(2000):  # the kill lands at once; bounded all the same
        if peers.gone():
            break
        time.sleep(0.005)
    assert open(f"/proc/{child.pid}/stat").read().split(") ")[1][0] == "Z"  # not collected
    assert peers.gone() == {1: child.pid}
    child.wait()
    assert peers.gone() == {1: child.pid} == peers.gone([1])


@pytest.fixture
def watchdog(monkeypatch, child):
    """A watchdog of rank 0 whose thread never checks (the test calls ``_check_peers``),
    over peers 1 and 2 (``child``, running) on its host; ``ended`` holds the job's ends."""
    ended = []
    monkeypatch.setattr(transport, "end_job", ended.append)
    identity = (child.pid, started(child.pid))
    peers = liveness.LocalPeers(0, ["h", "h", "h"], [liveness.identity(), identity, identity])
    dog = transport.StallWatchdog(0, ["h", "h", "h"], 60.0, 0.0, interval_s=3600.0, peers=peers)
    dog.ended = ended
    yield dog
    dog.stop()


def test_a_long_wait_on_a_peer_that_ended_ends_the_job_at_the_second_check(watchdog, child):
    now = 1000.0
    waits = [[now - 6.0, "negotiation cycle 7", [1, 2], None]]
    watchdog._check_peers(now, waits)
    assert watchdog.ended == []  # both running
    child.kill()
    child.wait()
    watchdog._check_peers(now + 1, waits)
    assert watchdog.ended == []  # seen once: the wait may be about to complete
    watchdog._check_peers(now + 2, waits)
    [message] = watchdog.ended
    assert "rank 0 (h) has waited 8 s in negotiation cycle 7 on rank 1 " \
           f"(pid {child.pid}), rank 2 (pid {child.pid})" in message
    assert "without the launcher ending the job" in message


@pytest.mark.parametrize("waits", [
    [[995.0, "a ring step", [1], None]],  # under 5 s at the checks below
    [[900.0, "an MPI operation", None, None]],  # names no peers
    [[900.0, "a ring step", [3], None]],  # rank 3 is not on this host
], ids=["short", "unnamed", "elsewhere"])
def test_short_waits_and_waits_not_on_the_ended_peer_end_nothing(watchdog, child, waits):
    child.kill()
    child.wait()
    for now in (999.0, 999.5, 999.9):
        watchdog._check_peers(now, waits)
    assert watchdog.ended == []


def test_a_watchdog_without_peers_it_can_watch_never_looks(child):
    peers = liveness.LocalPeers(0, ["h", "g"], [liveness.identity(),
                                                (child.pid, started(child.pid))])
    dog = transport.StallWatchdog(0, ["h", "g"], 60.0, 0.0, interval_s=3600.0, peers=peers)
    try:
        assert dog.peers is None
    finally:
        dog.stop()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
