"""``DistributedOptimizer`` for tf-keras optimizers (``TF_USE_LEGACY_KERAS=1``, Keras 2).

tf-keras trains through ``minimize``: ``compute_gradients`` (``_compute_gradients`` for its
``optimizers.legacy`` classes), then ``apply_gradients``. As in Horovod, the gradients are
averaged as ``compute_gradients`` returns them; gradients computed elsewhere (a plain
``tf.GradientTape``) are averaged on their way into ``apply_gradients`` instead, never twice.
With ``backward_passes_per_step`` N > 1 the passes are summed locally and reduced and applied
every N-th one (aggregation.py, ``optimizer._agg_helper``). The optimizer is wrapped in place:
it stays an instance of its own class.
"""

import threading

from ..aggregation import LocalGradientAggregation

_ORIGINALS = ("apply_gradients", "compute_gradients", "_compute_gradients")


def is_tf_keras(optimizer):
    """True for an optimizer built on tf-keras's classes (a user's subclass included)."""
    return (any(cls.__module__.startswith("tf_keras.") for cls in type(optimizer).__mro__)
            and callable(getattr(optimizer, "apply_gradients", None)))


class TfKerasHooks:
    """The methods the wrapper puts on one tf-keras optimizer instance."""

    def __init__(self, optimizer, reducer, steps, average_aggregated):
        self.optimizer = optimizer
        self.reducer = reducer
        self.aggregation = (LocalGradientAggregation(steps, average_aggregated, reducer.reduce)
                            if steps > 1 else None)
        self.original = {name: getattr(optimizer, name, None) for name in _ORIGINALS}
        self.state = threading.local()  # the gradients this wrapper returned, already reduced

    def install(self):
        optimizer = self.optimizer
        object.__setattr__(optimizer, "_hororing", self)
        object.__setattr__(optimizer, "_agg_helper", self.aggregation)
        object.__setattr__(optimizer, "apply_gradients", self.apply_gradients)
        object.__setattr__(optimizer, "compute_gradients", self.compute_gradients)
        object.__setattr__(optimizer, "_compute_gradients", self._compute_gradients)
        object.__setattr__(optimizer, "register_local_var", self.reducer.register_local)

    def compute_gradients(self, loss, var_list, tape=None):
        """The wrapped optimizer's (gradient, variable) pairs, gradients averaged over ranks."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        if self.original["_compute_gradients"] is not None:  # optimizers.legacy classes
            pairs = self.original["_compute_gradients"](loss, var_list=var_list,
                                                        grad_loss=grad_loss, tape=tape)
        else:
            pairs = self.original["compute_gradients"](loss, var_list, tape=tape)
        pairs = list(pairs)
        variables = [variable for _, variable in pairs]
        grads = self._reduce([grad for grad, _ in pairs], variables)
        self.state.reduced = {id(grad) for grad in grads if grad is not None}
        return list(zip(grads, variables))

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """Apply averaged gradients (every N-th call with ``backward_passes_per_step`` N)."""
        pairs = list(grads_and_vars)
        grads = [grad for grad, _ in pairs]
        variables = [variable for _, variable in pairs]
        reduced = getattr(self.state, "reduced", set())
        if not all(grad is None or id(grad) in reduced for grad in grads):
            grads = self._reduce(grads, variables)  # computed elsewhere: average them here
        self.state.reduced = set()
        pairs = list(zip(grads, variables))

        def apply():
            return self.original["apply_gradients"](pairs, *args, **kwargs)
        if self.aggregation is None:
            return apply()
        return self.aggregation.apply_gradients(apply, grads, self.optimizer.iterations)

    def _reduce(self, grads, variables):
        if self.aggregation is not None:
            return self.aggregation.compute_gradients(grads, variables)
        return self.reducer.reduce(grads, variables)
