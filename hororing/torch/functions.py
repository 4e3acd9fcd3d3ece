"""Helpers for starting every rank from the same model and optimizer state."""

import torch

from .. import objects
from . import mpi_ops


def broadcast_parameters(params, root_rank):
    """Copy root_rank's parameters into every rank's, in place. Every rank must call it.

    Args:
        params: ``model.state_dict()``, or a list of (name, tensor) such as
            ``model.named_parameters()``.
        root_rank: the rank whose values win.

    Raises:
        ValueError: ``params`` is of another type.

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list) or hasattr(params, "__next__"):
        items = list(params)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in items):
            raise ValueError("invalid params: expected a state_dict or a list of (name, tensor)")
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = []
    for name, tensor in items:
        if isinstance(tensor, torch.Tensor):
            target = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
            handles.append(mpi_ops.broadcast_async_(target, root_rank, name=f"broadcast.{name}"))
    for handle in handles:
        mpi_ops.synchronize(handle)


def broadcast_optimizer_state(optimizer, root_rank):
    """Make every rank's optimizer state and hyper-parameters equal to root_rank's.

    Scalars keep their Python types. Every rank must call it.

    Raises:
        ValueError: for torch.optim.LBFGS, whose state cannot be broadcast this way.
    """
    inner = getattr(optimizer, "_optimizer", optimizer)
    if isinstance(inner, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state = objects.broadcast_object(inner.state_dict(), root_rank, name="optimizer_state")
    inner.load_state_dict(state)


broadcast_object = objects.broadcast_object
allgather_object = objects.allgather_object
