"""Scaling kernels: multiply by a factor, and integer division that truncates toward zero."""

import numpy as np

from . import half
from ._xp import NUMBA, array_module, backend, device_kernels


def scale_into(buffer, factor, stream=0):
    """Multiply ``buffer`` by ``factor`` in place.

    Floating buffers are multiplied in their own precision. Integer buffers are multiplied
    in float64 and truncated toward zero, as Horovod's core scales integer tensors.
    """
    if factor == 1.0:
        return
    if backend(buffer) == NUMBA:
        device_kernels().scale_into(buffer, factor, stream)
        return
    fast = half.tensor(buffer, bfloat16=True)
    if fast is not None:
        fast.mul_(half.factor(factor, buffer.dtype))
        return
    xp = array_module(buffer)
    if _floating(buffer.dtype):
        xp.multiply(buffer, buffer.dtype.type(factor), out=buffer)
        return
    scaled = xp.trunc(buffer.astype(xp.float64) * float(factor))
    buffer[...] = scaled.astype(buffer.dtype)


def divide_into(buffer, divisor, stream=0):
    """Divide a floating ``buffer`` by ``divisor`` in place, correctly rounded.

    Float Average divides rather than multiplying by 1/size: (75 + 75 + 0) * (1/3) in
    float32 is one unit in the last place off 50, the division is exact.
    """
    if backend(buffer) == NUMBA:
        device_kernels().divide_into(buffer, divisor, stream)
        return
    xp = array_module(buffer)
    xp.divide(buffer, buffer.dtype.type(divisor), out=buffer)


def divide_trunc(buffer, divisor, stream=0):
    """Divide an integer ``buffer`` by a positive integer in place, rounding toward zero.

    This is integer Average: C's ``/`` on the summed values, exact for every int64.
    """
    if backend(buffer) == NUMBA:
        device_kernels().divide_trunc(buffer, divisor, stream)
        return
    xp = array_module(buffer)
    if buffer.dtype.kind == "u":
        xp.floor_divide(buffer, divisor, out=buffer)
        return
    negative = buffer < 0
    xp.abs(buffer, out=buffer)
    xp.floor_divide(buffer, divisor, out=buffer)
    if xp is np:
        xp.negative(buffer, out=buffer, where=negative)
    else:  # cupy's ufuncs take no where=
        buffer[...] = xp.where(negative, -buffer, buffer)


def _floating(dtype):
    # bfloat16 (ml_dtypes) is floating though numpy gives it kind "V"
    # (the name last: numpy computes a dtype's name in Python, ~2 us)
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.itemsize == 2
                                 and dtype.name == "bfloat16")
