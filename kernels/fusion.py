"""Fusion-buffer pack and unpack: many tensors into one flat buffer and back."""


def pack(arrays, buffer):
    """Copy ``arrays`` end to end into the flat ``buffer``; return the element offsets.

    Args:
        arrays: arrays of ``buffer``'s dtype (any shape).
        buffer: 1-D array at least as long as the arrays' total size.

    Returns:
        list of (start, stop) element ranges, one per array, in order.
    """
    ranges = []
    offset = 0
    for array in arrays:
        stop = offset + array.size
        buffer[offset:stop].reshape(array.shape)[...] = array
        ranges.append((offset, stop))
        offset = stop
    return ranges


def unpack(buffer, ranges, outputs):
    """Copy each range of ``buffer`` back into the matching output array."""
    for (start, stop), output in zip(ranges, outputs):
        output[...] = buffer[start:stop].reshape(output.shape)
