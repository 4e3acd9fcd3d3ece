"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are averaged over ranks."""

import tensorflow as tf

from .. import ops
from ..process_sets import global_process_set
from .compression import Compression
from .gradients import GradientReducer, local_layer_weights


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
                                        gradient_predivide_factor, groups, process_set,
                                        scale_local_gradients)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._tape.__exit__(*exc_info)

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def register_local_source(self, source):
        """Keep ``source``'s gradient local: it is not reduced across ranks (but divided by
        the number of ranks when ``scale_local_gradients``, as Horovod does)."""
        self._reducer.register_local(source)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """The wrapped tape's gradients, averaged over ranks (same structure as ``sources``)."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False) if grads is not None else []
        if len(flat_grads) != len(flat_sources):  # a single source gives a single gradient
            flat_grads = [grads]
        reduced = self._reducer.reduce(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(sources, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, **kwargs):
        """Return ``(local, global)``: lists of (variable, gradient) pairs, in the order of
        ``sources``, for the variables kept local and those averaged over ranks."""
        sources = list(sources)
        grads = self.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        local, shared = [], []
        for source, grad in zip(sources, grads):
            (local if self._reducer.is_local(source) else shared).append((source, grad))
        return local, shared


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
    weights = local_layer_weights(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for variable in weights:
        tape.register_local_source(variable)
    return tape
