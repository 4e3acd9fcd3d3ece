"""PowerSGD's operations on torch tensors (``hororing.powersgd.arrays`` has numpy's), registered
when hororing.torch is imported: a CUDA bucket's factors, their products and the QR
factorizations stay on the GPU, on torch's current stream, and the allreduces take the device
path. A CPU tensor's allreduce travels as the numpy view of its memory, as the binding hands
CPU buckets over."""

import numpy as np
import torch

from .. import collectives
from ..powersgd import arrays


class TorchArrays:
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
        return torch.zeros_like(tensor)

    @staticmethod
    def empty(count, like):
        return torch.empty(count, dtype=like.dtype, device=like.device)

    @staticmethod
    def concatenate(tensors):
        return torch.cat(tensors)

    @staticmethod
    def from_host(values, like):
        return torch.as_tensor(np.asarray(values)).to(device=like.device, dtype=like.dtype)

    @staticmethod
    def fits(value, like):
        return (isinstance(value, torch.Tensor) and value.dtype == like.dtype
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
        matrix.copy_(torch.linalg.qr(matrix, mode="reduced")[0])

    @staticmethod
    def project(matrix, q, out):
        """``out`` = ``matrix`` @ ``q``."""
        torch.mm(matrix, q, out=out)
        return out

    @staticmethod
    def project_back(matrix, p, out):
        """``out`` = ``matrix``ᵀ @ ``p``, computed as (``p``ᵀ ``matrix``)ᵀ."""
        out.copy_(torch.mm(p.t(), matrix).t())
        return out

    @staticmethod
    def expand(p, q, out):
        """``out`` = ``p`` @ ``q``ᵀ."""
        torch.mm(p, q.t(), out=out)
        return out

    @staticmethod
    def allreduce_async_(tensor, **arguments):
        # a CUDA tensor takes the device path; a CPU one travels as the numpy view of its
        # memory, as the binding hands CPU buckets over
        return collectives.allreduce_async_(_engine_view(tensor), **arguments)

    @staticmethod
    def allreduce_(tensor, **arguments):
        return collectives.allreduce_(_engine_view(tensor), **arguments)

    @staticmethod
    def to_host(tensor):
        return tensor.detach().cpu().numpy()


def _engine_view(tensor):
    return tensor if tensor.device.type != "cpu" else tensor.detach().numpy()


arrays.register(TorchArrays(), lambda value: isinstance(value, torch.Tensor))
