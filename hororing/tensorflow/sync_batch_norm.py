"""``SyncBatchNormalization``: batch normalization whose training statistics span all ranks."""

import keras
import tensorflow as tf

from .. import ops
from .mpi_ops import grouped_allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """A Keras BatchNormalization layer that, in training, normalizes with the mean and
    variance of the whole global batch (every rank's samples), as one large batch would.

    Each rank's count, sum and sum of squares are summed over ranks in one exchange per
    call, and gradients flow back through that sum. Inference uses the moving statistics,
    which are then the same on every rank. Every rank must call the layer in training
    together. Masks are not supported.
    """

    def _moments(self, inputs, mask):
        if mask is not None:
            raise ValueError("SyncBatchNormalization does not support masks")
        compute = tf.float32 if inputs.dtype in (tf.float16, tf.bfloat16) else inputs.dtype
        values = tf.cast(inputs, compute)
        count = tf.cast(tf.size(values) // tf.size(tf.reduce_sum(values, self._reduction_axes)),
                        compute)
        total = tf.reduce_sum(values, self._reduction_axes)
        squares = tf.reduce_sum(tf.square(values), self._reduction_axes)
        count, total, squares = grouped_allreduce([tf.reshape(count, [1]), total, squares],
                                                  op=ops.Sum)
        mean = total / count
        variance = tf.maximum(squares / count - tf.square(mean), 0.0)
        return mean, variance
