"""The collective verbs on torch tensors, differentiable as Horovod defines them.

CPU tensors are handed to the engine as numpy views of the same memory (no copy); CUDA
tensors as themselves (the engine sees them through ``__cuda_array_interface__``, no copy),
and results come back on the input's device. In-place verbs write straight into the tensor.
bfloat16, which numpy lacks, travels as float32.
"""

import numpy as np
import torch

from .. import collectives as core
from .. import ops
from ..context import current
from ..engine.request import GroupHandle
from ..validate import resolve_op

_NUMPY_FREE = (torch.bfloat16,)


class TorchHandle:
    """An async collective on tensors: ``synchronize`` returns tensors."""

    __slots__ = ("inner", "finish")

    def __init__(self, inner, finish):
        self.inner = inner
        self.finish = finish

    def done(self):
        return self.inner.done()


def synchronize(handle):
    """Wait for an ``*_async`` call and return its tensor result (raises its error)."""
    if not isinstance(handle, TorchHandle):
        raise TypeError(f"synchronize takes a handle from an *_async call, got {type(handle).__name__}")
    return handle.finish(core.synchronize(handle.inner))


def poll(handle):
    """Return True if the asynchronous collective has finished; never blocks."""
    if not isinstance(handle, TorchHandle):
        raise TypeError(f"poll takes a handle from an *_async call, got {type(handle).__name__}")
    return handle.done()


def _as_numpy(tensor, argument="tensor"):
    if not isinstance(tensor, torch.Tensor):
        got = "None" if tensor is None else type(tensor).__name__
        raise TypeError(f"{argument} must be a torch.Tensor, got {got}; convert it with torch.as_tensor(...)")
    if tensor.is_sparse:
        raise ValueError(f"{argument} is sparse; densify it with .to_dense() first")
    detached = tensor.detach()
    if detached.dtype in _NUMPY_FREE:
        detached = detached.float()
    if detached.device.type == "cuda":
        return detached.contiguous()
    if detached.device.type != "cpu":
        raise ValueError(f"{argument} is on {tensor.device}; hororing reduces CPU and CUDA "
                         f"tensors: move it with .cpu() or .cuda()")
    return detached.numpy()


def _to_torch(array, like):
    if isinstance(array, torch.Tensor):
        result = array
    elif isinstance(array, np.ndarray):
        result = torch.from_numpy(np.ascontiguousarray(array))
    else:  # a device array from the engine: viewed in place, on the input's device
        result = torch.as_tensor(array, device=like.device)
    return result.to(like.dtype) if result.dtype != like.dtype else result


def _in_place(tensor, submit):
    """Run ``submit(array)`` on a numpy view of ``tensor`` so the result lands in it."""
    array = _as_numpy(tensor)
    if (tensor.device.type == "cuda" and tensor.dtype not in _NUMPY_FREE
            and array.data_ptr() != tensor.data_ptr()):
        raise ValueError("an in-place collective needs a contiguous CUDA tensor; call "
                         ".contiguous() first or use the out-of-place form")
    if tensor.dtype in _NUMPY_FREE:  # the float32 copy comes back into the bf16 tensor
        def finish(result):
            tensor.data.copy_(_to_torch(result, tensor))
            return tensor
    else:
        def finish(result):
            return tensor
    return TorchHandle(submit(array), finish)


# ---- allreduce --------------------------------------------------------------------------

def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0):
    """Start an allreduce of ``tensor``; ``synchronize`` returns a new tensor."""
    handle = core.allreduce_async(_as_numpy(tensor), average, name, op, prescale_factor,
                                  postscale_factor)
    return TorchHandle(handle, lambda result: _to_torch(result, tensor))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0):
    """Start an in-place allreduce; ``synchronize`` returns ``tensor`` holding the result."""
    return _in_place(tensor, lambda array: core.allreduce_async_(
        array, average, name, op, prescale_factor, postscale_factor))


def compressed_allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                                postscale_factor=1.0):
    """``allreduce_async_`` of a compressed payload: a float16 tensor travels as float16
    (``Compression.fp16``; CUDA tensors take the device path); anything else as
    ``allreduce_async_`` sends it."""
    if tensor.dtype != torch.float16:
        return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor)
    op = resolve_op(op, average)
    return _in_place(tensor, lambda array: core.compressed_allreduce_async_(
        array, name, op, prescale_factor, postscale_factor))


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0):
    """Reduce ``tensor`` over all ranks (differentiable). Every rank must call it, in order.

    Example:
        >>> hvd.allreduce(torch.ones(3), op=hvd.Sum)
    """
    from .compression import Compression
    compression = compression or Compression.none
    op = resolve_op(op, average)
    payload, ctx = compression.compress(tensor)
    result = _Allreduce.apply(payload, name, op, prescale_factor, postscale_factor,
                              bool(getattr(compression, "wire", "")))
    return compression.decompress(result, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """In-place allreduce (not differentiable)."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0):
    """Start allreduces of a list of tensors; ``synchronize`` returns the list."""
    arrays = [_as_numpy(tensor) for tensor in tensors]
    group = core.grouped_allreduce_async(arrays, average, name, op, prescale_factor, postscale_factor)
    return TorchHandle(group, lambda results: [_to_torch(result, tensor)
                                              for result, tensor in zip(results, tensors)])


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0):
    """Allreduce a list of tensors together; return the list of results."""
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                               postscale_factor))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0):
    """Start in-place allreduces of a list of tensors."""
    handles = [allreduce_async_(tensor, average, None if name is None else f"{name}.{index}", op,
                                prescale_factor, postscale_factor)
               for index, tensor in enumerate(tensors)]
    group = GroupHandle(handle.inner for handle in handles)
    return TorchHandle(group, lambda results: [handle.finish(result)
                                               for handle, result in zip(handles, results)])


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0):
    """In-place grouped allreduce."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor))


# ---- allgather, broadcast, alltoall, reducescatter -----------------------------------------

def allgather_async(tensor, name=None):
    """Start an allgather; ``synchronize`` returns the concatenated tensor."""
    return TorchHandle(core.allgather_async(_as_numpy(tensor), name),
                       lambda result: _to_torch(result, tensor))


def allgather(tensor, name=None):
    """Concatenate every rank's tensor along dim 0 (differentiable). Every rank must call it."""
    return _Allgather.apply(tensor, name)


def broadcast_async(tensor, root_rank, name=None):
    """Start a broadcast; ``synchronize`` returns a new tensor with root's values."""
    return TorchHandle(core.broadcast_async(_as_numpy(tensor), root_rank, name),
                       lambda result: _to_torch(result, tensor))


def broadcast_async_(tensor, root_rank, name=None):
    """Start an in-place broadcast into ``tensor``."""
    return _in_place(tensor, lambda array: core.broadcast_async_(array, root_rank, name))


def broadcast(tensor, root_rank, name=None):
    """Return root_rank's tensor on every rank (differentiable). Every rank must call it."""
    return _Broadcast.apply(tensor, root_rank, name)


def broadcast_(tensor, root_rank, name=None):
    """In-place broadcast (not differentiable)."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


def alltoall_async(tensor, splits=None, name=None):
    """Start an alltoall; ``synchronize`` returns (received tensor, received splits)."""
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    handle = core.alltoall_async(_as_numpy(tensor), splits, name)
    return TorchHandle(handle, lambda result: (_to_torch(result[0], tensor),
                                               torch.from_numpy(result[1]).to(torch.int32)))


def alltoall(tensor, splits=None, name=None):
    """Send ``splits[i]`` rows to rank i; return (received rows, received splits)."""
    return synchronize(alltoall_async(tensor, splits, name))


def reducescatter_async(tensor, name=None, op=ops.Average, prescale_factor=1.0, postscale_factor=1.0):
    """Start a reducescatter; ``synchronize`` returns this rank's rows."""
    handle = core.reducescatter_async(_as_numpy(tensor), name, op, prescale_factor, postscale_factor)
    return TorchHandle(handle, lambda result: _to_torch(result, tensor))


def reducescatter(tensor, name=None, op=ops.Average, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over all ranks and return this rank's block of rows. Every rank must call it."""
    return synchronize(reducescatter_async(tensor, name, op, prescale_factor, postscale_factor))


# ---- autograd ---------------------------------------------------------------------------

class _Allreduce(torch.autograd.Function):
    # the gradient of an allreduce is the allreduce of the gradient, with the same op
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, compressed=False):
        ctx.op, ctx.scales = op, (prescale_factor, postscale_factor)
        if compressed:  # in place on a copy: the caller's tensor stays as it was
            return synchronize(compressed_allreduce_async_(
                tensor.detach().clone(), None, name, op, prescale_factor, postscale_factor))
        return synchronize(allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output.contiguous(), None, None, ctx.op, *ctx.scales))
        return grad, None, None, None, None, None


class _Allgather(torch.autograd.Function):
    # this rank's slice of the averaged gradient
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows = tensor.shape[0]
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx, grad_output):
        averaged = synchronize(allreduce_async(grad_output.contiguous(), None, None, ops.Average))
        rows = core.allgather(np.array([ctx.rows], dtype=np.int64))
        offset = int(rows[:current().rank].sum())
        return averaged.narrow(0, offset, ctx.rows), None


class _Broadcast(torch.autograd.Function):
    # the averaged gradient on the root, zero elsewhere
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx, grad_output):
        averaged = synchronize(allreduce_async(grad_output.contiguous(), None, None, ops.Average))
        if current().rank != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None
