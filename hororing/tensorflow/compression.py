"""Gradient compression for TensorFlow tensors: the kinds of ``hororing.compression`` (one
implementation each), with TensorFlow's dtype tests and casts."""

import tensorflow as tf

from .. import compression as kinds
from ..compression import Compressor, NoneCompressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class _TensorFlowCasts:
    """How a cast kind sees and casts TensorFlow tensors."""

    @staticmethod
    def floating(tensor):
        return tensor.dtype.is_floating

    @classmethod
    def is_target(cls, tensor):
        return tensor.dtype == getattr(tf, cls.target)

    @classmethod
    def cast_to_target(cls, tensor):
        return tf.cast(tensor, getattr(tf, cls.target))

    @staticmethod
    def cast_back(tensor, dtype):
        return tf.cast(tensor, dtype)


class FP16Compressor(_TensorFlowCasts, kinds.FP16Compressor):
    __doc__ = kinds.FP16Compressor.__doc__


class BF16Compressor(_TensorFlowCasts, kinds.BF16Compressor):
    __doc__ = kinds.BF16Compressor.__doc__


class Compression:
    """Horovod's names: ``Compression.none``, ``Compression.fp16``; plus ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
