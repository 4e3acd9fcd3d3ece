"""The collective verbs on torch tensors, differentiable as Horovod defines them.

How tensors reach the engine and come back is ``bridge.py``. Every verb takes ``process_set``
(``hvd.global_process_set`` by default); ``root_rank`` is in ``hvd.rank()`` numbering.
"""

import torch

from .. import collectives as core
from .. import grad_rules, ops
from ..compression import wire_of
from ..process_sets import global_process_set, group_of
from ..validate import ALLREDUCE_OPS, resolve_op
from .bridge import (TorchHandle, as_numpy, check_tensor, check_tensors, group_finish, in_place,
                     synchronize, to_torch)
from .compression import Compression

# ---- allreduce --------------------------------------------------------------------------

def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Start an allreduce of ``tensor``; ``synchronize`` returns a new tensor."""
    return _start_allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set, inplace=False)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Start an in-place allreduce; ``synchronize`` returns ``tensor`` holding the result."""
    return _start_allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set, inplace=True)


def _start_allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                     inplace, blocking=False):
    """Submit an allreduce; ``blocking``: the caller synchronizes at once and drives the
    engine itself (the background thread is not woken for it)."""
    _check_free(name, process_set)
    return _started(tensor, inplace, lambda array: core.start(
        "allreduce", array, name, process_set, inplace=inplace, blocking=blocking,
        average=average, op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor))


def _check_free(name, process_set, member=""):
    """Refuse a ``name`` (its first member's, for grouped verbs) already in flight before
    anything else: converting a tensor can release the GIL, and a collective submitted just
    before under the same name could complete meanwhile, so whether the second call was
    refused would depend on the peers' timing."""
    if isinstance(name, str):
        core.group_of(process_set).engine.check_free(name + member)


def _started(tensor, inplace, submit):
    """The handle of ``submit(array)`` on ``tensor``'s data: its result lands in ``tensor``
    (``inplace``) or in a new tensor like it."""
    if inplace:
        return in_place(tensor, submit)
    return TorchHandle(submit(as_numpy(tensor)), lambda result: to_torch(result, tensor))


def compressed_allreduce_async_(tensor, compression, name=None, op=None, prescale_factor=1.0,
                                postscale_factor=1.0, process_set=global_process_set):
    """``allreduce_async_`` of a payload made by ``compression.compress``: a payload in the
    compressor's wire dtype travels in it (``Compression.fp16``: float16 moves as float16;
    CUDA tensors take the device path); anything else as ``allreduce_async_`` sends it."""
    wire = wire_of(compression)
    if not wire or tensor.dtype != getattr(torch, wire):
        return allreduce_async_(tensor, None, name, op, prescale_factor, postscale_factor,
                                process_set)
    op = resolve_op(op, allowed=ALLREDUCE_OPS)
    return in_place(tensor, lambda array: core.compressed_allreduce_async_(
        array, compression, name, op, prescale_factor, postscale_factor, process_set),
        bfloat16=True)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over all ranks (differentiable). Every rank must call it, in order.

    Example:
        >>> hvd.allreduce(torch.ones(3), op=hvd.Sum)
    """
    check_tensor(tensor)
    compression = compression or Compression.none
    op = resolve_op(op, average, allowed=ALLREDUCE_OPS)
    payload, ctx = compression.compress(tensor)
    result = _Allreduce.apply(payload, name, op, prescale_factor, postscale_factor, compression,
                              process_set)
    return compression.decompress(result, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """In-place allreduce (not differentiable)."""
    return synchronize(_start_allreduce(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set, inplace=True,
                                        blocking=True))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Start allreduces of a list of tensors; ``synchronize`` returns the list."""
    _check_free(name, process_set, ".0")
    check_tensors(tensors, "grouped_allreduce_async")
    arrays = [as_numpy(tensor) for tensor in tensors]
    group = core.grouped_allreduce_async(arrays, average, name, op, prescale_factor,
                                         postscale_factor, process_set)
    return TorchHandle(group, group_finish(tensors))


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


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Start in-place allreduces of a list of tensors."""
    _check_free(name, process_set, ".0")
    check_tensors(tensors, "grouped_allreduce_async_")
    handles = _member_handles(tensors, name, process_set, lambda tensor, member: allreduce_async_(
        tensor, average, member, op, prescale_factor, postscale_factor, process_set))
    group = core.group_handles(handle.inner for handle in handles)
    return TorchHandle(group, lambda results: [handle.finish(result)
                                               for handle, result in zip(handles, results)])


def _member_handles(tensors, name, process_set, start):
    """``start(tensor, member_name)`` for each tensor of a grouped allreduce, with the
    members named ``<name>.<index>`` (a generated name when ``name`` is None), announced
    together as the core's grouped verbs are."""
    return core.start_group("grouped_allreduce", tensors, name, process_set, start).handles


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """In-place grouped allreduce."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


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
    _check_free(name, process_set)
    check_tensor(tensor, min_ndim=1)
    return TorchHandle(core.allgather_async(as_numpy(tensor), name, process_set),
                       lambda result: to_torch(result, tensor))


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's tensor along dim 0 (differentiable). Every rank must call it."""
    check_tensor(tensor, min_ndim=1)
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start allgathers of a list of tensors; ``synchronize`` returns the list."""
    _check_free(name, process_set, ".0")
    check_tensors(tensors, "grouped_allgather_async", min_ndim=1)
    arrays = [as_numpy(tensor) for tensor in tensors]
    return TorchHandle(core.grouped_allgather_async(arrays, name, process_set),
                       group_finish(tensors))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather a list of tensors together (differentiable); return the list."""
    check_tensors(tensors, "grouped_allgather", min_ndim=1)
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start a broadcast; ``synchronize`` returns a new tensor with root's values."""
    _check_free(name, process_set)
    return TorchHandle(core.broadcast_async(as_numpy(tensor), root_rank, name, process_set),
                       lambda result: to_torch(result, tensor))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start an in-place broadcast into ``tensor``."""
    _check_free(name, process_set)
    return in_place(tensor, lambda array: core.broadcast_async_(array, root_rank, name,
                                                                 process_set))


def _broadcast_now(tensor, root_rank, name, process_set, inplace):
    """A blocking broadcast, driven by the caller (see ``_start_allreduce``)."""
    _check_free(name, process_set)
    return synchronize(_started(tensor, inplace, lambda array: core.start(
        "broadcast", array, name, process_set, inplace=inplace, blocking=True,
        root_rank=root_rank)))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return root_rank's tensor on every rank (differentiable). Every rank must call it."""
    check_tensor(tensor)
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast (not differentiable)."""
    return _broadcast_now(tensor, root_rank, name, process_set, inplace=True)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start an alltoall; ``synchronize`` returns (received tensor, received splits)."""
    _check_free(name, process_set)
    check_tensor(tensor, min_ndim=1)
    handle = core.alltoall_async(as_numpy(tensor), _splits_list(splits), name, process_set)
    return TorchHandle(handle, lambda result: (to_torch(result[0], tensor),
                                               torch.from_numpy(result[1]).to(torch.int32)))


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[i]`` rows to rank i (differentiable). Every rank must call it.

    Returns:
        the received rows; with ``splits`` given, also the rows received from each rank
        (an int32 tensor), as ``(rows, received_splits)``.
    """
    check_tensor(tensor, min_ndim=1)
    return _Alltoall.apply(tensor, splits, name, process_set)


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
    _check_free(name, process_set)
    check_tensor(tensor, min_ndim=1)
    handle = core.reducescatter_async(as_numpy(tensor), name, op, process_set, prescale_factor,
                                      postscale_factor)
    return TorchHandle(handle, lambda result: to_torch(result, tensor))


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


def grouped_reducescatter_async(tensors, name=None, op=ops.Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    """Start reducescatters of a list of tensors; ``synchronize`` returns the list."""
    _check_free(name, process_set, ".0")
    check_tensors(tensors, "grouped_reducescatter_async", min_ndim=1)
    arrays = [as_numpy(tensor) for tensor in tensors]
    handle = core.grouped_reducescatter_async(arrays, name, op, process_set, prescale_factor,
                                              postscale_factor)
    return TorchHandle(handle, group_finish(tensors))


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
    """Declare this rank out of data; return the rank that joined last (see hororing.join)."""
    return core.join(device)


def barrier(process_set=global_process_set):
    """Return once every rank of ``process_set`` has called barrier()."""
    return core.barrier(process_set)


# ---- autograd ---------------------------------------------------------------------------

class _Allreduce(torch.autograd.Function):
    # the gradient of an allreduce is the allreduce of the gradient, with the same op
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, compression,
                process_set):
        ctx.op, ctx.scales, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        if wire_of(compression):  # in place on a copy: the caller's tensor stays as it was
            return synchronize(compressed_allreduce_async_(
                tensor.detach().clone(), compression, name, op, prescale_factor,
                postscale_factor, process_set))
        return synchronize(_start_allreduce(tensor, None, name, op, prescale_factor,
                                            postscale_factor, process_set, inplace=False,
                                            blocking=True))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(_start_allreduce(grad_output.contiguous(), None, None, ctx.op,
                                            *ctx.scales, ctx.process_set, inplace=False,
                                            blocking=True))
        return grad, None, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, compression, process_set,
                *tensors):
        ctx.op, ctx.scales, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        if wire_of(compression):  # each member in its wire dtype, in place on a copy
            handles = _member_handles(
                tensors, name, process_set, lambda tensor, member: compressed_allreduce_async_(
                    tensor.detach().clone(), compression, member, op, prescale_factor,
                    postscale_factor, process_set))
            return tuple(synchronize(handle) for handle in handles)
        return tuple(synchronize(grouped_allreduce_async(
            list(tensors), None, name, op, prescale_factor, postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = synchronize(grouped_allreduce_async(
            [grad.contiguous() for grad in grad_outputs], None, None, ctx.op, *ctx.scales,
            ctx.process_set))
        return (None, None, None, None, None, None, *grads)


def _own_rows(grads, rows, process_set):
    """This rank's ``rows`` of each averaged gradient of an allgather's outputs."""
    starts = grad_rules.own_row_starts(rows, process_set)
    return [grad.narrow(0, start, count) for grad, start, count in zip(grads, starts, rows)]


class _Allgather(torch.autograd.Function):
    # this rank's slice of the averaged gradient
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        averaged = synchronize(allreduce_async(grad_output.contiguous(), None, None, ops.Average,
                                               process_set=ctx.process_set))
        return _own_rows([averaged], [ctx.rows], ctx.process_set)[0], None, None


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [tensor.shape[0] for tensor in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        averaged = synchronize(grouped_allreduce_async(
            [grad.contiguous() for grad in grad_outputs], None, None, ops.Average,
            process_set=ctx.process_set))
        return (None, None, *_own_rows(averaged, ctx.rows, ctx.process_set))


class _Broadcast(torch.autograd.Function):
    # the averaged gradient on the root, zero elsewhere
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _broadcast_now(tensor, root_rank, name, process_set, inplace=False)

    @staticmethod
    def backward(ctx, grad_output):
        averaged = synchronize(_start_allreduce(grad_output.contiguous(), None, None,
                                                ops.Average, 1.0, 1.0, ctx.process_set,
                                                inplace=False, blocking=True))
        if not grad_rules.keeps_broadcast_gradient(ctx.root_rank):
            averaged.zero_()
        return averaged, None, None, None


class _Alltoall(torch.autograd.Function):
    # the gradient travels back: each rank returns the rows it received to their sender
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received, None,
                                             ctx.process_set))
        return grad, None, None, None


def _reducescatter_grad_scale(ctx):
    return grad_rules.reducescatter_gradient_scale(ctx.op, ctx.prescale, ctx.postscale,
                                                   ctx.process_set)


class _Reducescatter(torch.autograd.Function):
    # the gradient is the allgather of the output's gradient, scaled as the forward was
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale, ctx.postscale = prescale_factor, postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        scaled = grad_output.contiguous() * _reducescatter_grad_scale(ctx)
        gathered = synchronize(allgather_async(scaled, None, ctx.process_set))
        return gathered, None, None, None, None, None


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale, ctx.postscale = prescale_factor, postscale_factor
        return tuple(synchronize(grouped_reducescatter_async(
            list(tensors), name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        scale = _reducescatter_grad_scale(ctx)
        gathered = synchronize(grouped_allgather_async(
            [grad.contiguous() * scale for grad in grad_outputs], None, ctx.process_set))
        return (None, None, None, None, None, *gathered)
