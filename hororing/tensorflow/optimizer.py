"""``DistributedOptimizer`` for TensorFlow: tf.compat.v1 optimizers here, Keras ones in keras/."""

import tensorflow as tf

from .. import ops
from ..process_sets import global_process_set
from ..reducer import check_passes
from .compression import Compression
from .aggregation import LocalGradientAggregation
from .gradients import GradientReducer


class _DistributedV1Optimizer(tf.compat.v1.train.Optimizer):
    """A tf.compat.v1 optimizer whose ``compute_gradients`` (so ``minimize``) averages over
    ranks, in a TF1 graph or eagerly.

    With ``backward_passes_per_step`` N > 1 the gradients of N passes are summed locally
    (aggregation.py) and averaged and applied on the N-th; on the passes in between
    ``apply_gradients`` only adds one to ``global_step``, as Horovod's does.
    ``register_local_var`` keeps a variable's gradient on its rank.
    """

    def __init__(self, optimizer, reducer, name=None, use_locking=False, steps=1,
                 average_aggregated=False):
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}",
                         use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer
        self._aggregation = (LocalGradientAggregation(steps, average_aggregated, reducer.reduce)
                             if steps > 1 else None)
        self._agg_helper = self._aggregation  # Horovod's name for it

    def register_local_var(self, variable):
        """Keep ``variable``'s gradient on its rank (divided by the number of ranks)."""
        self._reducer.register_local(variable)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's (gradient, variable) pairs, gradients averaged over ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        variables = [var for _, var in pairs]
        grads = [grad for grad, _ in pairs]
        if self._aggregation is not None:
            grads = self._aggregation.compute_gradients(grads, variables)
        else:
            grads = self._reducer.reduce(grads, variables)
        return list(zip(grads, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Apply the (averaged) gradients; with ``backward_passes_per_step`` N, every N-th call."""
        pairs = list(grads_and_vars)
        if self._aggregation is None:
            return self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)
        return self._aggregation.apply_gradients(
            lambda: self._optimizer.apply_gradients(pairs, global_step=global_step, name=name),
            [grad for grad, _ in pairs], global_step)

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
    ``minimize``) reduces, in a TF1 graph or eagerly. ``backward_passes_per_step`` N > 1
    applies every N-th pass the sum (or with ``average_aggregated_gradients`` the mean) of N
    passes' gradients. ``scale_local_gradients`` divides the gradients of variables given to
    ``register_local_var`` by the number of ranks. ``device_*`` and ``use_locking`` are
    accepted for Horovod compatibility.
    """
    if num_groups and groups is None:
        groups = num_groups
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        steps = check_passes(backward_passes_per_step)
        reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                                  groups, process_set, scale_local_gradients)
        return _DistributedV1Optimizer(optimizer, reducer, name, use_locking, steps,
                                       average_aggregated_gradients)
    from .keras import optimizer as keras_optimizer  # imports Keras only when one is wrapped
    if keras_optimizer.is_keras_optimizer(optimizer):
        return keras_optimizer.DistributedOptimizer(
            optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
    raise TypeError(f"DistributedOptimizer wraps a Keras optimizer or a "
                    f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}")
