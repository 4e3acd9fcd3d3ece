"""Gradient compression for TensorFlow tensors: ``compress(t) -> (t, ctx)``, ``decompress``."""

import tensorflow as tf


class NoneCompressor:
    """Send tensors as they are."""

    wire = ""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Send floating tensors as float16: half the bytes of float32 move between ranks.

    Each addition is computed in float32 and rounded to float16 between ranks; Average
    divides before summing, so the sum cannot overflow where the average would not.
    """

    wire = "float16"

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Horovod's names: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
