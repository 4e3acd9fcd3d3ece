"""The collective verbs on torch tensors, Horovod's ``horovod.torch.mpi_ops``: the blocking
verbs, differentiable as Horovod defines them (``autograd.py``), and the asynchronous ones
(``async_ops.py``), which this module also names.

Every verb takes ``process_set`` (``hvd.global_process_set`` by default); ``root_rank`` is in
``hvd.rank()`` numbering.
"""

import numpy as np
import torch

from .. import collectives as core
from .. import door, ops
from ..process_sets import global_process_set
from ..validate import ALLREDUCE_OPS, resolve_op
from . import joined
from .async_ops import (allgather_async, allreduce_async, allreduce_async_, alltoall_async,
                        broadcast_async, broadcast_async_, broadcast_now,
                        compressed_allreduce_async_, grouped_allgather_async,
                        grouped_allreduce_async, grouped_allreduce_async_,
                        grouped_reducescatter_async, reducescatter_async, sparse_allreduce_async,
                        start_allreduce)
from .autograd import (_Allgather, _Allreduce, _Alltoall, _Broadcast, _GroupedAllgather,
                       _GroupedAllreduce, _GroupedReducescatter, _Reducescatter)
from .bridge import as_numpy, check_tensor, check_tensors, plain_view, synchronize, to_torch
from .compression import Compression

__all__ = [  # the blocking verbs here, the asynchronous ones of async_ops, as Horovod's module
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "compressed_allreduce_async_", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "join", "reducescatter", "reducescatter_async",
    "sparse_allreduce_async", "synchronize"]


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over all ranks (differentiable). Every rank must call it, in order.

    Example:
        >>> hvd.allreduce(torch.ones(3), op=hvd.Sum)
    """
    if op is None and average is None:
        op = ops.Average  # Horovod's default, as ``resolve_op`` gives it
    plain_op = type(op) is int and average is None and op in ALLREDUCE_OPS
    if plain_op and compression is Compression.none:
        # a plain CPU tensor needing no gradient, the common call: ``as_numpy``'s and
        # ``to_torch``'s work written out, without their calls
        array, checked = plain_view(tensor, name, process_set)
        if array is not None:
            result = door.allreduce_now(array, name, process_set, False, op, prescale_factor,
                                        postscale_factor, None, checked)
            if type(result) is np.ndarray and result.dtype is array.dtype \
                    and result.flags.c_contiguous:
                return torch.from_numpy(result)
            return to_torch(result, tensor)
    if not isinstance(tensor, torch.Tensor):  # a tensor passes without the call
        check_tensor(tensor)
    compression = compression or Compression.none
    if not plain_op:
        op = resolve_op(op, average, allowed=ALLREDUCE_OPS)
    if compression is Compression.none and not (tensor.requires_grad and
                                                torch.is_grad_enabled()):
        # no gradient to carry: straight to the door, as the Function's forward would go
        # (the name checked before the conversion, which may release the GIL)
        door.check_free(name, process_set)
        return to_torch(door.allreduce_now(as_numpy(tensor), name, process_set, False, op,
                                           prescale_factor, postscale_factor, None, True),
                        tensor)
    payload, ctx = compression.compress(tensor)
    result = _Allreduce.apply(payload, name, op, prescale_factor, postscale_factor, compression,
                              process_set)
    return compression.decompress(result, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """In-place allreduce (not differentiable)."""
    if op is None and average is None:
        op = ops.Average
    if type(op) is int and average is None and op in ALLREDUCE_OPS:
        # a plain CPU tensor: ``start_allreduce``'s work written out, as ``allreduce``'s
        array, checked = plain_view(tensor, name, process_set)
        if array is not None:
            door.allreduce_now(array, name, process_set, True, op, prescale_factor,
                               postscale_factor, None, checked)
            return tensor
    return synchronize(start_allreduce(tensor, average, name, op, prescale_factor,
                                       postscale_factor, process_set, inplace=True,
                                       blocking=True))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Allreduce a list of tensors together (differentiable); return the list of results."""
    check_tensors(tensors, "grouped_allreduce")
    compression = compression or Compression.none
    op = resolve_op(op, average, allowed=ALLREDUCE_OPS)
    payloads, ctxs = zip(*(compression.compress(tensor) for tensor in tensors)) if tensors else ((), ())
    results = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, compression,
                                      process_set, *payloads)
    return [compression.decompress(result, ctx) for result, ctx in zip(results, ctxs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """In-place grouped allreduce."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's tensor along dim 0 (differentiable). Every rank must call it."""
    check_tensor(tensor, min_ndim=1)
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather a list of tensors together (differentiable); return the list."""
    check_tensors(tensors, "grouped_allgather", min_ndim=1)
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return root_rank's tensor on every rank (differentiable). Every rank must call it."""
    check_tensor(tensor)
    if not (tensor.requires_grad and torch.is_grad_enabled()):  # no gradient to carry
        return broadcast_now(tensor, root_rank, name, process_set, inplace=False)
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast (not differentiable)."""
    return broadcast_now(tensor, root_rank, name, process_set, inplace=True)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[i]`` rows to rank i (differentiable). Every rank must call it.

    Returns:
        the received rows; with ``splits`` given, also the rows received from each rank
        (an int32 tensor), as ``(rows, received_splits)``.
    """
    check_tensor(tensor, min_ndim=1)
    return _Alltoall.apply(tensor, splits, name, process_set)


def reducescatter(tensor, name=None, compression=Compression.none, op=ops.Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over all ranks and return this rank's block of rows (differentiable).

    The first ``dim0 % size`` ranks get one row more. Every rank must call it.
    """
    check_tensor(tensor, min_ndim=1)
    compression = compression or Compression.none
    payload, ctx = compression.compress(tensor)
    result = _Reducescatter.apply(payload, name, op, process_set, prescale_factor,
                                  postscale_factor)
    return compression.decompress(result, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=ops.Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reducescatter a list of tensors together (differentiable); return the list."""
    check_tensors(tensors, "grouped_reducescatter", min_ndim=1)
    compression = compression or Compression.none
    payloads, ctxs = zip(*(compression.compress(tensor) for tensor in tensors)) if tensors else ((), ())
    results = _GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                          postscale_factor, *payloads)
    return [compression.decompress(result, ctx) for result, ctx in zip(results, ctxs)]


def join(device=-1):
    """Declare this rank out of data; return the rank that joined last (see hororing.join).
    Every DistributedOptimizer then holds the last rank's parameters on every rank
    (joined.py), as after DDP's Join."""
    last = core.join(device)
    joined.after_join(last)
    return last


def barrier(process_set=global_process_set):
    """Return once every rank of ``process_set`` has called barrier()."""
    return core.barrier(process_set)
