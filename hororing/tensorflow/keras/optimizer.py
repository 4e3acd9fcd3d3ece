"""``DistributedOptimizer`` for Keras 3 optimizers (TensorFlow backend) and tf-keras ones.

Keras 3 applies gradients through ``apply(grads, variables)``, which clips them and updates
the variables, or, with ``gradient_accumulation_steps``, adds them to accumulators and
updates only every N-th call. The wrapper averages the gradients over ranks at the one
point every update passes through, just before clipping: each step when there is no
accumulation, and only on update steps when there is (``backward_passes_per_step`` is
Keras's own accumulation, so N-1 of N steps move no data). The optimizer is wrapped in
place: it stays an instance of its own class, so ``model.save`` and ``load_model`` see a
plain Keras optimizer, and no class is created at run time.

Horovod's wrapper also answers ``compute_gradients(loss, var_list, tape=None)`` with averaged
gradients; so does this one, and ``apply`` does not average what it returned a second time.
``register_local_var`` keeps a variable's gradient on its rank.

tf-keras optimizers (``TF_USE_LEGACY_KERAS=1``) are wrapped by tf_keras_optimizer.py.
"""

import threading

import keras
import tensorflow as tf

from ... import ops
from ...process_sets import global_process_set
from ...reducer import check_passes
from ..compression import Compression
from ..gradients import GradientReducer, local_layer_weights
from .tf_keras_optimizer import TfKerasHooks, is_tf_keras

_HOOKS = ("apply", "_backend_apply_gradients", "_clip_gradients")


def is_keras_optimizer(optimizer):
    return isinstance(optimizer, keras.optimizers.Optimizer) or is_tf_keras(optimizer)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=ops.Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True):
    """Average a Keras optimizer's gradients over all ranks before it applies them.

    Args:
        optimizer: a Keras 3 optimizer, not yet used (wrapped in place and returned).
        compression: ``Compression.none`` or ``Compression.fp16`` (sent as float16).
        sparse_as_dense: densify sparse (IndexedSlices) gradients before reducing.
        gradient_predivide_factor: with Average, divide before the sum by this factor and
            after it by ``size / factor``.
        op: Average (default) or Sum.
        backward_passes_per_step: apply (and reduce) every N-th call only, accumulating
            gradients locally in between (Keras's ``gradient_accumulation_steps``).
        average_aggregated_gradients: with N > 1, apply the mean of the N local gradients
            (True) or their sum (False, Horovod's default).
        groups: a number of groups to split the gradients into, or lists of variables
            whose gradients reduce together.
        process_set: average over this set's ranks only.

        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` by the number of ranks (they are not reduced).

    ``name``, ``device_*`` and ``num_groups`` are accepted for Horovod compatibility. The
    wrapped optimizer also gets Horovod's ``compute_gradients(loss, var_list, tape=None)``
    and ``register_local_var(variable)``.
    """
    if not is_keras_optimizer(optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 or tf-keras optimizer, got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}; for "
                        f"tf.compat.v1 optimizers use hororing.tensorflow.DistributedOptimizer")
    if getattr(optimizer, "_hororing", None) is not None:
        raise ValueError("this optimizer is already wrapped by DistributedOptimizer")
    if num_groups and groups is None:
        groups = num_groups
    steps = check_passes(backward_passes_per_step)
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                              groups, process_set, scale_local_gradients)
    if is_tf_keras(optimizer):
        TfKerasHooks(optimizer, reducer, steps, average_aggregated_gradients).install()
        return optimizer
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"hororing's Keras optimizer needs the TensorFlow backend, but "
                         f"KERAS_BACKEND is {keras.backend.backend()!r}; set "
                         f"KERAS_BACKEND=tensorflow (hororing.torch serves PyTorch models)")
    missing = [hook for hook in _HOOKS if not hasattr(type(optimizer), hook)]
    if missing:
        raise TypeError(f"{type(optimizer).__name__} lacks {missing}, which hororing wraps to "
                        f"average gradients; this Keras version ({keras.__version__}) is not "
                        f"supported")
    if steps > 1:
        if optimizer.built:
            raise ValueError("backward_passes_per_step > 1 needs an optimizer that has not been "
                             "used yet: wrap it before model.compile/fit or its first apply()")
        if optimizer.gradient_accumulation_steps not in (None, steps):
            raise ValueError(f"the optimizer already accumulates gradients over "
                             f"{optimizer.gradient_accumulation_steps} steps; pass "
                             f"backward_passes_per_step={optimizer.gradient_accumulation_steps} "
                             f"or leave gradient_accumulation_steps unset")
        optimizer.gradient_accumulation_steps = steps
    _Hooks(optimizer, reducer, steps, average_aggregated_gradients).install()
    return optimizer


class _Hooks:
    """The methods the wrapper puts on one Keras 3 optimizer instance."""

    def __init__(self, optimizer, reducer, steps, average_aggregated):
        self.optimizer = optimizer
        self.reducer = reducer
        self.steps = steps
        # Keras divides the accumulated sum by N; Horovod's default applies the sum
        self.rescale = 1.0 if average_aggregated or steps == 1 else float(steps)
        self.original = {hook: getattr(optimizer, hook) for hook in _HOOKS}
        self.state = threading.local()

    def install(self):
        optimizer = self.optimizer
        object.__setattr__(optimizer, "_hororing", self)
        object.__setattr__(optimizer, "apply", self.apply)
        object.__setattr__(optimizer, "_backend_apply_gradients", self.backend_apply)
        object.__setattr__(optimizer, "_clip_gradients", self.clip)
        object.__setattr__(optimizer, "compute_gradients", self.compute_gradients)
        object.__setattr__(optimizer, "_compute_gradients", self._compute_gradients)
        object.__setattr__(optimizer, "register_local_var", self.reducer.register_local)

    def compute_gradients(self, loss, var_list, tape=None):
        """Horovod's ``compute_gradients``: (gradient, variable) pairs of ``loss`` (a tensor
        recorded by ``tape``, or a function of no arguments), averaged over ranks. With
        ``backward_passes_per_step`` > 1 they stay local: Keras accumulates them and the
        sum is averaged when it is applied."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        variables = list(var_list() if callable(var_list) else var_list)
        if tape is None:
            if not callable(loss):
                raise ValueError("compute_gradients needs the tape that recorded loss, or "
                                 "loss as a function of no arguments")
            with tf.GradientTape() as tape:  # watches the trainable variables loss reads
                loss = loss()
        elif callable(loss):
            with tape:
                loss = loss()
        grads = tape.gradient(loss, variables, output_gradients=grad_loss)
        if self.steps == 1:
            grads = self.reducer.reduce(grads, variables)
            self.state.prereduced = {id(grad) for grad in grads if grad is not None}
        return list(zip(grads, variables))

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        prereduced = getattr(self.state, "prereduced", set())
        self.state.prereduced = set()
        # gradients compute_gradients returned are averaged already: never twice
        self.state.skip = bool(prereduced) and all(grad is None or id(grad) in prereduced
                                                   for grad in grads)
        self.state.reduced = False
        result = self.original["apply"](grads, trainable_variables)
        if self.steps == 1 and not self.state.reduced and any(g is not None for g in grads):
            raise RuntimeError(f"the gradients were applied without passing through "
                               f"hororing's reduction; this Keras version ({keras.__version__})"
                               f" changed how optimizers apply gradients and is not supported")
        return result

    def backend_apply(self, grads, trainable_variables):
        self.state.variables = list(trainable_variables)
        return self.original["_backend_apply_gradients"](grads, trainable_variables)

    def clip(self, grads):
        if not getattr(self.state, "skip", False):
            grads = self.reducer.reduce(grads, getattr(self.state, "variables", None))
            if self.rescale != 1.0:
                grads = [None if grad is None else grad * self.rescale for grad in grads]
        self.state.reduced = True
        return self.original["_clip_gradients"](grads)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=ops.Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A DistributedOptimizer that keeps the gradients of ``local_layers``' weights on each rank.

    Args:
        local_layers: a Keras layer or a list of them; their trainable weights are registered
            with ``register_local_var`` (not reduced; divided by the number of ranks when
            ``scale_local_gradients``, as Horovod does).
        The other arguments are DistributedOptimizer's.
    """
    weights = local_layer_weights(local_layers)
    optimizer = DistributedOptimizer(
        optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    for variable in weights:
        optimizer.register_local_var(variable)
    return optimizer
