"""The state of an initialized job (communicators, topology, engine) and init/shutdown.

One default context exists per process, created by ``init()`` and held by ``running``;
nothing else in the library keeps mutable module-level state.
"""

import atexit
import logging
import sys
import time

from ._mpi import MPI

from . import faults, gpu, slurm, static_sets, transport, world
from .algorithms import compiled
from .config import Config
from .environment import launch_environment
from .errors import NotInitializedError
from .liveness import LocalPeers, identity
from .engine import Engine
from .group import Group, stop_engine
from .process_sets import Registry, global_process_set
from .running import _State, current, is_initialized  # the last two: hororing.context's API
from .timeline import Timeline

log = logging.getLogger("hororing")


class Context:
    """Topology and engine of one initialized job."""

    def __init__(self, comm, config, reducer=None, origin=None):
        self.config = config
        # the communicator the job was made from (init's ``comm``): the survivors shrink it
        self.origin = origin
        self.reducer = reducer  # PS mode: the allreduce through parameter servers (ps/)
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        faults.track(comm)
        self.local_comm = faults.track(comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank))
        self.local_rank = self.local_comm.Get_rank()
        self.local_size = self.local_comm.Get_size()
        self.cross_comm = faults.track(comm.Split(color=self.local_rank, key=self.rank))
        self.cross_rank = self.cross_comm.Get_rank()
        self.cross_size = self.cross_comm.Get_size()
        # every node runs as many ranks as every other (Horovod's is_homogeneous), and each
        # rank's host, to name it in stall warnings
        # (and each rank's process, for the watchdog to see whether this host's are running)
        layout = comm.allgather((self.local_size, MPI.Get_processor_name(), identity()))
        self.homogeneous = len({local_size for local_size, _, _ in layout}) == 1
        self.hosts = [host for _, host, _ in layout]
        # one GPU per rank, where a GPU library is in use and the user has not chosen one
        self.device = gpu.select_device(self.local_rank, config.select_device)
        timeline = None
        if config.timeline_path and self.rank == 0:
            timeline = Timeline(config.timeline_path, config.timeline_mark_cycles)
        transport.set_world(comm)
        # an MPI with ULFM reports a dead peer itself (faults.py): the elastic layer goes on
        peers = None if faults.supported() else \
            LocalPeers(self.rank, self.hosts, [process for _, _, process in layout])
        self.watchdog = None
        stalls = config.stall_check_enabled and config.stall_check_seconds > 0
        if stalls or (peers is not None and peers.watched):
            self.watchdog = transport.StallWatchdog(
                self.rank, self.hosts, config.stall_check_seconds if stalls else 0,
                config.stall_shutdown_seconds if stalls else 0, peers=peers)
        self.engine = Engine(comm, config, timeline, reducer)
        # the cores this node's ranks may run on (hororing.cores), found where the engine
        # prices its contention
        self.node_cores = self.engine.executor.node_cores
        if config.autotune:
            from .tuning import autotune

            autotune.attach(self.engine, comm, config)
        self.group = Group(0, range(self.size), comm, self.engine)
        self.sets = Registry(comm, config, self.group)  # every process set, by id

    def close(self, failure=None, lost=False):
        """Leave the job: tell the peers (shutdown, or ``failure``, a message) and free MPI state.

        After a peer died (ULFM; ``lost``, or this engine saw it) every communicator is revoked:
        nothing is told or freed."""
        lost = lost or self.engine.peers_lost
        if lost:
            faults.revoke_all()  # a process set's engine may not have seen it yet
        self.sets.close(failure)
        stop_engine(self.engine, failure)
        if self.reducer is not None:
            self.reducer.close(failure)  # dedicated servers exit when every worker is done
        self.engine.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        if not lost:
            for comm in (self.local_comm, self.cross_comm, self.comm):
                comm.Free()
        faults.forget_all()


def init(comm=None, process_sets=None, *, mode=None, num_servers=None, placement=None,
         replicas_to_aggregate=None, **config_overrides):
    """Initialize hororing: every rank of ``comm`` must call it.

    In PS mode with k dedicated servers, the last k ranks run the server loop inside this call
    and exit the process (status 0) once every worker has shut down; on the workers ``size()``
    counts the workers only.

    Args:
        comm: an mpi4py communicator, a list of world ranks that take part, or None for
            MPI.COMM_WORLD. hororing works on its own duplicate, so its messages never match
            the user's.
        process_sets: ``ProcessSet`` objects to register now (static process sets); every
            rank must pass the same list (ValueError on every rank otherwise, the job then
            initialized without them). A set given twice in a rank's own list raises
            ValueError on that rank after the sets are registered, each once, as in Horovod;
            ``init(process_sets=...)`` may be called again.
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
        if _State.context is not None:  # again: only process sets not registered yet are new
            if process_sets:
                static_sets.check(process_sets)
                static_sets.register(process_sets, _State.context)
            return
        if num_servers == "colocated":
            num_servers = 0
        static_sets.check(process_sets)
        config = Config.from_environ(mode=mode, ps_servers=num_servers, ps_placement=placement,
                                     ps_replicas=replicas_to_aggregate, **config_overrides)
        _configure_logging(config.log_level)
        transport.set_backoff(config.wait_spin_tests, config.wait_yield_tests,
                              config.wait_max_sleep_us / 1e6)
        compiled.configure(config.compiled_steps, config.compiled_steps_after)
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                f"hororing needs MPI_THREAD_MULTIPLE, but MPI was initialized with thread level "
                f"{provided}; do not set mpi4py.rc.thread_level to a lower level")
        user_comm = _resolve_comm(comm)
        world.check_world(MPI.COMM_WORLD.Get_size(), launch_environment())
        if config.start_timeout_s > 0:
            _wait_for_every_rank(user_comm, config.start_timeout_s)
        if config.mode == "ps":
            from .algorithms.ps import roles  # server ranks serve in here and exit

            comm, reducer = roles.start(user_comm.Dup(), config)
            _State.context = Context(comm, config, reducer)
        else:
            _State.context = Context(user_comm.Dup(), config, origin=user_comm)
        # where this node runs more ranks than it has cores, the waits barely spin, and they
        # wake the peers only before they sleep
        local_size, node_cores = _State.context.local_size, _State.context.node_cores
        transport.set_backoff(config.spin_tests(local_size, node_cores),
                              config.wait_yield_tests, config.wait_max_sleep_us / 1e6,
                              wake_late=local_size > node_cores)
        slurm.set_framework_threads(_State.context.local_size)
        slurm.set_blas_threads(_State.context.local_size)
        global_process_set.ranks = list(range(_State.context.size))
        global_process_set.mpi_comm = user_comm
        if not _State.hooks_installed:
            _install_exit_hooks()
            _State.hooks_installed = True
        # the job is up even if the sets are refused: init(process_sets=...) may be called again
        static_sets.register(process_sets, _State.context)


def continue_with_survivors():
    """After a peer process died (ULFM): leave the job without a word to anyone, shrink the
    communicator it was made from to the processes alive, and make the job anew over them
    (collective over the survivors). Process sets other than the global one are not carried
    over. Returns (the old size, the new size).

    Raises:
        RuntimeError: the job cannot go on in this process (PS mode, or the MPI has no ULFM).
    """
    with _State.lock:
        old = _State.context
        if old is None:
            raise NotInitializedError()
        if old.origin is None or not faults.supported():
            raise RuntimeError("hororing cannot go on in process after a rank failed: "
                               + ("PS mode's servers are not recovered" if old.origin is None
                                  else "this MPI has no ULFM extension"))
        _State.context = None
    old.close(lost=True)
    survivors = old.origin.Shrink()
    context = Context(survivors.Dup(), old.config, origin=survivors)
    with _State.lock:
        _State.context = context
    global_process_set.ranks = list(range(context.size))
    global_process_set.mpi_comm = survivors
    return old.size, context.size


def shutdown():
    """Stop hororing on this rank; pending collectives fail. Safe to call twice."""
    with _State.lock:
        context, _State.context = _State.context, None
    if context is not None:
        context.close()


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


def is_homogeneous():
    """Return True if every host runs the same number of ranks."""
    return current().homogeneous


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
    return None if reducer is None else reducer.stats()


def stop_timeline():
    """Stop and close the timeline started by ``start_timeline`` or HOROVOD_TIMELINE."""
    current().engine.set_timeline(None)


def _configure_logging(level):
    """Give the ``hororing`` logger its level, and a handler where the application set none.

    Only hororing's logger is touched, never the root logger: an application that configured
    logging gets hororing's records through its own handlers.
    """
    log.setLevel(level.upper())
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(levelname)s hororing] %(message)s"))
    log.addHandler(handler)


def _wait_for_every_rank(comm, timeout_s):
    """End the job if some rank has not reached init() within ``timeout_s`` seconds."""
    if not transport.wait(comm.Ibarrier(), deadline=time.monotonic() + timeout_s):
        transport.end_job(f"[hororing rank {comm.Get_rank()}] not every rank reached hvd.init() "
                          f"within {timeout_s:g} s (HOROVOD_START_TIMEOUT / hororun "
                          f"--start-timeout); ending the job")


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
