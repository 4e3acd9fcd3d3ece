"""Sample streams over a rank's files: the direct reader, the shuffle buffer, record slices."""

import itertools
import os
import random

import numpy as np

from .records import RecordFormatError, npy_layout, read_npy, read_records

FORMATS = ("records", "npy")


def read_shard(files, *, format=None, shuffle_buffer=0, seed=0):
    """Yield the samples of this rank's files, in file order, reading each file as a stream.

    Args:
        files: this rank's files, usually from :func:`shard_files` (a Shard's record slice is
            honoured).
        format: ``"records"`` (yields bytes) or ``"npy"`` (yields rows); by default from the
            file extension (``.npy`` is npy, anything else records).
        shuffle_buffer: when > 0, shuffle through a buffer of this many samples.
        seed: the shuffle buffer's seed.

    Example:
        >>> for payload in hvd.data.read_shard(hvd.data.shard_files("data/*.rec")):
        ...     train_on(decode(payload))
    """
    paths = [os.fspath(path) for path in files]
    format = resolve_format(paths, format)
    if format == "npy":
        check_npy_rows(paths)
        samples = itertools.chain.from_iterable(read_npy(path) for path in paths)
    else:
        samples = itertools.chain.from_iterable(read_records(path) for path in paths)
    samples = take_record_slice(samples, getattr(files, "record_slice", None))
    if shuffle_buffer:
        samples = shuffled(samples, shuffle_buffer, seed)
    return samples


def shuffled(samples, buffer_size, seed=0):
    """Yield ``samples`` in a shuffled order, holding at most ``buffer_size`` of them.

    Each arriving sample replaces a randomly chosen one of the buffer, which is yielded; at the
    end the rest of the buffer is yielded in random order. Deterministic for a given seed.
    """
    if not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"shuffle buffer size must be an int >= 1, got {buffer_size!r}")
    rng = random.Random(seed)
    buffer = []
    for sample in samples:
        if len(buffer) < buffer_size:
            buffer.append(sample)
            continue
        index = rng.randrange(buffer_size)
        yield buffer[index]
        buffer[index] = sample
    rng.shuffle(buffer)
    yield from buffer


def take_record_slice(samples, record_slice):
    """Return ``samples`` itself, or every count-th sample from index when a slice is given."""
    if record_slice is None:
        return samples
    index, count = record_slice
    return itertools.islice(samples, index, None, count)


def resolve_format(paths, format):
    if format is None:
        kinds = {"npy" if path.endswith(".npy") else "records" for path in paths}
        if len(kinds) > 1:
            raise ValueError("the files mix .npy and record files; pass format= and keep one "
                             "format per shard")
        return kinds.pop() if kinds else "records"
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    return format


def check_npy_rows(paths):
    """Return ``(dtype, row_shape)`` shared by every .npy file, or raise naming the odd one."""
    layout = None
    for path in paths:
        dtype, row_shape, _, _ = npy_layout(path)
        if layout is None:
            layout = (dtype, row_shape, path)
        elif (dtype, row_shape) != layout[:2]:
            raise RecordFormatError(
                f"{path!r} holds rows of {dtype} {row_shape} but {layout[2]!r} holds "
                f"{layout[0]} {layout[1]}; every .npy file of a shard needs the same row type")
    if layout is None:
        return np.dtype(np.uint8), ()
    return layout[0], layout[1]
