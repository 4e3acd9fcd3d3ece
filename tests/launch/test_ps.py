"""Parameter-server mode as whole jobs: placements, colocated shards, backup workers, errors."""

import re

import pytest


def ps_env(servers, placement="round_robin", **extra):
    env = {"HORORING_MODE": "ps", "HORORING_PS_SERVERS": str(servers),
           "HORORING_PS_PLACEMENT": placement, "HORORING_PS_PARTITION_BYTES": "4096"}
    env.update({key: str(value) for key, value in extra.items()})
    return env


@pytest.mark.parametrize("ranks,servers,placement", [
    (3, 1, "round_robin"), (4, 1, "greedy_bytes"), (4, 2, "partitioned"), (4, 2, "round_robin"),
    (3, 2, "greedy_bytes"), (3, "colocated", "partitioned"), (4, "colocated", "round_robin"),
])
def test_every_placement_gives_correct_results(launch, ranks, servers, placement):
    job = launch(ranks, "ps_check.py", env=ps_env(servers, placement), timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    workers = ranks if servers == "colocated" else ranks - servers
    assert job.stdout.count("PS CHECK OK") == workers
    # servers' lines may run together on the shared stdout: match each one lazily
    served = re.findall(r"\[hororing PS server \d\] (\d+) steps from (\d+) workers.*?"
                        r"late pushes dropped: (\d+)", job.stdout)
    assert len(served) == (0 if servers == "colocated" else servers)
    assert all(int(steps) > 0 and int(count) == workers and dropped == "0"
               for steps, count, dropped in served)


def test_backup_workers_aggregate_the_first_replicas_and_count_the_late(launch):
    job = launch(4, "ps_check.py", env=ps_env(1, HORORING_PS_REPLICAS_TO_AGGREGATE=2),
                 timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.count("PS CHECK OK") == 3
    steps, dropped = map(int, re.search(r"(\d+) steps from 3 workers.*?late pushes dropped: (\d+)",
                                        job.stdout).groups())
    assert dropped == steps  # one of three pushes is late at every step


@pytest.mark.parametrize("ranks,env,message", [
    (2, ps_env(2), r"PS mode with 2 server\(s\) needs more than 2 ranks, but the job has 2"),
    (3, ps_env(1, HORORING_PS_REPLICAS_TO_AGGREGATE=3),
     r"replicas_to_aggregate must be in \[1, 2\]"),
    (2, {"HORORING_MODE": "parameter-server"}, "mode must be one of"),
    (2, ps_env(1, "random"), "PS placement must be one of"),
    (2, ps_env(-1), "number of PS servers must be >= 0"),
    (2, ps_env("colocated", HORORING_PS_REPLICAS_TO_AGGREGATE=1), "needs dedicated servers"),
])
def test_bad_ps_settings_fail_at_init_on_every_rank(launch, ranks, env, message):
    job = launch(ranks, "ps_init_error.py", env=env, timeout=60)
    assert job.returncode == 0, job.stderr[-2000:]
    for rank in range(ranks):
        assert re.search(rf"world rank {rank} ValueError: [^\n]*{message}", job.stdout), \
            job.stdout[-2000:]


def test_a_crashed_worker_does_not_leave_the_servers_running(launch):
    job = launch(4, "ps_worker_fails.py", timeout=90)
    assert job.returncode != 0
    assert "KeyError: 'missing batch 17'" in job.stderr


@pytest.mark.parametrize("ranks,servers", [(2, 1), (4, 1), (4, 2), (3, 2)])
def test_asynchronous_ps_applies_every_update_on_the_servers(launch, ranks, servers):
    job = launch(ranks, "ps_async.py", env=ps_env(servers), timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    workers = ranks - servers
    assert job.stdout.count("ASYNC OK") == workers
    updates = [int(count) for count in re.findall(r"asynchronous updates applied: (\d+)", job.stdout)]
    steps = 8 if workers == 1 else 9  # the extra pull after the barrier
    assert updates == [workers * steps] * servers


def test_asynchronous_ps_refuses_ring_and_colocated_modes(launch):
    for env in ({}, ps_env("colocated")):
        job = launch(2, "ps_async.py", env=env, timeout=120)
        assert job.returncode != 0
        for rank in range(2):
            assert f"REFUSED on rank {rank}: asynchronous PS needs dedicated parameter servers" \
                in job.stdout, job.stdout[-3000:] + job.stderr[-3000:]


def test_a_worker_late_to_make_its_asynchronous_optimizer_is_waited_for_and_named(launch):
    job = launch(3, "ps_async_late.py", env=ps_env(1, HOROVOD_STALL_CHECK_TIME_SECONDS=1),
                 timeout=120)
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.count("REGISTERED") == 2
    assert "rank 0 (" in job.stderr and "in the asynchronous PS registration (the servers " \
        "answer once every worker has made its AsyncPSOptimizer)" in job.stderr
