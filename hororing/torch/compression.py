"""Gradient compression for torch tensors: the kinds of ``hororing.compression`` (one
implementation each), with torch's dtype tests and casts."""

import torch

from ..compression import Compressor, FrameworkCasts, NoneCompressor, framework_kinds

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class _TorchCasts(FrameworkCasts):
    @staticmethod
    def dtype_of(name):
        return getattr(torch, name)

    @staticmethod
    def is_floating(dtype):
        return dtype.is_floating_point

    @staticmethod
    def cast(tensor, dtype):
        return tensor.to(dtype)

    @staticmethod
    def empty_like(tensor, dtype):
        return torch.empty_like(tensor, dtype=dtype)

    @staticmethod
    def copy_into(target, source):
        target.copy_(source)


FP16Compressor, BF16Compressor, Compression = framework_kinds(_TorchCasts)
