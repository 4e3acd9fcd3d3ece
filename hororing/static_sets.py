"""Process sets given to ``init(process_sets=...)`` (static sets): the rules every rank's
list must follow, and their registration.

Lists that would make the registration's collectives part ways are refused on every rank
before anything is registered. A duplicate is each rank's own (a set given by a
communicator stands for different ranks on different processes): the sets are registered,
each once, and only the ranks whose own list repeats one raise, as Horovod does.
"""

import logging

from ._mpi import MPI
from .process_sets import ProcessSet

log = logging.getLogger("hororing")


def register(process_sets, context):
    """Agree on every rank's list, register the sets in ``context`` and give each its id;
    then raise on the ranks whose own list repeats a set. Collective over the job."""
    duplicates = _agree(process_sets, context.comm)
    _register(process_sets, context)
    _refuse_duplicates(duplicates, context.rank)


def check(process_sets):
    """Raise TypeError unless ``process_sets`` is None or a list of ProcessSet objects."""
    if process_sets is None:
        return
    if isinstance(process_sets, str) or not isinstance(process_sets, (list, tuple)):
        raise TypeError(f"init(process_sets=...) takes a list of hvd.ProcessSet, got "
                        f"{type(process_sets).__name__}")
    for process_set in process_sets:
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"init(process_sets=...) takes hvd.ProcessSet objects, got "
                            f"{type(process_set).__name__}")


def _agree(process_sets, comm):
    """Check every rank's ``init(process_sets=...)`` list with one allgather, before any set
    is registered; return the duplicates found, as ``{rank: problem}``.

    Lists that differ in length, or in which entry is given by ranks (and which ranks) or by
    a communicator, would make the registration's collectives part ways: ValueError on every
    rank. A duplicate (the same ranks in any order, or every rank: the global set) is each
    rank's own, since a set given by a communicator stands for different ranks on different
    processes; the sets are registered anyway and ``_refuse_duplicates`` raises on the ranks
    whose own list repeats one, as Horovod does.
    """
    verdicts = comm.allgather((_list_shape(process_sets), _duplicate_sets(process_sets, comm)))
    problems = {rank: problem for rank, (_, problem) in enumerate(verdicts) if problem}
    shapes = [shape for shape, _ in verdicts]
    if len(set(shapes)) == 1:
        return problems
    if len({len(shape) for shape in shapes}) > 1:
        given = {rank: len(shape) for rank, shape in enumerate(shapes)}
        reason = f"different numbers of process sets on different ranks ({given})"
    else:
        index = next(i for i in range(len(shapes[0])) if len({s[i] for s in shapes}) > 1)
        given = {rank: _describe_entry(shape[index]) for rank, shape in enumerate(shapes)}
        reason = f"different process_sets[{index}] on different ranks ({given})"
    also = ("; duplicates too: " + _name_duplicates(problems)) if problems else ""
    raise ValueError(f"init(process_sets=...) was given {reason}{also}; every rank must pass "
                     f"the same list (a set by ranks with the same ranks, or a communicator, "
                     f"at the same place)")


def _list_shape(process_sets):
    """What must be the same on every rank: per entry, the global set, a communicator, or
    the sorted ranks of a set given by ranks."""
    shape = []
    for process_set in process_sets or ():
        if process_set.process_set_id == 0:
            shape.append(("global",))
        elif process_set.ranks is not None:
            shape.append(("ranks",) + tuple(sorted(process_set.ranks)))
        else:
            shape.append(("communicator",))
    return tuple(shape)


def _describe_entry(entry):
    kind = entry[0]
    return f"ranks {list(entry[1:])}" if kind == "ranks" else _ENTRY_NAMES[kind]


_ENTRY_NAMES = {"communicator": "a communicator", "global": "the global set"}


def _name_duplicates(problems):
    return "; ".join(f"rank {rank}: {problem}" for rank, problem in sorted(problems.items()))


def _refuse_duplicates(problems, rank):
    """After registration: ValueError on the ranks whose own list repeats a set, a warning
    naming them on the others (whose lists were sound, so their ``init`` succeeds)."""
    if not problems:
        return
    text = (f"init(process_sets=...) got duplicate process sets ({_name_duplicates(problems)}); "
            f"give each set of ranks once (the global set, of every rank, is always there). "
            f"The job is initialized, with each set registered once")
    if rank in problems:
        raise ValueError(text)
    log.warning("%s; this rank's own list has no duplicate, so its init() succeeded, while "
                "ranks %s raised ValueError", text, sorted(problems))


def _duplicate_sets(process_sets, comm):
    """This rank's description of a set given twice (None: no duplicates). A set given by a
    communicator stands for that communicator's ranks."""
    seen = {tuple(range(comm.Get_size())): "the global set"}
    for index, process_set in enumerate(process_sets or ()):
        if process_set.process_set_id == 0:
            continue
        if process_set.ranks is not None:
            ranks = tuple(sorted(process_set.ranks))
        elif process_set.mpi_comm == MPI.COMM_NULL:
            continue
        else:
            group = process_set.mpi_comm.Get_group()
            translated = MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                   comm.Get_group())
            ranks = tuple(sorted(translated))
        if ranks in seen:
            return f"process_sets[{index}] with ranks {list(ranks)} repeats {seen[ranks]}"
        seen[ranks] = f"process_sets[{index}]"
    return None


def _register(process_sets, context):
    """Register the ProcessSets given to init() and give each its id (and ranks).

    A set given by ranks must be given the same on every rank. A set given by a
    communicator stands, on each process, for that process's own communicator: the sets of
    all of them are registered (e.g. every colour of a Split), in order of their lowest rank.
    """
    for process_set in process_sets or ():
        if process_set.process_set_id == 0:
            continue  # the global set is always there
        if process_set.ranks is not None:
            process_set.process_set_id = context.sets.add(process_set.ranks, existing_ok=True)
            continue
        comm = process_set.mpi_comm
        mine = comm.allgather(context.rank) if comm != MPI.COMM_NULL else None
        mine = sorted(mine) if mine is not None else None
        for ranks in sorted({tuple(ranks) for ranks in context.comm.allgather(mine) if ranks}):
            set_id = context.sets.add(ranks, existing_ok=True)
            if mine is not None and list(ranks) == mine:
                process_set.process_set_id, process_set.ranks = set_id, mine
