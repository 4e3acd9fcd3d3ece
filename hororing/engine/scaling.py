"""What is done to a bucket's values around the reduction: the factor before it, and the
division (Average) and postscale applied to each reduced piece after it."""

import functools

import numpy as np

from ..kernels import divide_into, divide_trunc, round_to_fp16, scale_into
from ..ops import Average, Sum, is_floating, numpy_dtype


@functools.lru_cache(maxsize=1024)  # a training loop repeats the same few tensors
def scaling(meta, contributors):
    """The factor applied before the reduction, and the finalizer applied after it."""
    if meta.wire and meta.op == Average:
        # a 16-bit wire sum could overflow where the average would not: divide first
        return meta.prescale / contributors, finalizer(meta._replace(op=Sum), contributors)
    return meta.prescale, finalizer(meta, contributors)


def plain_divisor(meta, size):
    """``size`` where ``meta``'s finalizer is only an Average's division of float32 or float64
    values (no postscale, no 16-bit wire): what a compiled fold cycle does itself
    (``algorithms/compiled/folded.py``), bitwise as ``divide_into``. Else 0."""
    if meta.op == Average and not meta.wire and meta.postscale == 1.0 \
            and numpy_dtype(meta.dtype) in _PLAIN_FLOATS:
        return size
    return 0


_PLAIN_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _rounds_to_fp16(meta):
    return meta.dtype == "float16" and not meta.wire


def finalizer(meta, size):
    """The division (Average over ``size`` contributions) and postscale of a reduced piece.

    A float16 tensor's float32 sum is rounded to float16 before an Average's division or a
    postscale, where Horovod's float16 sum is. The sum itself is exact in float32 (Horovod
    rounds after every addition), so the two agree bitwise up to 2 ranks, and beyond that
    whenever Horovod's partial sums are exact.
    """
    finalize = _finalizer(meta, size)
    if finalize is None or not _rounds_to_fp16(meta):
        return finalize

    def finalize_half(piece):
        round_to_fp16(piece)
        finalize(piece)
    return finalize_half


def _finalizer(meta, size):
    postscale = meta.postscale
    if meta.op == Average:
        if is_floating(meta.dtype):
            if postscale == 1.0:
                def finalize_divided(piece):
                    divide_into(piece, size)
                return finalize_divided
            factor = postscale / size

            def finalize(piece):
                scale_into(piece, factor)
            return finalize

        def finalize_integer(piece):
            divide_trunc(piece, size)
            scale_into(piece, postscale)
        return finalize_integer
    if postscale == 1.0:
        return None

    def finalize_scaled(piece):
        scale_into(piece, postscale)
    return finalize_scaled
