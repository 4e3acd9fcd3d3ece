"""``SyncBatchNormalization``: batch normalization whose training statistics span all ranks.

It subclasses the BatchNormalization of the Keras that ``tf.keras`` is (Keras 3, or tf-keras
under ``TF_USE_LEGACY_KERAS=1``; keras/_backend.py): the two ask their subclasses for the
batch statistics through different methods, so each gets its own small class over one
exchange, ``_global_moments``.
"""

import tensorflow as tf

from .. import ops
from .keras._backend import keras, legacy_keras_requested
from .mpi_ops import grouped_allreduce

_DOC = """A Keras BatchNormalization layer that, in training, normalizes with the mean and
    variance of the whole global batch (every rank's samples), as one large batch would.

    Each rank's count, sum and sum of squares are summed over ranks in one exchange per
    call, and gradients flow back through that sum. Inference uses the moving statistics,
    which are then the same on every rank. Every rank must call the layer in training
    together. ``fused`` (Horovod's and Keras 2's switch for the fused kernel) is accepted
    and ignored: the statistics come from an exchange.
    """


def _global_moments(inputs, axes, keepdims=False):
    """The mean and variance of ``inputs`` over ``axes`` and over every rank's batch."""
    compute = tf.float32 if inputs.dtype in (tf.float16, tf.bfloat16) else inputs.dtype
    values = tf.cast(inputs, compute)
    total = tf.reduce_sum(values, axes, keepdims=keepdims)
    count = tf.cast(tf.size(values) // tf.size(total), compute)
    squares = tf.reduce_sum(tf.square(values), axes, keepdims=keepdims)
    count, total, squares = grouped_allreduce([tf.reshape(count, [1]), total, squares],
                                              op=ops.Sum)
    mean = total / count
    variance = tf.maximum(squares / count - tf.square(mean), 0.0)
    return mean, variance


if legacy_keras_requested():
    class SyncBatchNormalization(keras.layers.BatchNormalization):
        __doc__ = _DOC

        def __init__(self, *args, fused=None, **kwargs):
            super().__init__(*args, fused=False, **kwargs)  # the fused kernel skips _moments

        def _moments(self, inputs, reduction_axes, keep_dims, mask=None):
            if mask is not None:
                raise ValueError("SyncBatchNormalization does not support masks")
            mean, variance = _global_moments(inputs, reduction_axes, keep_dims)
            return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
else:
    class SyncBatchNormalization(keras.layers.BatchNormalization):
        __doc__ = _DOC

        def __init__(self, *args, fused=None, **kwargs):
            super().__init__(*args, **kwargs)

        def _moments(self, inputs, mask):
            if mask is not None:
                raise ValueError("SyncBatchNormalization does not support masks")
            return _global_moments(inputs, self._reduction_axes)
