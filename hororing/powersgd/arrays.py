"""How PowerSGD touches its arrays: numpy's operations for host gradients (the numpy
optimizer's, and a torch optimizer's CPU gradients, which the binding hands over as numpy
views), torch's for torch tensors (CUDA gradients: the factors, their products and the QR
factorizations stay on the GPU, on torch's current stream, and the allreduces take the
device path).

``arrays_for(array)`` gives the namespace for a bucket's flat gradient vector; the hook calls
only what is here, so the one algorithm runs on either. torch is never imported here: a
tensor can only reach it once the process has imported torch.
"""

import sys

import numpy as np

from .. import collectives
from ..kernels import lowrank

FLOATS = ("float32", "float64")  # the gradients PowerSGD takes


def arrays_for(array):
    """NUMPY for a numpy array, TORCH for a torch tensor, None for anything else."""
    if isinstance(array, np.ndarray):
        return NUMPY
    if type(array).__module__.startswith("torch"):
        return TORCH
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


class _Torch:
    """torch tensors, on their device."""

    name = "torch"

    @staticmethod
    def dtype_name(tensor):
        return str(tensor.dtype).rpartition(".")[2]

    @staticmethod
    def count(tensor):
        return tensor.numel()

    @staticmethod
    def zeros_like(tensor):
        return _torch().zeros_like(tensor)

    @staticmethod
    def empty(count, like):
        return _torch().empty(count, dtype=like.dtype, device=like.device)

    @staticmethod
    def concatenate(tensors):
        return _torch().cat(tensors)

    @staticmethod
    def from_host(values, like):
        return _torch().as_tensor(np.asarray(values)).to(device=like.device, dtype=like.dtype)

    @staticmethod
    def fits(value, like):
        return (type(value).__module__.startswith("torch") and value.dtype == like.dtype
                and value.device == like.device)

    @staticmethod
    def copy(tensor):
        return tensor.detach().clone()

    @staticmethod
    def assign(target, source):
        target.copy_(source)

    @staticmethod
    def add(target, source):
        target.add_(source)

    @staticmethod
    def subtract(target, source):
        target.sub_(source)

    @staticmethod
    def orthogonalize(matrix):
        matrix.copy_(_torch().linalg.qr(matrix, mode="reduced")[0])

    @staticmethod
    def project(matrix, q, out):
        """``out`` = ``matrix`` @ ``q``."""
        _torch().mm(matrix, q, out=out)
        return out

    @staticmethod
    def project_back(matrix, p, out):
        """``out`` = ``matrix``ᵀ @ ``p``, computed as (``p``ᵀ ``matrix``)ᵀ."""
        out.copy_(_torch().mm(p.t(), matrix).t())
        return out

    @staticmethod
    def expand(p, q, out):
        """``out`` = ``p`` @ ``q``ᵀ."""
        _torch().mm(p, q.t(), out=out)
        return out

    @staticmethod
    def allreduce_async_(tensor, **arguments):
        # a CUDA tensor takes the device path; a CPU one travels as the numpy view of its
        # memory, as the binding hands CPU buckets over
        return collectives.allreduce_async_(_engine_view(tensor), **arguments)

    @staticmethod
    def allreduce_(tensor, **arguments):
        return collectives.allreduce_(_engine_view(tensor), **arguments)


def on_host(value):
    """``value`` (a numpy array or a torch tensor, on any device) as a numpy array."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _engine_view(tensor):
    return tensor if tensor.device.type != "cpu" else tensor.detach().numpy()


def _torch():
    return sys.modules["torch"]


NUMPY, TORCH = _Numpy(), _Torch()
