"""Process sets: collectives restricted to a subset of the ranks, as in Horovod.

A ``ProcessSet`` names ranks of the job (``hvd.rank()`` numbering). Every set this rank
belongs to gets its own communicator and its own engine, so collectives of disjoint sets
run independently of each other. Sets come from ``init(process_sets=[...])`` (static) or
from ``add_process_set`` after init when ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (dynamic).
Every rank of the job must add and remove the same sets in the same order.

The job's sets live in its context's ``Registry`` (``current().sets``): every set's ranks
by id, and this rank's ``Group`` for each set it belongs to.

Example:
    >>> even = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 0])
    >>> if hvd.rank() % 2 == 0:
    ...     hvd.allreduce(x, process_set=even)
"""

import itertools
import sys
import zlib

from . import faults
from ._mpi import MPI
from .engine import Engine
from .group import Group
from .running import current


def _is_comm(value):
    # an mpi4py communicator exists only once mpi4py.MPI is imported: asking must not
    # import it (that would initialize MPI at ``import hororing``)
    module = sys.modules.get("mpi4py.MPI")
    return module is not None and isinstance(value, module.Comm)


class ProcessSet:
    """A set of ranks that run collectives together.

    Args:
        ranks_or_comm: a sequence of ranks (``hvd.rank()`` numbering) or an mpi4py
            communicator whose processes form the set.

    ``process_set_id`` is set once the set is registered (by ``init`` or ``add_process_set``).
    """

    def __init__(self, ranks_or_comm):
        self.process_set_id = None
        self.ranks = None
        self.mpi_comm = None
        if _is_comm(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks or "
                             "an mpi4py Comm object") from None
        if any(isinstance(rank, bool) or not isinstance(rank, int) for rank in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or "
                             "an mpi4py Comm object")
        self.ranks = ranks

    def size(self):
        """Return the number of ranks in the set, or None if it is not registered."""
        if self.process_set_id is None:
            return None
        return len(current().sets.ranks(self.process_set_id))

    def rank(self):
        """Return this rank's index within the set (None if unregistered or not a member).

        Collectives still take ``root_rank`` in ``hvd.rank()`` numbering, not this one.
        """
        if self.process_set_id is None:
            return None
        ranks = current().sets.ranks(self.process_set_id)
        me = current().rank
        return ranks.index(me) if me in ranks else None

    def included(self):
        """Return whether this rank belongs to the set (None if its ranks are unknown)."""
        if self.ranks is None:
            return None
        return current().rank in self.ranks

    def _invalidate(self):
        self.process_set_id = None

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


def add_process_set(process_set):
    """Register a new process set after init; every rank must call it, in the same order.

    Needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (use ``init(process_sets=...)`` otherwise).

    Args:
        process_set: a ``ProcessSet`` built from ranks, or a sequence of ranks.

    Returns:
        the registered ``ProcessSet``.

    Raises:
        ValueError: dynamic sets are off, the ranks are invalid or already form a set, or the
            ranks passed differ between ranks of the job.
    """
    context = current()
    if not context.config.dynamic_process_sets:
        raise ValueError("add_process_set() needs dynamic process sets: set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init(), or pass the sets "
                         "to hvd.init(process_sets=[...])")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError("Dynamically adding process sets defined by an MPI communicator "
                                  "is not implemented. Please build the process set via a list of "
                                  "ranks.")
    process_set.process_set_id = context.sets.add(process_set.ranks)
    return process_set


def remove_process_set(process_set):
    """Remove a dynamically added set; every rank must call it. Return True if removed.

    The global set (id 0) and unregistered sets are not removed (False).
    """
    context = current()
    if not context.config.dynamic_process_sets:
        raise ValueError("remove_process_set() needs dynamic process sets: set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init()")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set takes a ProcessSet, got {type(process_set).__name__}")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    removed = context.sets.remove(set_id)
    process_set._invalidate()
    return removed


def group_of(process_set):
    """Return this rank's Group for ``process_set`` (None: the global set).

    Raises:
        ValueError: the set is not registered, or this rank is not one of its members.
    """
    context = current()
    if process_set is None or process_set is global_process_set:
        return context.group
    if type(process_set) is MembersSet:
        return process_set.group
    set_id = registered_id(process_set)
    group = context.sets.groups.get(set_id)
    if group is None:
        raise ValueError(f"rank {context.rank} is not a member of process set {set_id} (ranks "
                         f"{context.sets.ranks(set_id)}); only its members may call its "
                         f"collectives")
    return group


class MembersSet(ProcessSet):
    """A process set made by its members alone (``members_process_set``): the other ranks
    of the job take no part and do not know it. Its collectives are those of any set."""

    def __init__(self, ranks, group):
        super().__init__(ranks)
        self.group = group
        self.process_set_id = group.set_id

    def size(self):
        return self.group.size

    def rank(self):
        return self.group.rank


def members_process_set(ranks):
    """Make the process set of ``ranks``, called by those ranks alone, each with the same list
    (a subgroup in torch.distributed's sense: the other ranks never call). Its communicator
    comes from MPI_Comm_create_group over the job's; it lasts until ``hvd.shutdown()``.

    Raises:
        ValueError: the ranks are invalid, or this rank is not one of them.
    """
    return MembersSet(sorted(ranks), current().sets.add_members(ranks))


def registered_id(process_set):
    """Return the id of ``process_set`` (None: the global set, 0), a registered set this rank
    may or may not belong to.

    Raises:
        TypeError: not a ProcessSet. ValueError: the set is not registered.
    """
    if process_set is None or process_set is global_process_set:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}")
    set_id = process_set.process_set_id
    if set_id is None:
        raise ValueError(f"{process_set} is not registered: pass it to hvd.init(process_sets=...)"
                         f" or hvd.add_process_set() first")
    if set_id not in current().sets.ids():
        raise ValueError(f"process set {set_id} has been removed or was never added")
    return set_id


# the set of every rank (id 0); init() fills in its ranks
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def registered_sets():
    """Every registered process set's ranks, by id (the global set is 0)."""
    sets = current().sets
    return {set_id: list(sets.ranks(set_id)) for set_id in sets.ids()}


class Registry:
    """Every registered process set of the job, by id (the global set is 0), and this rank's
    Group for each set it belongs to (``groups``). Adding and removing are collectives over
    the job's communicator."""

    def __init__(self, comm, config, global_group):
        self._comm = comm
        self._config = config
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self.groups = {0: global_group}           # the sets this rank belongs to, by id
        self._ranks = {0: list(range(self._size))}  # every registered set's ranks, by id
        self._ids = itertools.count(1)
        self._ids_of_members = itertools.count(1)   # this rank's own count: not agreed

    def ranks(self, set_id):
        """The ranks of registered set ``set_id`` (KeyError if none)."""
        return self._ranks[set_id]

    def ids(self):
        return list(self._ranks)

    def add(self, ranks, existing_ok=False):
        """Register the set of ``ranks`` on every rank (a collective over the job); its id.

        Raises ValueError for bad or differing ranks, and for ranks that already form a set
        unless ``existing_ok`` (static sets given twice share one id, as in Horovod).
        """
        ranks = list(ranks)
        bad = [rank for rank in ranks if not 0 <= rank < self._size]
        if bad or not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"a process set needs distinct ranks in [0, {self._size}), got "
                             f"{ranks}")
        everyone = self._comm.allgather(ranks)
        if any(other != ranks for other in everyone):
            differing = [rank for rank, other in enumerate(everyone) if other != ranks]
            raise ValueError(f"add_process_set() was given different ranks on different ranks "
                             f"(here {ranks}; ranks {differing} passed otherwise); every rank "
                             f"must add the same set")
        for set_id, existing in self._ranks.items():
            if existing == ranks:
                if existing_ok:
                    return set_id
                raise ValueError(f"Attempted to add a duplicate process set: ranks {ranks} "
                                 f"already form process set {set_id}")
        set_id = next(self._ids)
        member = self._rank in ranks
        comm = faults.track(self._comm.Split(color=0 if member else MPI.UNDEFINED,
                                             key=self._rank))
        self._ranks[set_id] = ranks
        if member:
            self.groups[set_id] = Group(set_id, ranks, comm, Engine(comm, self._config, None))
        return set_id

    def add_members(self, ranks):
        """This rank's Group for the set of ``ranks``, made by its members alone (see
        ``members_process_set``); kept until ``close``."""
        ranks = sorted(ranks)
        if (not ranks or len(set(ranks)) != len(ranks)
                or any(not 0 <= rank < self._size for rank in ranks)):
            raise ValueError(f"a process set needs distinct ranks in [0, {self._size}), got "
                             f"{ranks}")
        if self._rank not in ranks:
            raise ValueError(f"rank {self._rank} is not in {ranks}: only a set's members make "
                             f"it this way")
        job = self._comm.Get_group()
        members = job.Incl(ranks)
        # the tag keeps apart sets being made at once by overlapping members
        comm = faults.track(self._comm.Create_group(
            members, tag=zlib.crc32(repr(ranks).encode()) % 32768))
        members.Free()
        job.Free()
        key = f"members.{next(self._ids_of_members)}"
        group = Group(key, ranks, comm, Engine(comm, self._config, None))
        self.groups[key] = group
        return group

    def remove(self, set_id):
        """Unregister set ``set_id`` on every rank: a collective over the job."""
        if set_id not in self._ranks:
            return False
        self._comm.Barrier()  # its members have finished its collectives
        del self._ranks[set_id]
        group = self.groups.pop(set_id, None)
        if group is not None:
            group.leave()
        return True

    def close(self, failure=None):
        """Leave every set but the global one (the context closes that)."""
        for set_id in [set_id for set_id in self.groups if set_id != 0]:
            self.groups.pop(set_id).leave(failure)
