"""Fusion-buffer pack and unpack: many tensors into one flat buffer and back."""

from . import half
from ._xp import NUMBA, backend, device_kernels


def pack(arrays, buffer, stream=0):
    """Copy ``arrays`` end to end into the flat ``buffer``; return the element offsets.

    Args:
        arrays: arrays of ``buffer``'s dtype (any shape). numba.cuda device arrays are
            copied on ``stream`` by one kernel launch per 32 arrays.
        buffer: 1-D array at least as long as the arrays' total size.

    Returns:
        list of (start, stop) element ranges, one per array, in order.
    """
    ranges = _ranges(arrays)
    if backend(buffer) == NUMBA:
        if ranges:
            _device_call("pack", buffer, arrays, ranges, stream)
        return ranges
    cast = buffer.dtype in half.CASTS  # float16 <-> float32 goes through torch's casts
    for (start, stop), array in zip(ranges, arrays):
        target = buffer[start:stop].reshape(array.shape)
        if not (cast and array.dtype != buffer.dtype and half.cast_into(target, array)):
            target[...] = array
    return ranges


def unpack(buffer, ranges, outputs, stream=0):
    """Copy each range of ``buffer`` back into the matching output array."""
    if backend(buffer) == NUMBA:
        if ranges:
            _device_call("unpack", buffer, outputs, ranges, stream)
        return
    cast = buffer.dtype in half.CASTS
    for (start, stop), output in zip(ranges, outputs):
        source = buffer[start:stop].reshape(output.shape)
        if not (cast and output.dtype != buffer.dtype and half.cast_into(output, source)):
            output[...] = source


def _ranges(arrays):
    ranges = []
    offset = 0
    for array in arrays:
        ranges.append((offset, offset + array.size))
        offset += array.size
    return ranges


def _device_call(which, buffer, arrays, ranges, stream):
    kernels = device_kernels()
    flat = [array.reshape(array.size) for array in arrays]
    getattr(kernels, which)(buffer, flat, [start for start, _ in ranges], stream)
