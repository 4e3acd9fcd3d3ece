"""The opt-in alias under which ``import horovod`` is hororing (HORORING_AS_HOROVOD=1, set by
``hororun --as-horovod``), as a new Python process meets it: started by the .pth file the
wheel (or scripts/install.sh, for a checkout) puts in site-packages."""

import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from hororing import launcher

PTH = os.path.join(sysconfig.get_paths()["purelib"], "hororing-horovod-alias.pth")


def python(code, **env):
    environment = {key: value for key, value in os.environ.items()
                   if key != "HORORING_AS_HOROVOD"}
    environment.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=environment)


@pytest.fixture(autouse=True)
def alias_installed():
    assert os.path.exists(PTH), (f"{PTH} is missing: the wheel installs it; for a checkout, "
                                 f"scripts/install.sh copies hororing/horovod-alias.pth there")


def test_with_the_variable_horovod_is_hororing_and_nothing_is_imported_before():
    job = python("""
        import sys
        assert "hororing" not in sys.modules and "mpi4py" not in sys.modules  # MPI not started
        import horovod, horovod.torch as hvd, horovod.keras, horovod.tensorflow.keras
        from horovod.torch.elastic import TorchState
        import hororing, hororing.torch
        assert horovod is hororing and hvd is hororing.torch
        assert sys.modules["horovod.tensorflow.keras"] is sys.modules["hororing.tensorflow.keras"]
        assert TorchState is sys.modules["hororing.torch.elastic"].TorchState
        print("ok", hvd.DistributedOptimizer.__module__)
    """, HORORING_AS_HOROVOD="1")
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.startswith("ok hororing.torch")


@pytest.mark.parametrize("name,why", [("horovod.spark", "Horovod on Spark"),
                                      ("horovod.ray", "Horovod on Ray"),
                                      ("horovod.mxnet", "the MXNet binding"),
                                      ("horovod.nothing", "which has no hororing.nothing")])
def test_what_hororing_has_not_fails_on_import_saying_so(name, why):
    job = python(f"import {name}", HORORING_AS_HOROVOD="true")
    assert job.returncode == 1
    assert f"ModuleNotFoundError: No module named '{name}': HORORING_AS_HOROVOD makes " \
           f"'horovod' hororing" in job.stderr and why in job.stderr, job.stderr[-2000:]


def test_without_the_variable_import_horovod_is_left_alone():
    for value in (None, "0"):
        job = python("import sys; import horovod",
                     **({} if value is None else {"HORORING_AS_HOROVOD": value}))
        assert job.returncode == 1 and "No module named 'horovod'" in job.stderr


def test_a_value_that_is_neither_yes_nor_no_is_named():
    job = python("import horovod", HORORING_AS_HOROVOD="maybe")
    assert job.returncode == 1
    assert ("hororing: environment variable HORORING_AS_HOROVOD has an invalid value 'maybe'"
            in job.stderr) and "'import horovod' is left as it is" in job.stderr


def test_a_real_horovod_beside_it_is_never_shadowed_silently(tmp_path):
    real = tmp_path / "horovod"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    path = {"PYTHONPATH": str(tmp_path)}
    job = python("import horovod; print(getattr(horovod, 'REAL', False))", **path)
    assert job.returncode == 0 and job.stdout.strip() == "True"  # no variable: the real one
    job = python("import horovod, hororing; print(horovod is hororing)",
                 HORORING_AS_HOROVOD="1", **path)
    assert job.returncode == 0 and job.stdout.strip() == "True", job.stderr[-2000:]
    assert (f"HORORING_AS_HOROVOD is set: 'import horovod' gives hororing, not the Horovod "
            f"installed at {real / '__init__.py'}") in job.stderr


def test_hororun_as_horovod_sets_the_variable_for_the_ranks(tmp_path, monkeypatch):
    monkeypatch.delenv("HORORING_AS_HOROVOD", raising=False)
    parsed = launcher._parser().parse_args(["-np", "2", "--as-horovod", "python", "t.py"])
    _, env = launcher.build_command(parsed, "mpiexec", launcher.MPICH, str(tmp_path))
    assert env["HORORING_AS_HOROVOD"] == "1"
    parsed = launcher._parser().parse_args(["-np", "2", "python", "t.py"])
    _, env = launcher.build_command(parsed, "mpiexec", launcher.MPICH, str(tmp_path))
    assert "HORORING_AS_HOROVOD" not in env


def test_hororun_as_horovod_says_when_this_python_cannot_start_the_alias(tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.delenv("HORORING_AS_HOROVOD", raising=False)
    parsed = launcher._parser().parse_args(["-np", "2", "--as-horovod", "python", "t.py"])
    monkeypatch.setattr(launcher, "alias_installed", lambda: False)
    launcher.build_command(parsed, "mpiexec", launcher.MPICH, str(tmp_path))
    assert ("--as-horovod: this Python has no hororing-horovod-alias.pth in its site-packages"
            in capsys.readouterr().err)
    monkeypatch.setattr(launcher, "alias_installed", lambda: True)
    launcher.build_command(parsed, "mpiexec", launcher.MPICH, str(tmp_path))
    assert capsys.readouterr().err == ""
