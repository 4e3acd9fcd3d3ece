"""The state of an initialized job (communicators, topology, engine) and init/shutdown.

One default context exists per process, created by ``init()``; nothing else in the
library keeps mutable module-level state.
"""

import atexit
import itertools
import logging
import sys
import threading

from mpi4py import MPI

from .config import Config
from .engine.engine import FLAG_FAILED, Engine
from .errors import NotInitializedError
from .timeline import Timeline

log = logging.getLogger("hororing")


class Context:
    """Topology and engine of one initialized job."""

    def __init__(self, comm, config):
        self.config = config
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.local_comm.Get_rank()
        self.local_size = self.local_comm.Get_size()
        self.cross_comm = comm.Split(color=self.local_rank, key=self.rank)
        self.cross_rank = self.cross_comm.Get_rank()
        self.cross_size = self.cross_comm.Get_size()
        timeline = None
        if config.timeline_path and self.rank == 0:
            timeline = Timeline(config.timeline_path, config.timeline_mark_cycles)
        self.engine = Engine(comm, config, timeline)
        self._name_counters = {}

    def auto_name(self, kind):
        """Name an unnamed collective; equal on all ranks that make the same calls."""
        counter = self._name_counters.setdefault(kind, itertools.count())
        return f"{kind}.noname.{next(counter)}"

    def close(self, failure=None):
        """Leave the job: tell the peers (shutdown, or ``failure``, a message) and free MPI state."""
        if failure is None:
            self.engine.stop()
        else:
            self.engine.stop(message=failure, flags=FLAG_FAILED, deadline_s=10.0)
        self.engine.close()
        for comm in (self.local_comm, self.cross_comm, self.comm):
            comm.Free()


class _State:
    """Holder of the default context (the one piece of module state)."""

    lock = threading.Lock()
    context = None
    hooks_installed = False


def init(comm=None, **config_overrides):
    """Initialize hororing: every rank of ``comm`` must call it.

    Args:
        comm: an mpi4py communicator, a list of world ranks that take part, or None for
            MPI.COMM_WORLD. hororing works on its own duplicate, so its messages never match
            the user's.
        **config_overrides: Config fields that take precedence over the environment.

    Raises:
        TypeError: for a ``comm`` that is neither a communicator nor a list of ranks.
        ValueError: for bad ranks or settings.

    Example:
        >>> import hororing as hvd
        >>> hvd.init()
        >>> hvd.rank(), hvd.size()
    """
    with _State.lock:
        if _State.context is not None:
            return
        config = Config.from_environ(**config_overrides)
        logging.basicConfig(format="[%(levelname)s hororing] %(message)s")
        log.setLevel(config.log_level.upper())
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                f"hororing needs MPI_THREAD_MULTIPLE, but MPI was initialized with thread level "
                f"{provided}; do not set mpi4py.rc.thread_level to a lower level")
        user_comm = _resolve_comm(comm)
        _State.context = Context(user_comm.Dup(), config)
        if not _State.hooks_installed:
            _install_exit_hooks()
            _State.hooks_installed = True


def shutdown():
    """Stop hororing on this rank; pending collectives fail. Safe to call twice."""
    with _State.lock:
        context, _State.context = _State.context, None
    if context is not None:
        context.close()


def is_initialized():
    """Return True between ``init()`` and ``shutdown()``."""
    return _State.context is not None


def current():
    """Return the default context or raise the not-initialized error."""
    context = _State.context
    if context is None:
        raise NotInitializedError()
    return context


def size():
    """Return the number of ranks."""
    return current().size


def rank():
    """Return this process's rank in [0, size())."""
    return current().rank


def local_size():
    """Return the number of ranks on this host (a shared-memory split)."""
    return current().local_size


def local_rank():
    """Return this rank's index among the ranks of its host."""
    return current().local_rank


def cross_size():
    """Return the number of hosts that have a rank with this local_rank."""
    return current().cross_size


def cross_rank():
    """Return this host's index among those hosts."""
    return current().cross_rank


def start_timeline(file_path, mark_cycles=False):
    """Start writing a Chrome trace of the collectives to ``file_path`` (rank 0 writes it)."""
    context = current()
    timeline = Timeline(file_path, mark_cycles) if context.rank == 0 else None
    context.engine.set_timeline(timeline)


def stop_timeline():
    """Stop and close the timeline started by ``start_timeline`` or HOROVOD_TIMELINE."""
    current().engine.set_timeline(None)


def _resolve_comm(comm):
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, MPI.Intracomm):
        return comm
    if isinstance(comm, (list, tuple, range)):
        ranks = list(comm)
        world = MPI.COMM_WORLD
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world.Get_size()]
        if bad or not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"init(comm=[...]) needs distinct world ranks in "
                             f"[0, {world.Get_size()}), got {ranks}")
        if world.Get_rank() not in ranks:
            raise ValueError(f"this process (world rank {world.Get_rank()}) is not in the ranks "
                             f"given to init(): {ranks}; only those ranks may call init()")
        group = world.Get_group().Incl(ranks)
        return world.Create_group(group)
    raise TypeError(f"init(comm=...) takes an mpi4py communicator or a list of ranks, got "
                    f"{type(comm).__name__}")


def _install_exit_hooks():
    previous = sys.excepthook

    def tell_peers_and_report(kind, value, traceback):
        # A rank dying with an uncaught exception tells its peers why, so they fail with
        # that reason instead of waiting forever for its next collective.
        context = _State.context
        if context is not None:
            _State.context = None
            try:
                context.close(failure=f"{kind.__name__}: {value}")
            except Exception:  # reporting must never hide the original error
                pass
        previous(kind, value, traceback)

    sys.excepthook = tell_peers_and_report
    atexit.register(shutdown)
