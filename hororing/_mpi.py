"""mpi4py's ``MPI`` module, imported on first use rather than at ``import hororing``.

Importing ``mpi4py.MPI`` initializes MPI. Every hororing module reaches MPI through the
object below, so MPI starts in ``hvd.init()`` (or whenever a program touches MPI first),
and modules that never talk to MPI (negotiation, the ring's schedule, the cost model) can be
imported, and tested, without it.
"""

import importlib


class _MPIOnFirstUse:
    """Looks up ``mpi4py.MPI``'s attributes, importing it the first time; each attribute
    is then kept on this object, so later reads are ordinary attribute reads."""

    def __getattr__(self, name):
        value = getattr(importlib.import_module("mpi4py.MPI"), name)
        setattr(self, name, value)
        return value

    def __repr__(self):
        return "<mpi4py.MPI, imported on first use>"


MPI = _MPIOnFirstUse()
