"""Equal step counts: every rank runs the same number of batches per epoch.

Shards rarely hold equal numbers of samples. A rank that runs one batch more than the others
calls one allreduce the others never make, and the job stalls. Two ways out:

- agree up front (this module): one small allgather of the sample counts, then every rank runs
  ``steps`` batches, either the minimum over ranks (the extra batches are skipped this epoch)
  or the maximum (short ranks repeat some of their batches);
- ``hvd.join()``: ranks run their own count and a rank that runs out calls ``join()``; the
  others' collectives then see zeros from it (an Average still divides by the full size), and
  ``join()`` returns once every rank has joined. It needs no counts up front, but the last
  batches are averaged with zeros; agreeing on counts keeps every step a full average.
"""

import math
import os
from typing import NamedTuple

import numpy as np

from .records import (FRAME, MAGIC, TRAILER, TRAILER_COUNT, RecordFormatError, check_header,
                      npy_layout)
from .streams import resolve_format

POLICIES = ("min", "pad")


class StepPlan(NamedTuple):
    """The batches every rank runs this epoch (``steps``) and what this rank's data gives."""

    steps: int
    local_steps: int
    samples: tuple  # samples per rank, in rank order

    def take(self, batches):
        """Yield exactly ``steps`` batches from ``batches``.

        Stops early when this rank has more, and when it has fewer, repeats its first batches
        (holding only as many as it will repeat).
        """
        deficit = max(self.steps - self.local_steps, 0)
        kept = []
        produced = 0
        for batch in batches:
            if produced == self.steps:
                return
            if len(kept) < deficit:
                kept.append(batch)
            produced += 1
            yield batch
        if produced < self.steps and not kept:
            raise ValueError(
                f"this rank's data gave no batch, so it cannot pad to {self.steps} steps; give "
                f"every rank at least one sample")
        index = 0
        while produced < self.steps:
            yield kept[index % len(kept)]
            index += 1
            produced += 1


def equal_steps(local_samples, batch_size, *, policy="min", drop_last=False):
    """Return the StepPlan every rank agrees on. Every rank must call it, in the same order.

    Args:
        local_samples: how many samples this rank will read this epoch (see count_samples).
        batch_size: samples per batch on every rank.
        policy: ``"min"`` (run the fewest batches any rank has) or ``"pad"`` (run the most;
            short ranks repeat batches).
        drop_last: count only full batches.

    Example:
        >>> plan = hvd.data.equal_steps(hvd.data.count_samples(mine), batch_size=32)
        >>> for batch in plan.take(batches(hvd.data.read_shard(mine), 32)):
        ...     train_step(batch)
    """
    from ..collectives import allgather
    from ..context import current
    context = current()
    try:
        _check_arguments(local_samples, batch_size, policy)
        view = [int(local_samples), batch_size, POLICIES.index(policy), int(bool(drop_last))]
        problem = None
    except ValueError as error:
        view, problem = [-1, 0, 0, 0], error
    # one allgather carries the counts and the arguments, so a bad or differing argument on
    # one rank is reported on every rank instead of leaving the others waiting
    views = allgather(np.array([view], dtype=np.int64),
                      name=context.group.auto_name("hororing.data.equal_steps")).tolist()
    if problem is not None:
        raise problem
    for other_rank, other in enumerate(views):
        if other[0] < 0:
            raise ValueError(f"equal_steps failed on rank {other_rank} (bad arguments there)")
        if other[1:] != views[0][1:]:
            raise ValueError(
                f"equal_steps: rank {other_rank} passed batch_size={other[1]}, "
                f"policy={POLICIES[other[2]]!r}, drop_last={bool(other[3])} but rank 0 passed "
                f"batch_size={views[0][1]}, policy={POLICIES[views[0][2]]!r}, "
                f"drop_last={bool(views[0][3])}; every rank must pass the same values")
    return plan_steps([other[0] for other in views], context.rank, batch_size, policy=policy,
                      drop_last=drop_last)


def plan_steps(samples, rank, batch_size, *, policy="min", drop_last=False):
    """Return the StepPlan for per-rank sample counts ``samples`` (a pure function)."""
    _check_arguments(samples[rank], batch_size, policy)
    rounding = math.floor if drop_last else math.ceil
    batches = [rounding(count / batch_size) for count in samples]
    steps = min(batches) if policy == "min" else max(batches)
    return StepPlan(steps, batches[rank], tuple(int(count) for count in samples))


def count_samples(files, *, format=None):
    """Return how many samples ``files`` hold, reading only headers (honours a record slice)."""
    paths = [os.fspath(path) for path in files]
    format = resolve_format(paths, format)
    if format == "npy":
        total = sum(npy_layout(path)[2] for path in paths)
    else:
        total = sum(_count_records(path) for path in paths)
    record_slice = getattr(files, "record_slice", None)
    if record_slice is not None:
        index, count = record_slice
        total = len(range(index, total, count))
    return total


def _count_records(path):
    """The number of records in a record file, walking its frame headers (no payload read)
    and checking the count against the file's trailer."""
    size = os.path.getsize(path)
    count = 0
    with open(path, "rb") as file:
        check_header(file.read(len(MAGIC)), path)
        position = len(MAGIC)
        while position < size:
            header = file.read(FRAME.size)
            if len(header) < FRAME.size:
                raise RecordFormatError(f"{path!r} ends inside a record header (truncated file)")
            length = FRAME.unpack(header)[0]
            if length == TRAILER:
                promised = file.read(TRAILER_COUNT.size)
                if (len(promised) != TRAILER_COUNT.size or TRAILER_COUNT.unpack(promised)[0] != count
                        or position + FRAME.size + TRAILER_COUNT.size != size):
                    raise RecordFormatError(f"{path!r}: its trailer does not match its {count} "
                                            f"records (corrupt file)")
                return count
            position += FRAME.size + length
            if position > size:
                raise RecordFormatError(f"{path!r} ends inside a record (truncated file)")
            file.seek(position)
            count += 1
    raise RecordFormatError(f"{path!r} ends without its trailer after a whole record: the file "
                            f"was cut short (truncated between two records)")


def _check_arguments(local_samples, batch_size, policy):
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if int(local_samples) != local_samples or local_samples < 0:
        raise ValueError(f"local_samples must be an int >= 0, got {local_samples!r}")
