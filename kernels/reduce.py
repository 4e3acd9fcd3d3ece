"""Element-wise reduction of one buffer into another: ``target = target (op) source``."""

import numpy as np

from . import half
from ._xp import NUMBA, array_module, backend, device_kernels

# Reduction names are the ones the engine uses on the wire; Average is a Sum followed by
# a scale, so it never reaches a kernel.
REDUCE_UFUNCS = {
    "sum": "add",
    "min": "minimum",
    "max": "maximum",
    "product": "multiply",
}
_NUMPY_UFUNCS = {op: getattr(np, name) for op, name in REDUCE_UFUNCS.items()}


def reduce_into(target, source, op, stream=0):
    """Combine ``source`` into ``target`` in place.

    Args:
        target: contiguous array (numpy, cupy or numba.cuda), overwritten with
            ``target (op) source``.
        source: array of the same kind, shape and dtype as ``target``.
        op: one of ``"sum"``, ``"min"``, ``"max"``, ``"product"``.
        stream: numba.cuda stream for device arrays (cupy uses its current stream).

    Raises:
        ValueError: for an unknown op.
    """
    try:
        ufunc_name = REDUCE_UFUNCS[op]
    except KeyError:
        raise ValueError(f"unknown reduction {op!r}; expected one of {sorted(REDUCE_UFUNCS)}") from None
    if type(target) is np.ndarray and target.dtype.itemsize != 2:
        # the host's common case, first: every step of a ring on a 4 KiB buffer comes here
        _NUMPY_UFUNCS[op](target, source, out=target)
        return
    if backend(target) == NUMBA:
        kernels = device_kernels()
        kernels.reduce_into(target, source, kernels.OP_CODES[op], stream)
        return
    if op == "sum":
        fast = half.tensor(target, bfloat16=True)
        if fast is not None:
            fast.add_(half.tensor(source, bfloat16=True))
            return
    ufunc = getattr(array_module(target), ufunc_name)
    ufunc(target, source, out=target)
