"""Gradient compression: ``compress(tensor) -> (payload, ctx)``, ``decompress(payload, ctx)``."""

import torch


class NoneCompressor:
    """Send gradients as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor:
    """Send floating gradients in a 16-bit type; one helper for fp16 and bf16."""

    wire_dtype = None

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Send floating gradients as float16 (sums accumulate in float32 on the wire)."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Send floating gradients as bfloat16 (float32's range, fewer mantissa bits)."""

    wire_dtype = torch.bfloat16


class Compression:
    """Horovod's names: ``Compression.none``, ``Compression.fp16``; plus ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
