"""mpi4py's ``MPI`` module, imported on first use rather than at ``import hororing``.

Importing ``mpi4py.MPI`` initializes MPI. Every hororing module reaches MPI through the
object below, so MPI starts in ``hvd.init()`` (or whenever a program touches MPI first),
and modules that never talk to MPI (negotiation, the ring's schedule, the cost model) can be
imported, and tested, without it.

The end of a job whose ranks run with failures tolerated (Open MPI's ULFM, ``mpiexec --with-ft
ulfm``, as hororun starts an elastic job that recovers in process): there MPI_Finalize waits
in a barrier of every process of the launch, and after a rank died it may wait there for
minutes (seen with Open MPI 5.0 as a survivor's exit that never came). So where hororing
imports MPI first in such a job, mpi4py is told not to finalize at exit, and hororing
finalizes at exit instead, unless this process saw a peer die (``faults.py`` says so through
``leave_without_finalize``): a survivor then exits without MPI_Finalize, with its own status,
which ULFM's mpiexec takes as it takes any exit. A program that imported ``mpi4py.MPI``
before hororing keeps mpi4py's finalize.
"""

import atexit
import importlib
import sys


class _Exit:
    own_finalize = False  # hororing, not mpi4py, finalizes MPI at exit
    without_finalize = False  # a peer died: this process leaves without MPI_Finalize


def _import_mpi():
    from .environment import failures_tolerated
    if "mpi4py.MPI" not in sys.modules and failures_tolerated():
        import mpi4py
        mpi4py.rc.finalize = False
        _Exit.own_finalize = True
        module = importlib.import_module("mpi4py.MPI")
        atexit.register(_finalize_at_exit, module)
        return module
    return importlib.import_module("mpi4py.MPI")


def _finalize_at_exit(module):
    if _Exit.without_finalize or module.Is_finalized():
        return
    module.Finalize()


def leave_without_finalize():
    """A peer process died: where hororing finalizes MPI at exit, this process will not
    (returns whether that applies); elsewhere MPI's own finalize stands."""
    _Exit.without_finalize = True
    return _Exit.own_finalize


class _MPIOnFirstUse:
    """Looks up ``mpi4py.MPI``'s attributes, importing it the first time; each attribute
    is then kept on this object, so later reads are ordinary attribute reads."""

    def __getattr__(self, name):
        value = getattr(_import_mpi(), name)
        setattr(self, name, value)
        return value

    def __repr__(self):
        return "<mpi4py.MPI, imported on first use>"


MPI = _MPIOnFirstUse()
