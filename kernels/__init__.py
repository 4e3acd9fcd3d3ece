"""Reduction, scaling and fusion kernels shared by every transport.

Installed as ``hororing.kernels``. Each function takes arrays of one array module
(numpy here; cupy arrays dispatch to the same ufunc names on the device).
"""

from .fusion import pack, unpack
from .reduce import REDUCE_UFUNCS, reduce_into
from .scale import divide_trunc, scale_into

__all__ = ["REDUCE_UFUNCS", "divide_trunc", "pack", "reduce_into", "scale_into", "unpack"]
