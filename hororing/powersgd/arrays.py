"""How PowerSGD touches its arrays: numpy's operations for host gradients (the numpy
optimizer's, and a torch optimizer's CPU gradients, which the binding hands over as numpy
views), and a binding's own for its tensors, registered by the binding when it is imported
(``register``: hororing.torch registers torch's, ``torch/powersgd_arrays.py``, for CUDA
gradients, whose factors, products and QR factorizations stay on the GPU).

``arrays_for(array)`` gives the namespace for a bucket's flat gradient vector; the hook calls
only what a namespace has (``_Numpy``'s methods), so the one algorithm runs on any of them.
"""

import numpy as np

from .. import collectives
from ..kernels import lowrank

FLOATS = ("float32", "float64")  # the gradients PowerSGD takes


_REGISTERED = []  # (accepts, namespace) of the bindings' arrays, in registration order


def register(namespace, accepts):
    """Take a binding's arrays: ``accepts(array)`` is True for them, and ``namespace`` works
    them as ``_Numpy`` works numpy arrays (every one of its methods, and ``to_host(array)``:
    a numpy copy)."""
    _REGISTERED.append((accepts, namespace))


def arrays_for(array):
    """The namespace that works ``array`` (NUMPY for a numpy array, a registered one for a
    binding's tensor), or None where none does."""
    if isinstance(array, np.ndarray):
        return NUMPY
    for accepts, namespace in _REGISTERED:
        if accepts(array):
            return namespace
    return None


class _Numpy:
    """Host arrays."""

    name = "numpy"

    @staticmethod
    def dtype_name(array):
        return array.dtype.name

    @staticmethod
    def count(array):
        return array.size

    @staticmethod
    def zeros_like(array):
        return np.zeros_like(array)

    @staticmethod
    def empty(count, like):
        return np.empty(count, like.dtype)

    @staticmethod
    def concatenate(arrays):
        return np.concatenate(arrays)

    @staticmethod
    def from_host(values, like):
        """``values`` (numpy) as an array of ``like``'s kind, dtype and place."""
        return np.asarray(values, dtype=like.dtype)

    @staticmethod
    def fits(value, like):
        """Whether ``value`` is already an array of ``like``'s kind, dtype and place."""
        return isinstance(value, np.ndarray) and value.dtype == like.dtype

    @staticmethod
    def copy(array):
        return array.copy()

    @staticmethod
    def assign(target, source):
        target[...] = source

    @staticmethod
    def add(target, source):
        np.add(target, source, out=target)

    @staticmethod
    def subtract(target, source):
        np.subtract(target, source, out=target)

    @staticmethod
    def orthogonalize(matrix):
        matrix[...] = np.linalg.qr(matrix, mode="reduced")[0]

    project = staticmethod(lowrank.project)
    project_back = staticmethod(lowrank.project_back)
    expand = staticmethod(lowrank.expand)

    @staticmethod
    def allreduce_async_(array, **arguments):
        return collectives.allreduce_async_(array, **arguments)

    @staticmethod
    def allreduce_(array, **arguments):
        return collectives.allreduce_(array, **arguments)


def on_host(value):
    """``value`` (a numpy array or a registered binding's tensor, on any device) as a numpy
    array."""
    if isinstance(value, np.ndarray):
        return value
    namespace = arrays_for(value)
    return namespace.to_host(value) if namespace is not None else np.asarray(value)


NUMPY = _Numpy()
