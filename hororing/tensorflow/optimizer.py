"""``DistributedOptimizer`` for TensorFlow: tf.compat.v1 optimizers here, Keras ones in keras/."""

import tensorflow as tf

from .. import ops
from ..process_sets import global_process_set
from .compression import Compression
from .gradients import GradientReducer


class _DistributedV1Optimizer(tf.compat.v1.train.Optimizer):
    """A tf.compat.v1 optimizer whose ``compute_gradients`` averages over ranks."""

    def __init__(self, optimizer, reducer, name=None, use_locking=False):
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}",
                         use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's (gradient, variable) pairs, gradients averaged over ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads = self._reducer.reduce([grad for grad, _ in pairs], [var for _, var in pairs])
        return list(zip(grads, [var for _, var in pairs]))

    def apply_gradients(self, *args, **kwargs):
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=ops.Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True):
    """Wrap an optimizer so that its gradients are averaged over all ranks before it applies them.

    A Keras optimizer is wrapped as ``hororing.keras.DistributedOptimizer`` does; a
    ``tf.compat.v1.train.Optimizer`` gets a wrapper whose ``compute_gradients`` (and so
    ``minimize``) reduces. ``device_*``, ``use_locking`` and ``scale_local_gradients`` are
    accepted for Horovod compatibility.
    """
    if num_groups and groups is None:
        groups = num_groups
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step > 1 is supported for Keras optimizers; "
                             "for a tf.compat.v1 optimizer accumulate gradients yourself")
        reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                                  groups, process_set)
        return _DistributedV1Optimizer(optimizer, reducer, name, use_locking)
    from .keras import optimizer as keras_optimizer  # imports Keras only when one is wrapped
    if keras_optimizer.is_keras_optimizer(optimizer):
        return keras_optimizer.DistributedOptimizer(
            optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, groups=groups,
            process_set=process_set)
    raise TypeError(f"DistributedOptimizer wraps a Keras optimizer or a "
                    f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}")
