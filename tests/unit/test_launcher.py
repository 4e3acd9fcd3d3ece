"""hororun's command line: hosts, host files and the mpiexec call for each MPI."""

import argparse

import pytest

from hororing import launcher
from hororing.runner import build_info, hosts, mpiexec


def args(**overrides):
    values = dict(np=4, hosts=None, hostfile=None, start_timeout=None, mpi_args="",
                  command=["python", "t.py"])
    values.update(overrides)
    return argparse.Namespace(**values)


def test_host_lists_and_files(tmp_path):
    assert hosts.parse_hosts("a:4, b:2,c") == [("a", 4), ("b", 2), ("c", 1)]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4\nnode2:2\n\nnode3\n")
    assert hosts.read_hostfile(hostfile) == [("node1", 4), ("node2", 2), ("node3", 1)]
    with pytest.raises(ValueError, match=r"cannot read host entry 'a:x'"):
        hosts.parse_hosts("a:x")
    hostfile.write_text("node1 slots=0\n")
    with pytest.raises(ValueError, match=r"line 1\): expected host:slots"):
        hosts.read_hostfile(hostfile)


def test_mpich_gets_a_hydra_host_file(tmp_path):
    command, env = launcher.build_command(args(hosts="a:2,b:2", start_timeout=30.0), "mpiexec",
                                          launcher.MPICH, str(tmp_path))
    assert command[:3] == ["mpiexec", "-n", "4"] and command[-2:] == ["python", "t.py"]
    hostfile = command[command.index("-f") + 1]
    assert open(hostfile).read() == "a:2\nb:2\n"
    assert env["HOROVOD_START_TIMEOUT"] == "30.0"


def test_open_mpi_gets_hosts_and_oversubscribe_when_ranks_exceed_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(mpiexec.os, "geteuid", lambda: 0)
    monkeypatch.setattr(mpiexec.os, "cpu_count", lambda: 2)
    command, _ = launcher.build_command(args(np=4, hosts="localhost:4"), "mpiexec",
                                        launcher.OPEN_MPI, str(tmp_path))
    assert "--allow-run-as-root" in command and "--oversubscribe" in command
    assert command[command.index("-H") + 1] == "localhost:4"
    monkeypatch.setattr(mpiexec.os, "geteuid", lambda: 1000)
    command, _ = launcher.build_command(args(np=4, hosts="a:2,b:2"), "mpiexec",
                                        launcher.OPEN_MPI, str(tmp_path))
    assert "--allow-run-as-root" not in command and "--oversubscribe" not in command


def test_bad_command_lines_are_refused(capsys):
    with pytest.raises(SystemExit):
        launcher.main(["-np", "2"])
    assert "give the command to run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launcher.main(["python", "t.py"])
    assert "-np is required" in capsys.readouterr().err


def test_check_build_lists_what_is_there():
    report = build_info.check_build(None)
    assert "Available Frameworks:" in report and "[X] MPI" in report
    assert "[ ] NCCL" in report and "(no mpiexec found)" in report


def test_no_mpiexec_is_reported_with_the_fix(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "find_mpiexec", lambda: None)
    assert launcher.main(["-np", "2", "python", "t.py"]) == 2
    assert "no mpiexec found next to this Python or on PATH" in capsys.readouterr().err


def test_autotune_options_become_horovods_variables(tmp_path, monkeypatch):
    monkeypatch.delenv("HOROVOD_AUTOTUNE", raising=False)
    parsed = launcher._parser().parse_args(
        ["-np", "2", "--autotune", "--autotune-log-file", "/tmp/tune.csv",
         "--autotune-steps-per-sample", "4", "--autotune-gaussian-process-noise", "0.5",
         "python", "t.py"])
    _, env = launcher.build_command(parsed, "mpiexec", launcher.MPICH, str(tmp_path))
    assert (env["HOROVOD_AUTOTUNE"], env["HOROVOD_AUTOTUNE_LOG"],
            env["HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"],
            env["HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"]) == ("1", "/tmp/tune.csv", "4", "0.5")
    assert "HOROVOD_AUTOTUNE_WARMUP_SAMPLES" not in env  # left to the default
    parsed = launcher._parser().parse_args(["-np", "2", "python", "t.py"])
    _, env = launcher.build_command(parsed, "mpiexec", launcher.MPICH, str(tmp_path))
    assert "HOROVOD_AUTOTUNE" not in env


def test_an_elastic_command_line_runs_the_elastic_driver_and_nothing_else(monkeypatch):
    ran = []

    class Driver:
        def run(self):
            ran.append("driver")
            return 7

    monkeypatch.setattr(launcher, "_elastic_driver", lambda args, mpiexec, within: Driver())
    monkeypatch.setattr(launcher, "run_and_explain",
                        lambda command, env: ran.append("mpiexec") or 0)
    assert launcher.main(["--mpiexec", "mpiexec", "-np", "2", "--min-np", "1", "python",
                          "t.py"]) == 7
    assert ran == ["driver"]


def test_open_mpi_carries_the_jobs_variables_to_other_hosts(tmp_path, monkeypatch):
    # daemons started over ssh get sshd's environment: the job's variables go by name (-x)
    monkeypatch.setenv("HORORING_TEST_SETTING", "1")
    monkeypatch.setenv("OMPI_MCA_some_param", "x")
    command, env = launcher.build_command(args(hosts="node1:2,node2:2", start_timeout=30.0),
                                          "mpiexec", launcher.OPEN_MPI, str(tmp_path))
    carried = {command[i + 1] for i, part in enumerate(command) if part == "-x"}
    assert {"HORORING_TEST_SETTING", "HOROVOD_START_TIMEOUT", "PATH"} <= carried
    assert not {name for name in carried if name.startswith("OMPI_")} and "PWD" not in carried
    assert command[-2:] == ["python", "t.py"]
    # one host, this machine, or MPICH (Hydra passes everything): nothing named
    command, _ = launcher.build_command(args(hosts="localhost:4"), "mpiexec", launcher.OPEN_MPI,
                                        str(tmp_path))
    assert "-x" not in command
    command, _ = launcher.build_command(args(hosts="node1:2,node2:2"), "mpiexec", launcher.MPICH,
                                        str(tmp_path))
    assert "-x" not in command


@pytest.mark.parametrize("flavor", [launcher.MPICH, launcher.OPEN_MPI])
def test_more_ranks_than_the_hosts_slots_are_refused(tmp_path, flavor):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\nb:1\n")
    with pytest.raises(ValueError, match=r"-np 3 asks for more processes than the hosts' 2 "
                                         r"slots \(a:1, b:1\); lower -np, or give the hosts "
                                         r"more slots"):
        launcher.build_command(args(np=3, hostfile=str(hostfile)), "mpiexec", flavor,
                               str(tmp_path))
    with pytest.raises(ValueError, match=r"-np 5 asks for more processes than the hosts' 4"):
        launcher.build_command(args(np=5, hosts="a:2,b:2"), "mpiexec", flavor, str(tmp_path))
    command, _ = launcher.build_command(args(np=2, hostfile=str(hostfile)), "mpiexec", flavor,
                                        str(tmp_path))
    assert command[:3] == ["mpiexec", "-n", "2"]


def test_hororun_refuses_more_ranks_than_slots_on_its_command_line(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a:1\nb:1\n")
    assert launcher.main(["--mpiexec", "mpiexec", "-np", "3", "--hostfile", str(hostfile),
                          "python", "t.py"]) == 2
    assert "hororun: -np 3 asks for more processes than the hosts' 2 slots" in \
        capsys.readouterr().err
