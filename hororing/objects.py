"""Collectives over picklable Python objects, built on the array collectives."""

import pickle

import numpy as np

from .collectives import allgather, broadcast
from .context import current
from .validate import check_root


def broadcast_object(obj, root_rank=0, name=None):
    """Return root_rank's ``obj`` (pickled) on every rank. Every rank must call it."""
    context = current()
    check_root(root_rank, context.size)
    base = name or context.auto_name("broadcast_object")
    payload = _to_bytes(obj) if context.rank == root_rank else np.zeros(0, dtype=np.uint8)
    length = broadcast(np.array([payload.size], dtype=np.int64), root_rank, name=base + ".size")
    if context.rank != root_rank:
        payload = np.zeros(int(length[0]), dtype=np.uint8)
    payload = broadcast(payload, root_rank, name=base + ".data")
    return pickle.loads(payload.tobytes())


def allgather_object(obj, name=None):
    """Return the list of every rank's ``obj``, in rank order. Every rank must call it."""
    context = current()
    base = name or context.auto_name("allgather_object")
    payload = _to_bytes(obj)
    lengths = allgather(np.array([payload.size], dtype=np.int64), name=base + ".size")
    data = allgather(payload, name=base + ".data").tobytes()
    objects = []
    offset = 0
    for length in lengths.tolist():
        objects.append(pickle.loads(data[offset:offset + length]))
        offset += length
    return objects


def _to_bytes(obj):
    return np.frombuffer(pickle.dumps(obj), dtype=np.uint8).copy()
