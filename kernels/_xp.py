"""Which kind of array a kernel got: numpy, cupy, or a numba.cuda device array.

Nothing here imports cupy or numba; an array of theirs can only exist once they are imported.
"""

import numpy as np

NUMPY, CUPY, NUMBA = "numpy", "cupy", "numba"


def backend(array):
    """Return NUMPY, CUPY or NUMBA for ``array``."""
    module = type(array).__module__
    if module.startswith("cupy"):
        return CUPY
    if module.startswith("numba"):
        return NUMBA
    return NUMPY


def array_module(array):
    """Return the module whose ufuncs operate on a numpy or cupy ``array``."""
    if backend(array) == CUPY:
        import cupy  # only reached for cupy arrays, so cupy is already imported

        return cupy
    return np


def device_kernels():
    """The numba.cuda kernels (imported on first use: importing numba takes a while)."""
    from . import cuda

    return cuda
