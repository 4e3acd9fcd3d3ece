"""Give every rank its own files: a plan every rank computes alone, checked with one collective.

The plan is a pure function of the set of files (path and size), the seed and the epoch, so
ranks agree on it without talking; ``shard_files`` then checks, with one small allgather, that
every rank really was given the same set, because a rank with a different list would compute
a different plan and two ranks could read one file (or none could).
"""

import glob
import hashlib
import os
import random

BALANCES = ("bytes", "count")


class Shard(list):
    """This rank's files (a list of paths), plus the record slice when records are split.

    ``record_slice`` is None when every listed file belongs to this rank alone. With
    ``split_records=True`` every rank lists every file and ``record_slice == (index, count)``:
    this rank takes records ``index, index + count, index + 2*count, ...`` of the concatenated
    files. The readers in hororing.data honour it.
    """

    def __init__(self, paths=(), record_slice=None):
        super().__init__(paths)
        self.record_slice = record_slice

    def __repr__(self):
        return f"Shard({list(self)!r}, record_slice={self.record_slice!r})"


def shard_files(files, rank=None, size=None, *, balance="bytes", shuffle=False, seed=0, epoch=0,
                split_records=False):
    """Return this rank's files: every file goes to exactly one rank, loads balanced.

    With ``rank`` and ``size`` left out they come from ``hvd.init()``, and the ranks also check
    with one small collective that they were all given the same files; then every rank must
    call it, in the same order as the other collectives.

    Args:
        files: a list of paths, or a glob pattern.
        rank, size: this rank and the number of ranks; both or neither.
        balance: ``"bytes"`` (the heaviest rank carries at most the lightest plus the largest
            file) or ``"count"`` (file counts differ by at most one).
        shuffle: draw a new, still balanced plan from ``seed`` and ``epoch``.
        seed, epoch: select the shuffled plan; every rank must pass the same values.
        split_records: when there are fewer files than ranks, give every rank every file and
            a record slice instead of raising.

    Returns:
        A :class:`Shard` (a list of paths, sorted) for this rank.

    Raises:
        ValueError: bad arguments, no files, fewer files than ranks, or ranks that were given
            different file lists (raised on every rank).
        FileNotFoundError, PermissionError: a file is missing or unreadable (named).

    Example:
        >>> mine = hvd.data.shard_files("data/train-*.rec", shuffle=True, epoch=epoch)
    """
    check_collective = rank is None and size is None
    rank, size = _resolve_rank_size(rank, size)
    try:
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
        paths = _expand(files)
        sizes = [_readable_size(path) for path in paths]
    except (OSError, TypeError, ValueError) as error:
        if not check_collective:
            raise
        # the other ranks are entering the agreement check: tell them instead of leaving them
        _check_same_files(None, None, seed, epoch, shuffle, error=error)
        raise
    if check_collective:
        _check_same_files(paths, sizes, seed, epoch, shuffle)
    if len(paths) < size:
        if split_records and paths:
            return Shard(paths, record_slice=(rank, size))
        raise ValueError(
            f"cannot shard {len(paths)} file(s) over {size} ranks: every rank needs at least "
            f"one file. Split the data into at least {size} files, run fewer ranks, or pass "
            f"split_records=True to share the files record by record")
    plan = plan_shards(dict(zip(paths, sizes)), size, balance=balance, shuffle=shuffle,
                       seed=seed, epoch=epoch)
    return Shard(plan[rank])


def plan_shards(file_sizes, size, *, balance="bytes", shuffle=False, seed=0, epoch=0):
    """Return every rank's files, ``plan[r]`` sorted, for ``file_sizes = {path: bytes}``.

    A pure function of its arguments (the mapping's order does not matter). Greedy list
    scheduling: each file, in turn, goes to the least-loaded rank. Whatever the order, the rank
    that ends heaviest was the lightest when it took its last file, so it carries at most the
    lightest plus the largest file; largest-first order keeps the spread small, and a shuffled
    order (from seed and epoch) gives a different plan with the same bound.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    order = sorted(file_sizes)
    rng = random.Random(f"hororing.shard:{seed}:{epoch}") if shuffle else None
    if rng is not None:
        rng.shuffle(order)
    elif balance == "bytes":
        order.sort(key=lambda path: -file_sizes[path])
    weight = (lambda path: file_sizes[path]) if balance == "bytes" else (lambda path: 1)
    rank_order = list(range(size))
    if rng is not None:
        rng.shuffle(rank_order)  # which rank breaks a tie also changes per epoch
    tie_rank = {rank: position for position, rank in enumerate(rank_order)}
    loads = [0] * size
    plan = [[] for _ in range(size)]
    for path in order:
        target = min(range(size), key=lambda rank: (loads[rank], tie_rank[rank]))
        loads[target] += weight(path)
        plan[target].append(path)
    return [sorted(files) for files in plan]


def _resolve_rank_size(rank, size):
    if (rank is None) != (size is None):
        raise ValueError("pass both rank and size, or neither (then hvd.init() provides them)")
    if rank is None:
        from ..context import current
        context = current()
        return context.rank, context.size
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"rank must be an int in [0, {size}), got {rank!r}")
    return rank, size


def _expand(files):
    if isinstance(files, (str, os.PathLike)):
        pattern = os.fspath(files)
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise ValueError(f"the pattern {pattern!r} matched no files")
    else:
        try:
            paths = [os.fspath(path) for path in files]
        except TypeError:
            raise TypeError(
                f"files must be a glob pattern or a list of paths, got {type(files).__name__}"
            ) from None
    paths = [os.path.normpath(path) for path in paths]
    seen = set()
    for path in paths:
        if path in seen:
            raise ValueError(f"file {path!r} is listed more than once; list every file once")
        seen.add(path)
    if not paths:
        raise ValueError("no files to shard: the file list is empty")
    return sorted(paths)


def _readable_size(path):
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"input file {path!r} does not exist") from None
    if not os.path.isfile(path):
        raise ValueError(f"input {path!r} is not a regular file")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"input file {path!r} is not readable by this process")
    return stat.st_size


def _check_same_files(paths, sizes, seed, epoch, shuffle, error=None):
    """Raise on every rank if any rank failed, or was given a different file set or plan."""
    from ..objects import allgather_object
    if error is None:
        digest = hashlib.sha256(repr((paths, sizes, seed, epoch, shuffle)).encode()).hexdigest()
        view = (digest, len(paths), seed, epoch, None)
    else:
        view = (None, None, seed, epoch, f"{type(error).__name__}: {error}")
    views = allgather_object(view, name="hororing.data.shard_files")
    for other_rank, other in enumerate(views):
        if other[4] is not None and error is None:
            raise ValueError(f"shard_files failed on rank {other_rank}: {other[4]}")
    if error is not None:
        return
    first = views[0]
    for other_rank, other in enumerate(views):
        if other[0] != first[0]:
            raise ValueError(
                f"shard_files: rank {other_rank} was given a different file list or plan "
                f"({other[1]} files, seed={other[2]}, epoch={other[3]}) than rank 0 ({first[1]} "
                f"files, seed={first[2]}, epoch={first[3]}); every rank must pass the same "
                f"files (same paths and sizes), seed and epoch")
