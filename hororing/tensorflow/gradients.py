"""Averaging a list of gradients across ranks: the step every TensorFlow wrapper shares.

Dense gradients go into one grouped allreduce (one op; the engine fuses them into as few
exchanges as its fusion threshold allows), sparse ones (``tf.IndexedSlices``) are gathered,
and None stays None. Used by DistributedGradientTape, the tf.compat.v1 DistributedOptimizer
and the Keras DistributedOptimizer.
"""

import tensorflow as tf

from .. import ops
from ..process_sets import global_process_set, group_of
from ..validate import resolve_op
from .compression import Compression
from .mpi_ops import allreduce, grouped_allreduce


class GradientReducer:
    """Horovod's gradient options, checked once; ``reduce(grads, variables)`` applies them.

    Args:
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: densify ``tf.IndexedSlices`` before reducing them.
        op: Average (default) or Sum.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        groups: None (one group), a number of groups, or a list of lists of variables
            whose gradients reduce together.
        process_set: average over this set's ranks only.
        scale_local_gradients: divide the gradients of local variables (``register_local``)
            by the set's size, as Horovod does, so they weigh as an averaged one would.
    """

    def __init__(self, compression=Compression.none, sparse_as_dense=False, op=ops.Average,
                 gradient_predivide_factor=1.0, groups=None, process_set=global_process_set,
                 scale_local_gradients=True):
        self.compression = compression
        self.sparse_as_dense = bool(sparse_as_dense)
        self.op = resolve_op(op, allowed=(ops.Average, ops.Sum))
        if gradient_predivide_factor != 1.0 and self.op != ops.Average:
            raise ValueError("gradient_predivide_factor only applies with op=Average")
        self.predivide = float(gradient_predivide_factor)
        if groups is not None and not (isinstance(groups, list) or
                                       (isinstance(groups, int) and groups > 0)):
            raise ValueError(f"groups must be a positive int or a list of lists of variables, "
                             f"got {groups!r}")
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local = set()  # ids of the variables whose gradients stay on their rank

    def register_local(self, variable):
        """Keep ``variable``'s gradient on its rank: it is not reduced (but scaled, see above)."""
        self._local.add(id(variable))

    def is_local(self, variable):
        return id(variable) in self._local

    def reduce(self, grads, variables=None):
        """Return the averaged gradients, in order (None where the gradient is None).

        Over a set of one rank the average is the gradient itself: nothing is exchanged, so
        a one-process run costs what plain TensorFlow does. A rank outside the process set
        keeps its own gradients (as in Horovod). The gradients of local variables are not
        exchanged.
        """
        grads = [tf.convert_to_tensor(grad) if self.sparse_as_dense and
                 isinstance(grad, tf.IndexedSlices) else grad for grad in grads]
        if self.process_set.included() is False:
            return grads
        size = group_of(self.process_set).size
        if size == 1:
            return grads
        local = set()
        if self._local and variables is not None:
            local = {index for index, variable in enumerate(variables) if self.is_local(variable)}
        reduced = list(grads)
        dense = []
        for index, grad in enumerate(grads):
            if grad is None:
                continue
            if index in local:
                if self.scale_local_gradients:
                    reduced[index] = _divide(grad, float(size))
                continue
            if isinstance(grad, tf.IndexedSlices):
                reduced[index] = allreduce(grad, op=self.op, process_set=self.process_set)
                continue
            dense.append((index, grad))
        for members in self._split(dense, variables):
            results = grouped_allreduce([grad for _, grad in members], op=self._wire_op(),
                                        compression=self.compression,
                                        prescale_factor=self._prescale(),
                                        postscale_factor=self._postscale(),
                                        process_set=self.process_set)
            for (index, _), result in zip(members, results):
                reduced[index] = result
        return reduced

    def _wire_op(self):
        return ops.Sum if self.predivide != 1.0 else self.op

    def _prescale(self):
        return 1.0 / self.predivide if self.predivide != 1.0 else 1.0

    def _postscale(self):
        if self.predivide == 1.0:
            return 1.0
        return self.predivide / group_of(self.process_set).size

    def _split(self, dense, variables):
        if not dense:
            return []
        if self.groups is None:
            return [dense]
        if isinstance(self.groups, int):
            count = min(self.groups, len(dense))
            return [dense[start::count] for start in range(count)]
        if variables is None:
            raise ValueError("groups given as lists of variables need the variables the "
                             "gradients belong to")
        group_of_variable = {}
        for number, members in enumerate(self.groups):
            for variable in members:
                group_of_variable[id(variable)] = number
        split = {}
        for index, grad in dense:
            key = group_of_variable.get(id(variables[index]), ("alone", index))
            split.setdefault(key, []).append((index, grad))
        return list(split.values())


def _divide(grad, size):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape)
    return grad / size


def local_layer_weights(local_layers):
    """The trainable weights of ``local_layers`` (a Keras layer, a list of them, or None).

    Raises:
        ValueError: an entry is not a Keras layer.
    """
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    for layer in local_layers:
        if not hasattr(layer, "trainable_weights"):
            raise ValueError(f"local_layers must be Keras layers, got {type(layer).__name__}")
    return [variable for layer in local_layers for variable in layer.trainable_weights]
