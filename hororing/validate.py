"""Checks at the door: public calls reject bad arguments here, before anything is queued."""

import numbers

import numpy as np

from . import ops
from .errors import UnsupportedOpError
from .ops import SUPPORTED_NAMES, supported

_SUPPORTED_NAMES = ", ".join(SUPPORTED_NAMES)
REDUCE_OPS = (ops.Average, ops.Sum, ops.Min, ops.Max, ops.Product)
ALLREDUCE_OPS = REDUCE_OPS + (ops.Adasum,)  # Adasum reduces allreduces only, as in Horovod


def check_array(tensor, argument="tensor", min_ndim=0):
    """Return ``tensor`` if it is a numpy array of a supported dtype; raise otherwise."""
    if not isinstance(tensor, np.ndarray):
        got = "None" if tensor is None else type(tensor).__name__
        raise TypeError(f"{argument} must be a numpy array, got {got}; convert it with "
                        f"numpy.asarray(...) (hororing.torch takes torch tensors)")
    if not supported(tensor.dtype):
        raise TypeError(f"{argument} has unsupported dtype {tensor.dtype}; supported dtypes: "
                        f"{_SUPPORTED_NAMES}. Convert it with .astype(...)")
    check_ndim(tensor.shape, min_ndim, argument)
    return tensor


def check_ndim(shape, min_ndim, argument="tensor"):
    """Raise ValueError for an array of fewer than ``min_ndim`` dimensions (the verbs that
    split or gather rows need one); every binding's arrays are checked by it."""
    if len(shape) < min_ndim:
        # leading dimensions of 1 added: a scalar becomes one row (reshape(1)), not (1, 1)
        wanted = ", ".join(str(extent) for extent in (1,) * (min_ndim - len(shape)) + tuple(shape))
        raise ValueError(f"{argument} must have at least {min_ndim} dimension(s), got a "
                         f"{len(shape)}-d array of shape {tuple(shape)}; reshape it, e.g. "
                         f"{argument}.reshape({wanted})")


def check_writable(tensor, argument="tensor", flags=None):
    if not (tensor.flags if flags is None else flags).writeable:
        raise ValueError(f"{argument} is read-only, so an in-place collective cannot write its "
                         f"result; use the out-of-place form or pass a writable copy")


def check_name(name):
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__}")
    if name == "":
        raise ValueError("name must not be empty; pass None to have one generated")
    return name


def check_root(root_rank, size):
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise TypeError(f"root_rank must be an int, got {type(root_rank).__name__}")
    if not 0 <= root_rank < size:
        raise ValueError(f"root_rank must be in [0, {size}) (the job has {size} ranks), "
                         f"got {root_rank}")
    return int(root_rank)


def check_factor(value, argument):
    if type(value) is float:  # the common case, without the numbers ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a real number, got {type(value).__name__}")
    return float(value)


def resolve_op(op, average=None, allowed=REDUCE_OPS):
    """Return the reduction op from Horovod's ``op``/``average`` arguments."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        op = ops.Sum if average is False else ops.Average
    if op == ops.Adasum and op not in allowed:
        raise UnsupportedOpError("op=Adasum is supported by allreduce (and grouped allreduce "
                                 "and DistributedOptimizer) only, as in Horovod; use Average "
                                 "or Sum here")
    if op not in allowed:
        names = ", ".join(ops.op_name(allowed_op) for allowed_op in allowed)
        raise ValueError(f"op must be one of {names}, got {op!r}")
    return op


def check_adasum_dtype(op, dtype):
    """Adasum weighs tensors by their dot products: it needs floating-point values."""
    if op == ops.Adasum and np.dtype(dtype).kind != "f":
        raise TypeError(f"op=Adasum reduces floating-point tensors (float16, float32, float64), "
                        f"got {np.dtype(dtype).name}; use Sum or Average for integers")


def check_splits(splits, dim0, size):
    """Return alltoall ``splits`` as a tuple of ints (or None); raise on bad values."""
    if splits is None:
        if dim0 % size:
            raise ValueError(f"alltoall without splits needs the first dimension ({dim0}) to be "
                             f"divisible by the number of ranks ({size}); pass splits=")
        return None
    values = np.asarray(splits)
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise TypeError(f"splits must be a 1-d sequence of ints, got {splits!r}")
    if values.size != size:
        raise ValueError(f"splits must have one entry per rank ({size}), got {values.size}")
    if (values < 0).any():
        raise ValueError(f"splits must be non-negative, got {values.tolist()}")
    if int(values.sum()) != dim0:
        raise ValueError(f"splits must add up to the first dimension of the tensor ({dim0}), "
                         f"got sum {int(values.sum())} from {values.tolist()}")
    return tuple(int(value) for value in values)
