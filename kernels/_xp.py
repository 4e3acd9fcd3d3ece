"""Pick the array module (numpy or cupy) an array belongs to, without importing cupy."""

import numpy as np


def array_module(array):
    """Return the module whose ufuncs operate on ``array`` (numpy or cupy)."""
    if type(array).__module__.startswith("cupy"):
        import cupy  # only reached for cupy arrays, so cupy is already imported

        return cupy
    return np
