"""Who finalizes MPI at a process's exit (``hororing/_mpi.py``): where mpiexec tolerates
failures (``--with-ft ulfm`` sets OMPI_MCA_mpi_ft_enable in every rank) hororing does, and
not at all in a process that saw a peer die; elsewhere mpi4py does, as always. Each case is a
process of its own (MPI initializes once per process), a singleton of the MPI installed."""

import subprocess
import sys
import time

import pytest

from hororing.runner import leftovers

pytest.importorskip("mpi4py")

# the atexit handler registered first runs last: it sees what the others left
PROGRAM = """
import atexit, sys
import mpi4py
seen = {}
def report():
    from mpi4py import MPI
    print("finalized" if MPI.Is_finalized() else "not finalized", seen["rc"], flush=True)
atexit.register(report)
from hororing._mpi import MPI, leave_without_finalize
MPI.COMM_WORLD.Get_rank()
seen["rc"] = mpi4py.rc.finalize
if sys.argv[1] == "peer-died":
    print("hororing finalizes" if leave_without_finalize() else "mpi4py finalizes")
sys.exit(int(sys.argv[2]))
"""


def run(case, status, tolerated):
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    if tolerated:
        env["OMPI_MCA_mpi_ft_enable"] = "1"
    began = time.time()
    try:
        return subprocess.run([sys.executable, "-c", PROGRAM, case, str(status)], env=env,
                              capture_output=True, text=True, timeout=120)
    finally:  # a process that leaves without MPI_Finalize leaves its shared memory
        leftovers.remove_left_behind(began, settle_s=0)


def test_under_tolerated_failures_hororing_finalizes_at_exit():
    finished = run("clean", 0, tolerated=True)
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.split("\n")[-2] == "finalized False"


def test_a_process_that_saw_a_peer_die_exits_without_finalize_and_with_its_status():
    finished = run("peer-died", 3, tolerated=True)
    assert finished.returncode == 3, finished.stderr
    assert finished.stdout.splitlines() == ["hororing finalizes", "not finalized False"]


def test_elsewhere_mpi4py_finalizes_as_always():
    finished = run("peer-died", 0, tolerated=False)
    assert finished.returncode == 0, finished.stderr
    # mpi4py finalizes after every atexit handler: not yet when the last one runs
    assert finished.stdout.splitlines() == ["mpi4py finalizes", "not finalized None"]
