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
    wire = ""  # a dtype name when the engine should send the payload in its own 16 bits

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Send floating gradients as float16: half the bytes of float32 move between ranks.

    Each addition is computed in float32 and rounded to float16 between ranks; Average
    divides before summing, so the sum cannot overflow where the average would not.
    (CUDA tensors are summed in float32 on the device path.)
    """

    wire_dtype = torch.float16
    wire = "float16"


class BF16Compressor(_CastCompressor):
    """Round floating gradients to bfloat16 (float32's range, fewer mantissa bits).

    numpy has no bfloat16, so the rounded values travel as float32: this saves no bytes on
    the wire; it gives bfloat16's rounding where a model expects it.
    """

    wire_dtype = torch.bfloat16


class Compression:
    """Horovod's names: ``Compression.none``, ``Compression.fp16``; plus ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
