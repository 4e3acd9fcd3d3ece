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

from .algorithms import ps
from . import gpu
from .config import Config
from .engine.engine import FLAG_FAILED, Engine
from .errors import NotInitializedError
from .timeline import Timeline

log = logging.getLogger("hororing")


class Context:
    """Topology and engine of one initialized job."""

    def __init__(self, comm, config, reducer=None, ps_comm=None):
        self.config = config
        self.reducer = reducer  # PS mode: the allreduce through parameter servers
        self._ps_comm = ps_comm
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.local_comm.Get_rank()
        self.local_size = self.local_comm.Get_size()
        self.cross_comm = comm.Split(color=self.local_rank, key=self.rank)
        self.cross_rank = self.cross_comm.Get_rank()
        self.cross_size = self.cross_comm.Get_size()
        # one GPU per rank, where a GPU library is in use and the user has not chosen one
        self.device = gpu.select_device(self.local_rank)
        timeline = None
        if config.timeline_path and self.rank == 0:
            timeline = Timeline(config.timeline_path, config.timeline_mark_cycles)
        self.engine = Engine(comm, config, timeline, reducer)
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
        if self.reducer is not None:
            self.reducer.close(failure)  # dedicated servers exit when every worker is done
        self.engine.close()
        for comm in (self.local_comm, self.cross_comm, self.comm, self._ps_comm):
            if comm is not None:
                comm.Free()


class _State:
    """Holder of the default context (the one piece of module state)."""

    lock = threading.Lock()
    context = None
    hooks_installed = False


def init(comm=None, *, mode=None, num_servers=None, placement=None, replicas_to_aggregate=None,
         **config_overrides):
    """Initialize hororing: every rank of ``comm`` must call it.

    In PS mode with k dedicated servers, the last k ranks run the server loop inside this call
    and exit the process (status 0) once every worker has shut down; on the workers ``size()``
    counts the workers only.

    Args:
        comm: an mpi4py communicator, a list of world ranks that take part, or None for
            MPI.COMM_WORLD. hororing works on its own duplicate, so its messages never match
            the user's.
        mode: ``"ring"`` (default) or ``"ps"`` (HORORING_MODE).
        num_servers: PS servers k, or ``"colocated"``/0 (HORORING_PS_SERVERS).
        placement: ``"round_robin"``, ``"greedy_bytes"`` or ``"partitioned"``.
        replicas_to_aggregate: pushes a PS server aggregates per step (default: all workers).
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
        if num_servers == "colocated":
            num_servers = 0
        config = Config.from_environ(mode=mode, ps_servers=num_servers, ps_placement=placement,
                                     ps_replicas=replicas_to_aggregate, **config_overrides)
        logging.basicConfig(format="[%(levelname)s hororing] %(message)s")
        log.setLevel(config.log_level.upper())
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                f"hororing needs MPI_THREAD_MULTIPLE, but MPI was initialized with thread level "
                f"{provided}; do not set mpi4py.rc.thread_level to a lower level")
        user_comm = _resolve_comm(comm)
        if config.mode == "ps":
            _State.context = _ps_context(user_comm.Dup(), config)
        else:
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


def ps_stats():
    """Return this worker's view of PS mode: bytes each server holds and was pushed, or None.

    ``held_bytes[s]``: bytes of the tensors placed on server s; ``pushed_bytes[s]``: bytes this
    worker has pushed to it so far; ``contributors``: pushes aggregated per step. None in ring
    mode.
    """
    reducer = current().reducer
    if reducer is None:
        return None
    return {"servers": len(reducer.placement.held_bytes),
            "placement": reducer.placement.strategy,
            "held_bytes": list(reducer.placement.held_bytes),
            "pushed_bytes": list(reducer.pushed_bytes), "contributors": reducer.contributors}


def stop_timeline():
    """Stop and close the timeline started by ``start_timeline`` or HOROVOD_TIMELINE."""
    current().engine.set_timeline(None)


def _ps_context(base, config):
    """Split ``base`` into workers and servers; serve here (and exit) or return a worker context."""
    total = base.Get_size()
    servers = config.ps_servers
    if servers >= total:
        raise ValueError(
            f"PS mode with {servers} server(s) needs more than {servers} ranks, but the job has "
            f"{total}: no rank would be a worker. Run more ranks or set HORORING_PS_SERVERS "
            f"(num_servers) below {total}")
    workers = total - servers
    replicas = config.ps_replicas or workers
    if not 1 <= replicas <= workers:
        raise ValueError(f"replicas_to_aggregate must be in [1, {workers}] (the number of "
                         f"workers), got {config.ps_replicas}")
    if servers == 0:
        if replicas != workers:
            raise ValueError("replicas_to_aggregate needs dedicated servers (HORORING_PS_SERVERS"
                             " >= 1): with colocated shards every rank aggregates every step")
        ps_comm = base.Dup()
        reducer = ps.Colocated(ps_comm, ps.new_placement(config, total))
        return Context(base, config, reducer, ps_comm)
    rank = base.Get_rank()
    is_server = rank >= workers
    role_comm = base.Split(color=int(is_server), key=rank)
    ps_comm = base.Dup()
    if is_server:
        failure, stats = ps.serve(ps_comm, list(range(workers)), replicas, rank - workers)
        for comm in (role_comm, ps_comm, base):
            comm.Free()
        _serve_exit(failure, stats, workers)
    reducer = ps.ServerClient(ps_comm, range(workers, total), ps.new_placement(config, servers),
                              workers, config.ps_replicas)
    return Context(role_comm, config, reducer, ps_comm)


def _serve_exit(failure, stats, workers):
    """End a server process: status 0 after a clean shutdown, 1 after a worker failed."""
    steps = max(stats["steps"], 1)
    # one write, newline included, so servers' lines do not run together on a shared stdout
    line = (f"[hororing PS server {stats['server']}] {stats['steps']} steps from {workers} "
            f"workers; moved per step {stats['received_bytes'] // steps} B in, "
            f"{stats['sent_bytes'] // steps} B out; late pushes dropped: {stats['dropped']}")
    if stats.get("async"):
        line += (f"; asynchronous updates applied: {stats['async']['updates']}, staleness mean "
                 f"{stats['async']['mean_staleness']:.2f} max {stats['async']['max_staleness']}")
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if failure is not None:
        sys.stderr.write(f"[hororing PS server {stats['server']}] ending the job: {failure}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
    sys.exit(0)


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
