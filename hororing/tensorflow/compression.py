"""Gradient compression for TensorFlow tensors: the kinds of ``hororing.compression`` (one
implementation each), with TensorFlow's dtype tests and casts."""

import tensorflow as tf

from ..compression import Compressor, FrameworkCasts, NoneCompressor, framework_kinds

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class _TensorFlowCasts(FrameworkCasts):
    dtype_of = staticmethod(tf.as_dtype)

    @staticmethod
    def is_floating(dtype):
        return dtype.is_floating

    cast = staticmethod(tf.cast)


FP16Compressor, BF16Compressor, Compression = framework_kinds(_TensorFlowCasts)
