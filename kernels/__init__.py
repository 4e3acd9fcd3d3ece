"""Reduction, scaling, compression and fusion kernels shared by every transport.

Installed as ``hororing.kernels``. One name per operation: each function looks at the array
it gets and runs numpy on host arrays, cupy's ufuncs on cupy arrays, and the numba.cuda
kernels of ``hororing.kernels.cuda`` on numba device arrays (imported on first use).
"""

from ._xp import backend
from .compress import from_bf16, from_fp16, round_to_fp16, to_bf16, to_fp16
from .fusion import pack, unpack
from .reduce import REDUCE_UFUNCS, reduce_into
from .scale import divide_into, divide_trunc, scale_into

__all__ = ["REDUCE_UFUNCS", "backend", "divide_into", "divide_trunc", "from_bf16", "from_fp16",
           "pack", "reduce_into", "round_to_fp16", "scale_into", "to_bf16", "to_fp16", "unpack"]
