"""Elastic training: state that survives a lost rank, and jobs that change size.

``hvd.elastic`` of every binding builds on this package (Horovod's names and meaning):
a ``State`` is committed every few steps; under ``hororun --min-np/--max-np
--host-discovery-script`` each commit is also written to disk on every host, so that when a
rank dies or the hosts change, hororun relaunches the job and the ``run``-wrapped function
resumes from the newest commit any host kept. Where the MPI has ULFM (Open MPI started with
``--with-ft ulfm``) the survivors of a dead rank go on in process instead (``recovery.py``).
See docs/elastic.md.

This package sits above the engine: it uses the public collectives, and the context's
``continue_with_survivors`` to go on after a failure.
"""

from ..errors import HorovodInternalError, HostsUpdatedInterrupt, RanksFailedError
from .run import run, run_fn
from .state import ObjectState, State

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "RanksFailedError",
           "State", "run", "run_fn"]
