"""Slurm's words for the job's layout, read without a cluster: node lists, tasks per node,
the singleton refusal, threads per rank, and hororun inside an allocation."""

import pytest

from hororing import launcher, slurm
from hororing.runner import allocations, mpiexec
from hororing.environment import launch_environment


def test_node_lists_and_tasks_per_node_expand():
    assert slurm.expand_nodelist("n[1-3,7],gpu[01-02],login") == [
        "n1", "n2", "n3", "n7", "gpu01", "gpu02", "login"]
    assert slurm.expand_nodelist("n1") == ["n1"]
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match=r"cannot read Slurm's node list 'n\[1-3'"):
        slurm.expand_nodelist("n[1-3")
    with pytest.raises(ValueError, match="cannot read Slurm's tasks per node '2x3'"):
        slurm.tasks_per_node("2x3")


def step(**extra):
    environ = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "1",
               "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_JOB_ID": "7"}
    environ.update(extra)
    return launch_environment(environ)


def test_singletons_under_srun_are_refused_with_the_fix():
    from hororing.world import check_world
    with pytest.raises(RuntimeError, match=r"srun started 4 processes, but MPI made this one a "
                                           r"job of size 1.*--mpi=pmi2.*--mpi=pmix"):
        check_world(1, step())
    # Open MPI under --mpi=pmi2: PMI announces 4, MPI still says 1
    with pytest.raises(RuntimeError, match="srun started 4 processes"):
        check_world(1, step(PMI_SIZE="4"))
    check_world(4, step())                                   # one job of 4
    check_world(1, step(PMI_SIZE="1"))                       # mpiexec -n 1
    check_world(1, step(HORORING_ALLOW_SINGLETONS="1"))      # intended
    check_world(1, launch_environment({}))                   # no Slurm at all
    with pytest.raises(ValueError, match="HORORING_ALLOW_SINGLETONS"):
        step(HORORING_ALLOW_SINGLETONS="maybe")


def test_ranks_per_node_come_from_mpiexec_or_from_srun():
    assert slurm.local_tasks(step()) == 1                                   # node 1 of "3,1"
    assert slurm.local_tasks(step(SLURM_NODEID="0")) == 3
    assert slurm.local_tasks(step(MPI_LOCALNRANKS="2")) == 2                # Hydra's word wins
    assert slurm.local_tasks(launch_environment({})) is None
    assert slurm.per_rank_threads(3, cpus=8) == 2 and slurm.per_rank_threads(16, cpus=8) == 1
    assert slurm.tensorflow_intra_op_threads(step(SLURM_NODEID="0")) == \
        slurm.per_rank_threads(3)
    assert slurm.tensorflow_intra_op_threads(step(OMP_NUM_THREADS="4")) is None
    assert slurm.tensorflow_intra_op_threads(step(TF_NUM_INTRAOP_THREADS="4")) is None


def test_a_ranks_threads_are_its_share_of_the_cores_it_may_use_not_of_the_machines(monkeypatch):
    from hororing import cores
    monkeypatch.setattr(cores, "affinity", lambda: list(range(8)))
    monkeypatch.setattr(cores, "quota", lambda: None)
    assert slurm.per_rank_threads(1) == 8 and slurm.per_rank_threads(3) == 2
    monkeypatch.setattr(cores, "quota", lambda: 2.0)  # a container held to 2 CPUs
    assert slurm.per_rank_threads(1) == 2 and slurm.per_rank_threads(3) == 1
    monkeypatch.setattr(cores, "affinity", lambda: [5])  # bound to one core
    monkeypatch.setattr(cores, "quota", lambda: None)
    assert slurm.per_rank_threads(1) == 1


def allocation_environment(monkeypatch, tasks="4", nodes="n[1-2]", per_node="2(x2)"):
    for name, value in {"SLURM_JOB_ID": "42", "SLURM_NTASKS": tasks,
                        "SLURM_JOB_NODELIST": nodes, "SLURM_TASKS_PER_NODE": per_node}.items():
        monkeypatch.setenv(name, value)


def test_an_allocation_gives_tasks_and_hosts(monkeypatch):
    allocation_environment(monkeypatch)
    within = slurm.allocation()
    assert (within.job_id, within.tasks, within.hosts) == ("42", 4, [("n1", 2), ("n2", 2)])
    monkeypatch.delenv("SLURM_JOB_ID")
    assert slurm.allocation() is None


def test_hororun_in_an_allocation_defaults_np_and_refuses_more(monkeypatch, capsys):
    allocation_environment(monkeypatch)
    seen = {}

    def fake_run(command, env):
        seen["command"] = command
        return 0
    monkeypatch.setattr(launcher, "run_and_explain", fake_run)
    monkeypatch.setattr(launcher, "mpi_flavor", lambda mpiexec: launcher.OPEN_MPI)
    monkeypatch.setattr(mpiexec.os, "cpu_count", lambda: 1)
    assert launcher.main(["--mpiexec", "mpiexec", "python", "t.py"]) == 0
    assert seen["command"][:3] == ["mpiexec", "-n", "4"]
    assert "--oversubscribe" not in seen["command"]  # Slurm's limits stand
    assert launcher.main(["--mpiexec", "mpiexec", "-np", "6", "python", "t.py"]) == 2
    assert ("-np 6 asks for more ranks than Slurm job 42 was allocated (4 tasks on n1, n2)"
            in capsys.readouterr().err)


def test_hororun_slurm_uses_the_plugin_of_the_mpi(monkeypatch):
    seen = {}
    monkeypatch.setattr(launcher, "run_and_explain",
                        lambda command, env: seen.setdefault("command", command) and 0)
    monkeypatch.setattr(launcher.shutil, "which", lambda name: f"/usr/bin/{name}")
    for flavor, plugin in ((launcher.MPICH, "pmi2"), (launcher.OPEN_MPI, "pmix")):
        seen.clear()
        monkeypatch.setattr(launcher, "mpi_flavor", lambda mpiexec, flavor=flavor: flavor)
        launcher.main(["--slurm", "--mpiexec", "mpiexec", "-np", "3", "python", "t.py"])
        assert seen["command"] == ["/usr/bin/srun", f"--mpi={plugin}", "-n", "3", "python", "t.py"]


def test_elastic_discovery_in_an_allocation_reads_squeue_not_the_frozen_list(
        monkeypatch, tmp_path):
    from hororing.runner import discovery
    allocation_environment(monkeypatch, nodes="n[1-2]", per_node="2(x2)")
    squeue = tmp_path / "squeue"
    squeue.write_text("#!/bin/sh\ncat " + str(tmp_path / "live") + "\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    discover = discovery.choose(None, 1, None, 4, allocation=allocations.find())
    (tmp_path / "live").write_text("n[1-2]\n")
    assert discover() == [("n1", 2), ("n2", 2)]
    (tmp_path / "live").write_text("n1\n")  # scontrol update JobId=42 NodeList=n1
    assert discover() == [("n1", 2)]
    (tmp_path / "live").write_text("")     # the job is gone
    with pytest.raises(discovery.DiscoveryError, match="gave no nodes for Slurm job 42"):
        discover()
    # a script or hosts given: those win
    assert isinstance(discovery.choose("x.sh", 1, None, 4, allocation=allocations.find()),
                      discovery.ScriptDiscovery)


def test_under_srun_torch_gets_its_share_of_the_cores(monkeypatch):
    import sys
    import types
    threads = []
    fake = types.SimpleNamespace(set_num_threads=threads.append)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(slurm.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert slurm.set_framework_threads(4, step()) == 2 and threads == [2]
    # mpiexec said the local size (torch divides by itself), or the user chose: left alone
    assert slurm.set_framework_threads(4, step(MPI_LOCALNRANKS="4")) is None
    assert slurm.set_framework_threads(4, step(OMP_NUM_THREADS="3")) is None
    assert slurm.set_framework_threads(4, launch_environment({})) is None
    assert threads == [2]


def test_numpy_blas_gets_this_ranks_share_of_the_cores_unless_the_user_chose():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from hororing.slurm import per_rank_threads, set_blas_threads

    blas = [info for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas"]
    if not blas:
        pytest.skip("numpy has no BLAS threadpoolctl can see")
    before = blas[0]["num_threads"]
    try:
        assert set_blas_threads(1, environ={}) is None  # alone on the node: left alone
        assert set_blas_threads(4, environ={"OMP_NUM_THREADS": "3"}) is None
        assert set_blas_threads(4, environ={"OPENBLAS_NUM_THREADS": "2"}) is None
        threads = set_blas_threads(4, environ={})
        assert threads == per_rank_threads(4)
        assert {info["num_threads"] for info in threadpoolctl.threadpool_info()
                if info["user_api"] == "blas"} == {threads}
    finally:
        threadpoolctl.threadpool_limits(limits=before, user_api="blas")
