"""hororun with no hosts given, inside a PBS or LSF job or the launcher pod of Kubeflow's MPI
Operator: the hosts and slots come from the scheduler's files and variables, -np defaults to
their slots and may not exceed them. Read without a cluster (the files are written here)."""

import pytest

from hororing import launcher
from hororing.runner import allocations, discovery, mpiexec

SCHEDULER_VARIABLES = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "PBS_JOBID",
                       "PBS_NODEFILE", "LSB_JOBID", "LSB_MCPU_HOSTS", "LSB_DJOB_HOSTFILE",
                       "K_MPI_JOB_ROLE", "OMPI_MCA_orte_default_hostfile", "HYDRA_HOST_FILE",
                       "I_MPI_HYDRA_HOST_FILE")
WORKERS = ["job-worker-0.job.default.svc", "job-worker-1.job.default.svc"]


@pytest.fixture(autouse=True)
def no_scheduler(monkeypatch):
    for name in SCHEDULER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def hororun(monkeypatch):
    """Run hororun's command line; return (status, the mpiexec command it would run)."""
    seen = {}

    def fake_run(command, env):
        seen["command"] = command
        seen["hostfile"] = (open(command[command.index("-f") + 1]).read()
                            if "-f" in command else None)
        return 0

    monkeypatch.setattr(launcher, "run_and_explain", fake_run)
    monkeypatch.setattr(mpiexec.os, "geteuid", lambda: 1000)

    def run(*argv, flavor=launcher.OPEN_MPI):
        seen.clear()
        monkeypatch.setattr(launcher, "mpi_flavor", lambda _mpiexec: flavor)
        status = launcher.main(["--mpiexec", "mpiexec", *argv, "python", "t.py"])
        return status, seen.get("command"), seen.get("hostfile")
    return run


def operator_launcher(monkeypatch, tmp_path, variable, lines):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(line + "\n" for line in lines))
    monkeypatch.setenv("K_MPI_JOB_ROLE", "launcher")
    monkeypatch.setenv(variable, str(hostfile))
    return hostfile


def test_the_mpi_operators_open_mpi_hostfile_gives_hosts_and_np(monkeypatch, tmp_path, hororun):
    operator_launcher(monkeypatch, tmp_path, "OMPI_MCA_orte_default_hostfile",
                      [f"{name} slots=2" for name in WORKERS])
    status, command, _ = hororun()
    assert status == 0
    assert command[:3] == ["mpiexec", "-n", "4"]
    assert command[command.index("-H") + 1] == ",".join(f"{name}:2" for name in WORKERS)
    assert "--oversubscribe" not in command
    # MPICH's mpiexec, started with the same variables, gets the hosts in its own file
    status, command, hostfile = hororun("-np", "3", flavor=launcher.MPICH)
    assert status == 0 and command[:3] == ["mpiexec", "-n", "3"]
    assert hostfile == "".join(f"{name}:2\n" for name in WORKERS)


@pytest.mark.parametrize("variable", ["HYDRA_HOST_FILE", "I_MPI_HYDRA_HOST_FILE"])
def test_the_mpich_and_intel_hostfiles_are_read_too(monkeypatch, tmp_path, hororun, variable):
    operator_launcher(monkeypatch, tmp_path, variable, [f"{name}:3" for name in WORKERS])
    status, command, hostfile = hororun(flavor=launcher.MPICH)
    assert status == 0 and command[:3] == ["mpiexec", "-n", "6"]
    assert hostfile == "".join(f"{name}:3\n" for name in WORKERS)


def test_more_ranks_than_the_mpijob_has_are_refused(monkeypatch, tmp_path, hororun, capsys):
    hostfile = operator_launcher(monkeypatch, tmp_path, "OMPI_MCA_orte_default_hostfile",
                                 [f"{name} slots=2" for name in WORKERS])
    status, command, _ = hororun("-np", "5")
    assert status == 2 and command is None
    err = capsys.readouterr().err
    assert (f"-np 5 asks for more ranks than the MPIJob (its host file {hostfile}) was "
            f"allocated (4 slots on {', '.join(WORKERS)}); ask for at most 4, or give the "
            f"MPIJob more workers") in err


def test_hosts_given_on_the_command_line_win(monkeypatch, tmp_path, hororun):
    operator_launcher(monkeypatch, tmp_path, "OMPI_MCA_orte_default_hostfile",
                      [f"{name} slots=2" for name in WORKERS])
    status, command, _ = hororun("-np", "8", "-H", "a:4,b:4")
    assert status == 0 and command[command.index("-H") + 1] == "a:4,b:4"


def test_an_unreadable_hostfile_names_its_variable(monkeypatch, tmp_path, hororun, capsys):
    monkeypatch.setenv("HYDRA_HOST_FILE", str(tmp_path / "missing"))
    assert hororun()[0] == 2
    err = capsys.readouterr().err
    assert f"HYDRA_HOST_FILE names {tmp_path / 'missing'}, which cannot be read" in err
    (tmp_path / "bad").write_text("node1 slots=x\n")
    monkeypatch.setenv("HYDRA_HOST_FILE", str(tmp_path / "bad"))
    assert hororun()[0] == 2
    err = capsys.readouterr().err
    assert "cannot read host entry 'node1 slots=x'" in err and "(named by HYDRA_HOST_FILE)" in err


def test_a_pbs_nodefile_lists_one_line_per_slot(monkeypatch, tmp_path, hororun, capsys):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("cn01\ncn01\ncn01\ncn02\ncn02\ncn02\n")
    monkeypatch.setenv("PBS_NODEFILE", str(nodefile))
    monkeypatch.setenv("PBS_JOBID", "7.pbsserver")
    status, command, _ = hororun()
    assert status == 0 and command[:3] == ["mpiexec", "-n", "6"]
    assert command[command.index("-H") + 1] == "cn01:3,cn02:3"
    assert hororun("-np", "7")[0] == 2
    assert ("-np 7 asks for more ranks than PBS job 7.pbsserver was allocated (6 slots on cn01, "
            "cn02)") in capsys.readouterr().err


def test_lsf_gives_its_hosts_in_a_variable_or_a_file(monkeypatch, tmp_path, hororun, capsys):
    monkeypatch.setenv("LSB_JOBID", "99")
    monkeypatch.setenv("LSB_MCPU_HOSTS", "node1 4 node2 2")
    status, command, hostfile = hororun(flavor=launcher.MPICH)
    assert status == 0 and command[:3] == ["mpiexec", "-n", "6"]
    assert hostfile == "node1:4\nnode2:2\n"
    monkeypatch.delenv("LSB_MCPU_HOSTS")
    (tmp_path / "djob").write_text("node3\nnode3\nnode4\n")
    monkeypatch.setenv("LSB_DJOB_HOSTFILE", str(tmp_path / "djob"))
    status, command, _ = hororun()
    assert status == 0 and command[command.index("-H") + 1] == "node3:2,node4:1"
    monkeypatch.setenv("LSB_MCPU_HOSTS", "node1 four")
    assert hororun()[0] == 2
    assert "cannot read LSF's LSB_MCPU_HOSTS 'node1 four'" in capsys.readouterr().err


def test_an_elastic_job_in_such_an_allocation_offers_its_hosts(monkeypatch, tmp_path):
    operator_launcher(monkeypatch, tmp_path, "OMPI_MCA_orte_default_hostfile",
                      [f"{name} slots=2" for name in WORKERS])
    within = allocations.find()
    assert not within.managed and within.tasks == 4
    discover = discovery.choose(None, 1, None, 2, allocation=within)
    assert discover() == [(name, 2) for name in WORKERS]


def test_no_scheduler_no_allocation():
    assert allocations.find() is None
