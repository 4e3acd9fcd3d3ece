"""Gradient compression for torch tensors: the kinds of ``hororing.compression`` (one
implementation each), with torch's dtype tests and casts."""

import torch

from .. import compression as kinds
from ..compression import Compressor, NoneCompressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class _TorchCasts:
    """How a cast kind sees and casts torch tensors."""

    @staticmethod
    def floating(tensor):
        return tensor.dtype.is_floating_point

    @classmethod
    def is_target(cls, tensor):
        return tensor.dtype == getattr(torch, cls.target)

    @classmethod
    def cast_to_target(cls, tensor):
        return tensor.to(getattr(torch, cls.target))

    @staticmethod
    def cast_back(tensor, dtype):
        return tensor.to(dtype)


class FP16Compressor(_TorchCasts, kinds.FP16Compressor):
    __doc__ = kinds.FP16Compressor.__doc__


class BF16Compressor(_TorchCasts, kinds.BF16Compressor):
    __doc__ = kinds.BF16Compressor.__doc__


class Compression:
    """Horovod's names: ``Compression.none``, ``Compression.fp16``; plus ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
