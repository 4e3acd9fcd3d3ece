"""The collective verbs that start on torch tensors and return a handle at once
(``hvd.synchronize(handle)`` waits for the result), Horovod's ``*_async`` verbs.

How tensors reach the engine and come back is ``bridge.py``. Every verb takes ``process_set``
(``hvd.global_process_set`` by default); ``root_rank`` is in ``hvd.rank()`` numbering. The
blocking, differentiable verbs over them are ``mpi_ops.py``.
"""

import weakref

import torch

from .. import collectives as core
from .. import door, ops
from ..compression import wire_of
from ..process_sets import global_process_set, group_of
from ..validate import ALLREDUCE_OPS, resolve_op
from .bridge import (TorchHandle, as_numpy, check_tensor, check_tensors, group_finish, in_place,
                     synchronize, to_torch)

# ---- allreduce --------------------------------------------------------------------------

def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Start an allreduce of ``tensor``; ``synchronize`` returns a new tensor."""
    return start_allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                           process_set, inplace=False)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Start an in-place allreduce; ``synchronize`` returns ``tensor`` holding the result."""
    return start_allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                           process_set, inplace=True)


def start_allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                    inplace, blocking=False):
    """Submit an allreduce; ``blocking``: the caller synchronizes it at once, before it
    starts anything else, and drives the engine itself (``door.start``'s ``now``)."""
    door.check_free(name, process_set)  # before the conversion (door.check_free)
    return _started(tensor, inplace, lambda array: door.start(
        "allreduce", array, name, process_set, inplace=inplace, now=blocking,
        name_checked=True, average=average, op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor))


def _started(tensor, inplace, submit):
    """The handle of ``submit(array)`` on ``tensor``'s data: its result lands in ``tensor``
    (``inplace``) or in a new tensor like it."""
    if inplace:
        return in_place(tensor, submit)
    return TorchHandle(submit(as_numpy(tensor)), lambda result: to_torch(result, tensor))


def compressed_allreduce_async_(tensor, compression, name=None, op=None, prescale_factor=1.0,
                                postscale_factor=1.0, process_set=global_process_set):
    """``allreduce_async_`` of a payload made by ``compression.compress``: a payload in the
    compressor's wire dtype travels in it (``Compression.fp16``: float16 moves as float16,
    on CUDA tensors too; a CUDA bfloat16 payload moves as bfloat16 where device buckets
    cross host memory, and as float32 over the device-direct ring); anything else as
    ``allreduce_async_`` sends it."""
    wire = wire_of(compression)
    if not wire or tensor.dtype != getattr(torch, wire):
        return allreduce_async_(tensor, None, name, op, prescale_factor, postscale_factor,
                                process_set)
    op = resolve_op(op, allowed=ALLREDUCE_OPS)

    def submit(array):
        return core.compressed_allreduce_async_(array, compression, name, op, prescale_factor,
                                                postscale_factor, process_set)
    if tensor.dtype == torch.bfloat16 and tensor.is_cuda and _staged(process_set):
        return _bfloat16_through_host(tensor, name, process_set, submit)
    return in_place(tensor, submit, bfloat16=True)


def _staged(process_set):
    """Whether the set's device buckets travel through host memory (not the device-direct
    ring, which reads the peers' device memory on one node)."""
    return door.stages_device(process_set)


# the set's Group -> {name: a pinned host tensor kept for that name's payloads}; an entry goes
# with its Group (a removed process set's, or every one at shutdown)
_PINNED = weakref.WeakKeyDictionary()


def _bfloat16_through_host(tensor, name, process_set, submit):
    """A CUDA bfloat16 payload where device buckets cross host memory: the device libraries
    have no bfloat16, so it is copied into pinned host memory and travels as the host's
    bfloat16 payloads do (16 bits on the wire, float32 sums), then comes back up. Named
    payloads (a hook's buckets) keep their host copy from call to call."""
    door.check_free(name, process_set)
    kept = _PINNED.setdefault(group_of(process_set), {})
    host = kept.get(name) if isinstance(name, str) else None
    if host is None or host.shape != tensor.shape:
        host = torch.empty(tensor.shape, dtype=torch.bfloat16, pin_memory=True)
        if isinstance(name, str):
            kept[name] = host
    host.copy_(tensor.detach())  # waits for the tensor's producer on its stream

    def finish(result):
        tensor.data.copy_(host)
        return tensor
    return TorchHandle(submit(as_numpy(host, bfloat16=True)), finish)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Start allreduces of a list of tensors; ``synchronize`` returns the list."""
    door.check_free(name, process_set, ".0")
    check_tensors(tensors, "grouped_allreduce_async")
    arrays = [as_numpy(tensor) for tensor in tensors]
    group = core.grouped_allreduce_async(arrays, average, name, op, prescale_factor,
                                         postscale_factor, process_set)
    return TorchHandle(group, group_finish(tensors))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Start in-place allreduces of a list of tensors."""
    door.check_free(name, process_set, ".0")
    check_tensors(tensors, "grouped_allreduce_async_")
    handles = member_handles(tensors, name, process_set, lambda tensor, member: allreduce_async_(
        tensor, average, member, op, prescale_factor, postscale_factor, process_set))
    group = core.group_handles(handle.inner for handle in handles)
    return TorchHandle(group, lambda results: [handle.finish(result)
                                               for handle, result in zip(handles, results)])


def member_handles(tensors, name, process_set, start):
    """``start(tensor, member_name)`` for each tensor of a grouped allreduce, with the
    members named ``<name>.<index>`` (a generated name when ``name`` is None), announced
    together as the core's grouped verbs are."""
    return door.start_group("grouped_allreduce", tensors, name, process_set, start).handles


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set, *,
                           prescale_factor=1.0, postscale_factor=1.0):
    """Start reducing a sparse COO tensor by allgathering its indices and values (the ranks'
    nonzero rows differ in number).

    The handle (``synchronize(handle)`` or ``handle()``) gives the summed sparse tensor,
    divided by the set's size for Average. Only Sum and Average apply; the values are
    multiplied by ``prescale_factor`` before they travel, by ``postscale_factor`` after.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError(f"sparse_allreduce_async takes a sparse COO torch.Tensor, got "
                        f"{type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else 'a dense tensor'}")
    op = resolve_op(op, allowed=(ops.Average, ops.Sum))
    group = group_of(process_set)
    coalesced = tensor.coalesce()
    base = name or group.auto_name("sparse_allreduce")
    own_values = coalesced.values().contiguous()
    if prescale_factor != 1.0:
        own_values = own_values * prescale_factor
    values = allgather_async(own_values, f"{base}.values", process_set)
    indices = allgather_async(coalesced.indices().t().contiguous(), f"{base}.indices", process_set)
    both = core.group_handles([values.inner, indices.inner])

    def finish(results):
        gathered_values = values.finish(results[0])
        gathered_indices = indices.finish(results[1])
        if postscale_factor != 1.0:
            gathered_values = gathered_values * postscale_factor
        if op == ops.Average:
            gathered_values = gathered_values / group.size
        # every rank's indices were coalesced and in range: valid by construction
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.shape,
                                       dtype=tensor.dtype, check_invariants=False).coalesce()
    return TorchHandle(both, finish)


# ---- allgather, broadcast, alltoall, reducescatter -----------------------------------------

def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start an allgather; ``synchronize`` returns the concatenated tensor."""
    door.check_free(name, process_set)
    check_tensor(tensor, min_ndim=1)
    return TorchHandle(core.allgather_async(as_numpy(tensor), name, process_set),
                       lambda result: to_torch(result, tensor))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start allgathers of a list of tensors; ``synchronize`` returns the list."""
    door.check_free(name, process_set, ".0")
    check_tensors(tensors, "grouped_allgather_async", min_ndim=1)
    arrays = [as_numpy(tensor) for tensor in tensors]
    return TorchHandle(core.grouped_allgather_async(arrays, name, process_set),
                       group_finish(tensors))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start a broadcast; ``synchronize`` returns a new tensor with root's values."""
    door.check_free(name, process_set)
    return TorchHandle(core.broadcast_async(as_numpy(tensor), root_rank, name, process_set),
                       lambda result: to_torch(result, tensor))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start an in-place broadcast into ``tensor``."""
    door.check_free(name, process_set)
    return in_place(tensor, lambda array: core.broadcast_async_(array, root_rank, name,
                                                                 process_set))


def broadcast_now(tensor, root_rank, name, process_set, inplace):
    """A blocking broadcast, driven by the caller (see ``start_allreduce``)."""
    door.check_free(name, process_set)
    return synchronize(_started(tensor, inplace, lambda array: door.start(
        "broadcast", array, name, process_set, inplace=inplace, now=True,
        name_checked=True, root_rank=root_rank)))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start an alltoall; ``synchronize`` returns (received tensor, received splits)."""
    door.check_free(name, process_set)
    check_tensor(tensor, min_ndim=1)
    handle = core.alltoall_async(as_numpy(tensor), _splits_list(splits), name, process_set)
    return TorchHandle(handle, lambda result: (to_torch(result[0], tensor),
                                               torch.from_numpy(result[1]).to(torch.int32)))


def _splits_list(splits):
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise ValueError(f"splits must be a tensor of integers (torch.int32), got "
                             f"{splits.dtype}")
        return splits.tolist()
    return splits


def reducescatter_async(tensor, name=None, op=ops.Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Start a reducescatter; ``synchronize`` returns this rank's rows."""
    door.check_free(name, process_set)
    check_tensor(tensor, min_ndim=1)
    handle = core.reducescatter_async(as_numpy(tensor), name, op, process_set, prescale_factor,
                                      postscale_factor)
    return TorchHandle(handle, lambda result: to_torch(result, tensor))


def grouped_reducescatter_async(tensors, name=None, op=ops.Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    """Start reducescatters of a list of tensors; ``synchronize`` returns the list."""
    door.check_free(name, process_set, ".0")
    check_tensors(tensors, "grouped_reducescatter_async", min_ndim=1)
    arrays = [as_numpy(tensor) for tensor in tensors]
    handle = core.grouped_reducescatter_async(arrays, name, op, process_set, prescale_factor,
                                              postscale_factor)
    return TorchHandle(handle, group_finish(tensors))
