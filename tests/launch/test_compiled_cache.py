"""The ring's compiled steps from a read-only copy of the package, as a system-wide install
is: numba cannot write its cache beside the code and writes it to the user's cache directory
(docs/compiled.md); the ring still runs compiled and gives the sum."""

import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from conftest import mpiexec

ROOT = pathlib.Path(__file__).resolve().parents[2]

JOB = """
import numpy as np
import hororing as hvd
from hororing.algorithms import compiled
hvd.init()
assert hvd.__file__.startswith({package!r}), hvd.__file__
from hororing.algorithms.cost import SHARED_LARGEST_BYTES
count = SHARED_LARGEST_BYTES // 4 + 1001  # past the shared allreduce's sizes: the ring's
values = np.arange(count, dtype=np.float32) * (hvd.rank() + 1)
result = hvd.allreduce(values, op=hvd.Sum, name="read-only")
assert np.array_equal(result, np.arange(count, dtype=np.float32) * 3), result[:4]
statuses = hvd.allgather_object(compiled.status())
if hvd.rank() == 0:
    print(" ".join(statuses))
"""


def _mount_read_only(path):
    for command in (["mount", "--bind", str(path), str(path)],
                    ["mount", "-o", "remount,ro,bind", str(path)]):
        if subprocess.run(command, capture_output=True).returncode != 0:
            subprocess.run(["umount", str(path)], capture_output=True)
            return False
    return True


def _copy_of_the_package(site):
    """The package (its kernels where an install puts them) copied into ``site``, without
    any compiled cache; returns ``site``."""
    shutil.copytree(ROOT / "hororing", site / "hororing",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "kernels", site / "hororing" / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


def test_a_read_only_install_runs_the_compiled_ring_and_caches_it_in_the_users_cache(tmp_path):
    pytest.importorskip("numba")
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a read-only bind mount needs root and mount(8)")
    package = _copy_of_the_package(tmp_path / "site")
    if not _mount_read_only(package):
        pytest.skip("this machine cannot make a read-only bind mount")
    try:
        cache = tmp_path / "cache"
        env = dict(os.environ, PYTHONPATH=str(package), HORORING_COMPILED_STEPS="wait",
                   XDG_CACHE_HOME=str(cache))
        env.pop("NUMBA_CACHE_DIR", None)
        script = tmp_path / "job.py"
        script.write_text(JOB.format(package=str(package)))
        job = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script)], env=env,
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert job.returncode == 0, job.stderr[-3000:]
        assert job.stdout.split() == ["compiled", "compiled"], job.stdout
        assert not list((package / "hororing").rglob("*.nbi"))  # nothing beside the code
        assert list((cache / "numba").rglob("native.ring-*.nbi")), list(cache.rglob("*"))
    finally:
        subprocess.run(["umount", str(package)], capture_output=True)


COUNTS = """
import numpy as np
from hororing.algorithms import compiled
assert compiled.__file__.startswith({package!r}), compiled.__file__
seconds, why = compiled.compile_ahead([("fold", np.dtype("float32"))])
assert why is None, why
print(*compiled.cache_counts())
"""


def test_cached_code_made_from_other_sources_is_compiled_again(tmp_path):
    """numba checks a cached function against its own file only: the fold cycle (folded.py)
    inlines codes.py's field numbers and native.py's reductions, so a change to either must
    make it compile again rather than load the old machine code."""
    pytest.importorskip("numba")
    package = _copy_of_the_package(tmp_path / "site")
    env = dict(os.environ, PYTHONPATH=str(package))
    env.pop("NUMBA_CACHE_DIR", None)  # the cache beside the copy's code
    script = tmp_path / "counts.py"
    script.write_text(COUNTS.format(package=str(package)))

    def counts():
        run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                             text=True, timeout=300, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        return [int(count) for count in run.stdout.split()]  # compiled, loaded
    assert counts() == [1, 0]
    assert counts() == [0, 1]
    codes = package / "hororing" / "algorithms" / "compiled" / "codes.py"
    codes.write_text(codes.read_text() + "\n# changed\n")
    assert counts() == [1, 0]
    assert counts() == [0, 1]


FORKED_JOB = """
import sys
forked = "numba" in sys.modules  # imported by the warm process; a fresh rank has not
from hororing.algorithms import compiled
before = compiled.status()  # before MPI: the warm process loaded the steps uninitialised
mpi_before = "mpi4py.MPI" in sys.modules
import numpy as np
import hororing as hvd
hvd.init()
from hororing.algorithms.cost import SHARED_LARGEST_BYTES
count = SHARED_LARGEST_BYTES // 4 + 1001  # past the shared allreduce's sizes: the ring's
values = np.arange(count, dtype=np.float32) * (hvd.rank() + 1)
result = hvd.allreduce(values, op=hvd.Sum, name="forked")
assert np.array_equal(result, np.arange(count, dtype=np.float32) * 3), result[:4]
seen = hvd.allgather_object(" ".join(["forked" if forked else "fresh", before,
                                       "mpi" if mpi_before else "no-mpi"]))
if hvd.rank() == 0:
    print("\\n".join(seen), flush=True)
"""


def test_ranks_forked_from_a_warm_process_run_compiled_from_their_first_ring(tmp_path):
    # hororun's relaunches fork ranks from a warm process (runner/warm.py), which loads the
    # compiled steps ahead without initialising MPI; the first launch's ranks start fresh
    pytest.importorskip("numba")
    from hororing.runner import warm

    script = tmp_path / "job.py"
    script.write_text(FORKED_JOB)
    path = tmp_path / "warm.sock"
    server = subprocess.Popen([sys.executable, "-m", "hororing.runner.warm", str(path),
                               "numpy,hororing,numba"], stdin=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        command = [mpiexec(), "-n", "2"] + warm.wrap(sys.executable, str(path),
                                                      [sys.executable, str(script)])
        runs = []
        for listening in (lambda: path.exists(),
                          # the first launch's ranks asked for a warm process of their key;
                          # it listens once it has imported and loaded
                          lambda: list(tmp_path.glob("warm.sock.*"))):
            for _ in range(3000):
                if listening() or server.poll() is not None:
                    break
                time.sleep(0.05)
            assert listening(), "nothing listens"
            job = subprocess.run(command, capture_output=True, text=True, timeout=300,
                                 cwd=tmp_path)
            assert job.returncode == 0, job.stderr[-3000:]
            runs.append(job.stdout.splitlines())
    finally:
        server.kill()
        server.wait()
    assert [line.split()[0] for line in runs[0]] == ["fresh", "fresh"], runs
    assert runs[1] == ["forked compiled no-mpi"] * 2, runs
