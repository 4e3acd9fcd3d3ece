"""The torch autograd Functions behind the blocking verbs: each collective's gradient as
Horovod defines it (``grad_rules``), computed by collectives of the backward pass."""

import torch

from .. import grad_rules, ops
from ..compression import wire_of
from .async_ops import (allgather_async, allreduce_async, alltoall_async, broadcast_now,
                        compressed_allreduce_async_, grouped_allgather_async,
                        grouped_allreduce_async, grouped_reducescatter_async, member_handles,
                        reducescatter_async, start_allreduce)
from .bridge import synchronize

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
        return synchronize(start_allreduce(tensor, None, name, op, prescale_factor,
                                           postscale_factor, process_set, inplace=False,
                                           blocking=True))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(start_allreduce(grad_output.contiguous(), None, None, ctx.op,
                                           *ctx.scales, ctx.process_set, inplace=False,
                                           blocking=True))
        return grad, None, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, compression, process_set,
                *tensors):
        ctx.op, ctx.scales, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        if wire_of(compression):  # each member in its wire dtype, in place on a copy
            handles = member_handles(
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
        return broadcast_now(tensor, root_rank, name, process_set, inplace=False)

    @staticmethod
    def backward(ctx, grad_output):
        averaged = synchronize(start_allreduce(grad_output.contiguous(), None, None,
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
