"""Helpers for starting every rank from the same model and optimizer state."""

import torch

from .. import objects
from . import mpi_ops


def broadcast_parameters(params, root_rank):
    """Copy root_rank's parameters into every rank's, in place. Every rank must call it.

    Args:
        params: ``model.state_dict()``, a list of (name, tensor) such as
            ``model.named_parameters()``, or a list of tensors.
        root_rank: the rank whose values win.

    Raises:
        ValueError: ``params`` is of another type, or holds a lazy module's parameter that
            no forward pass has initialized yet.

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__next__"):
        items = [item if isinstance(item, tuple) else (None, item) for item in params]
        if any(len(item) != 2 for item in items):
            raise ValueError("invalid params: expected a state_dict, a list of (name, tensor) "
                             "or a list of tensors")
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    refuse_uninitialized(items, "broadcast_parameters")
    handles = []
    for name, tensor in items:
        if isinstance(tensor, torch.Tensor):
            target = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
            handles.append(mpi_ops.broadcast_async_(
                target, root_rank, name=None if name is None else f"broadcast.{name}"))
    for handle in handles:
        mpi_ops.synchronize(handle)


def broadcast_optimizer_state(optimizer, root_rank):
    """Make every rank's optimizer state and hyper-parameters equal to root_rank's.

    Scalars keep their Python types. Every rank must call it.

    Raises:
        ValueError: for torch.optim.LBFGS, whose state cannot be broadcast this way, and for
            parameters of a lazy module that no forward pass has initialized yet.
    """
    if getattr(optimizer, "shards_state", False):
        # each rank holds a slice: the full state is gathered (collective) and root's is
        # sharded again on every rank
        state = objects.broadcast_object(optimizer.gather_state_dict(), root_rank,
                                         name="optimizer_state")
        optimizer.load_state_dict(state)
        return
    inner = getattr(optimizer, "_optimizer", optimizer)
    if isinstance(inner, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    refuse_uninitialized([(f"param_groups[{group_index}]['params'][{index}]", parameter)
                          for group_index, group in enumerate(inner.param_groups)
                          for index, parameter in enumerate(group["params"])],
                         "broadcast_optimizer_state")
    if not inner.state:
        _create_state(inner)
    state = objects.broadcast_object(inner.state_dict(), root_rank, name="optimizer_state")
    inner.load_state_dict(state)


def refuse_uninitialized(named_tensors, caller):
    """Raise when a (name, tensor) pair holds a lazy module's parameter not yet initialized.

    ``torch.nn.LazyLinear`` and the other lazy modules make their parameters on the first
    forward pass; before it they have no shape or values, so there is nothing to broadcast
    or reduce, and passing them on would leave every rank with its own initialization.
    """
    for name, tensor in named_tensors:
        if isinstance(tensor, torch.Tensor) and torch.nn.parameter.is_lazy(tensor):
            shown = "a parameter" if name is None else f"parameter {name!r}"
            raise ValueError(f"{caller}: {shown} is not initialized yet: it belongs to a lazy "
                             f"module (e.g. torch.nn.LazyLinear), which creates it on the first "
                             f"forward pass. Run one forward pass with a batch of the real "
                             f"shape on every rank (model(example_batch)) before {caller}, as "
                             f"DistributedDataParallel also requires")


def _create_state(optimizer):
    """Give a fresh optimizer its state (as Horovod does), leaving the parameters unchanged.

    Parameters that require a gradient and have none get zeros, and the optimizer takes one
    step, so that root's state has every entry to copy; the step's effect on the parameters
    (weight decay acts even on zero gradients) is undone.
    """
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]
                  if parameter.requires_grad]
    for parameter in parameters:
        if parameter.grad is None:
            zeros = torch.zeros_like(parameter)
            sparse = isinstance(optimizer, torch.optim.SparseAdam)
            parameter.grad = zeros.to_sparse() if sparse else zeros
    saved = [parameter.detach().clone() for parameter in parameters]
    optimizer.step()
    with torch.no_grad():
        for parameter, value in zip(parameters, saved):
            parameter.copy_(value)


broadcast_object = objects.broadcast_object
allgather_object = objects.allgather_object
