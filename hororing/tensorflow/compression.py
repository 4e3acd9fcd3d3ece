"""Gradient compression for TensorFlow tensors: the kinds of ``hororing.compression`` (one
implementation each), with TensorFlow's dtype tests and casts."""

import tensorflow as tf

from .. import compression as kinds
from ..compression import Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class FP16Compressor(kinds.FP16Compressor):
    __doc__ = kinds.FP16Compressor.__doc__

    @staticmethod
    def floating(tensor):
        return tensor.dtype.is_floating

    @classmethod
    def is_target(cls, tensor):
        return tensor.dtype == tf.float16

    @staticmethod
    def cast_to_target(tensor):
        return tf.cast(tensor, tf.float16)

    @staticmethod
    def cast_back(tensor, dtype):
        return tf.cast(tensor, dtype)


class Compression:
    """Horovod's names: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
