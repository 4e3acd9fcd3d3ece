"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are averaged over ranks."""

import tensorflow as tf

from .. import ops
from ..process_sets import global_process_set, group_of
from .compression import Compression
from .gradients import GradientReducer


class DistributedGradientTape:
    """Wrap a ``tf.GradientTape``: ``gradient()`` returns gradients averaged over all ranks.

    Every other attribute is the wrapped tape's, and it can be used as a context manager::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    The gradients reduce in one fused exchange (per group, see ``groups``).
    ``register_local_source(variable)`` keeps a variable's gradient local (scaled by
    ``1/size`` when ``scale_local_gradients``). ``device_*`` and ``num_groups`` are accepted
    for Horovod compatibility.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=ops.Average, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, process_set=global_process_set,
                 scale_local_gradients=True):
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got "
                            f"{type(gradtape).__name__}")
        if num_groups and groups is None:
            groups = num_groups
        self._tape = gradtape
        self._reducer = GradientReducer(compression, sparse_as_dense, op,
                                        gradient_predivide_factor, groups, process_set)
        self._process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources = set()

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._tape.__exit__(*exc_info)

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def register_local_source(self, source):
        """Keep ``source``'s gradient local: it is not reduced across ranks."""
        self._local_sources.add(id(source))

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """The wrapped tape's gradients, averaged over ranks (same structure as ``sources``)."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False) if grads is not None else []
        if len(flat_grads) != len(flat_sources):  # a single source gives a single gradient
            flat_grads = [grads]
        shared = [index for index, source in enumerate(flat_sources)
                  if id(source) not in self._local_sources]
        reduced = self._reducer.reduce([flat_grads[index] for index in shared],
                                       [flat_sources[index] for index in shared])
        result = list(flat_grads)
        for index, grad in zip(shared, reduced):
            result[index] = grad
        if self.scale_local_gradients and self._local_sources:
            size = float(group_of(self._process_set).size)
            for index, source in enumerate(flat_sources):
                if id(source) in self._local_sources and result[index] is not None:
                    result[index] = _divide(result[index], size)
        return tf.nest.pack_sequence_as(sources, result)


def _divide(grad, size):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape)
    return grad / size


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=ops.Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A DistributedGradientTape that keeps the gradients of ``local_layers``' weights local.

    Args:
        local_layers: a Keras layer or a list of them (their trainable weights' gradients are
            not reduced across ranks).
    """
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    for layer in local_layers:
        if not hasattr(layer, "trainable_weights"):
            raise ValueError(f"local_layers must be Keras layers, got {type(layer).__name__}")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape
