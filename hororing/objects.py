"""Collectives over picklable Python objects, built on the array collectives."""

import pickle

import numpy as np

from .collectives import allgather, broadcast
from .context import current
from .process_sets import group_of
from .validate import check_root


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Return root_rank's ``obj`` (pickled) on every rank. Every rank must call it.

    ``root_rank`` is in ``hvd.rank()`` numbering, also with a ``process_set``.
    """
    context = current()
    group = group_of(process_set)
    check_root(root_rank, context.size)
    base = name or group.auto_name("broadcast_object")
    is_root = context.rank == root_rank
    payload = _to_bytes(obj) if is_root else np.zeros(0, dtype=np.uint8)
    length = broadcast(np.array([payload.size], dtype=np.int64), root_rank, name=base + ".size",
                       process_set=process_set)
    if not is_root:
        payload = np.zeros(int(length[0]), dtype=np.uint8)
    payload = broadcast(payload, root_rank, name=base + ".data", process_set=process_set)
    return pickle.loads(payload.tobytes())


def allgather_object(obj, name=None, process_set=None):
    """Return the list of every rank's ``obj``, in rank order. Every rank must call it."""
    base = name or group_of(process_set).auto_name("allgather_object")
    payload = _to_bytes(obj)
    lengths = allgather(np.array([payload.size], dtype=np.int64), name=base + ".size",
                        process_set=process_set)
    data = allgather(payload, name=base + ".data", process_set=process_set).tobytes()
    objects = []
    offset = 0
    for length in lengths.tolist():
        objects.append(pickle.loads(data[offset:offset + length]))
        offset += length
    return objects


def _to_bytes(obj):
    return np.frombuffer(pickle.dumps(obj), dtype=np.uint8).copy()
