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
    """

    def __init__(self, compression=Compression.none, sparse_as_dense=False, op=ops.Average,
                 gradient_predivide_factor=1.0, groups=None, process_set=global_process_set):
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

    def reduce(self, grads, variables=None):
        """Return the averaged gradients, in order (None where the gradient is None).

        Over a set of one rank the average is the gradient itself: nothing is exchanged, so
        a one-process run costs what plain TensorFlow does.
        """
        grads = [tf.convert_to_tensor(grad) if self.sparse_as_dense and
                 isinstance(grad, tf.IndexedSlices) else grad for grad in grads]
        if group_of(self.process_set).size == 1:
            return grads
        reduced = list(grads)
        dense = []
        for index, grad in enumerate(grads):
            if grad is None:
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
