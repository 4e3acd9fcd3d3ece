"""``DistributedOptimizer`` for Keras 3 optimizers (TensorFlow backend) and tf-keras ones.

Keras 3 applies gradients through ``apply(grads, variables)``, which clips them and updates
the variables, or, with ``gradient_accumulation_steps``, adds them to accumulators and
updates only every N-th call. The wrapper averages the gradients over ranks at the one
point every update passes through, just before clipping: each step when there is no
accumulation, and only on update steps when there is (``backward_passes_per_step`` is
Keras's own accumulation, so N-1 of N steps move no data). The optimizer is wrapped in
place: it stays an instance of its own class, so ``model.save`` and ``load_model`` see a
plain Keras optimizer, and no class is created at run time.

tf-keras optimizers (``TF_USE_LEGACY_KERAS=1``) apply through ``apply_gradients``, which
clips inside: the wrapper averages the gradients on their way in.
"""

import threading

import keras

from ... import ops
from ...process_sets import global_process_set
from ..compression import Compression
from ..gradients import GradientReducer

_HOOKS = ("apply", "_backend_apply_gradients", "_clip_gradients")


def is_keras_optimizer(optimizer):
    return isinstance(optimizer, keras.optimizers.Optimizer) or _is_tf_keras(optimizer)


def _is_tf_keras(optimizer):
    return (type(optimizer).__module__.startswith("tf_keras.")
            and callable(getattr(optimizer, "apply_gradients", None)))


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

    ``name``, ``device_*``, ``num_groups`` and ``scale_local_gradients`` are accepted for
    Horovod compatibility.
    """
    if not is_keras_optimizer(optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 or tf-keras optimizer, got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}; for "
                        f"tf.compat.v1 optimizers use hororing.tensorflow.DistributedOptimizer")
    if getattr(optimizer, "_hororing", None) is not None:
        raise ValueError("this optimizer is already wrapped by DistributedOptimizer")
    if num_groups and groups is None:
        groups = num_groups
    if _is_tf_keras(optimizer):
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step > 1 needs a Keras 3 optimizer (Keras's "
                             "gradient accumulation); tf-keras optimizers have none")
        reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                                  groups, process_set)
        _TfKerasHook(optimizer, reducer).install()
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
    steps = backward_passes_per_step
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {steps!r}")
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
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                              groups, process_set)
    _Hooks(optimizer, reducer, steps, average_aggregated_gradients).install()
    return optimizer


class _Hooks:
    """The three bound methods the wrapper puts on one optimizer instance."""

    def __init__(self, optimizer, reducer, steps, average_aggregated):
        self.optimizer = optimizer
        self.reducer = reducer
        self.steps = steps
        # Keras divides the accumulated sum by N; Horovod's default applies the sum
        self.rescale = 1.0 if average_aggregated or steps == 1 else float(steps)
        self.original = {hook: getattr(optimizer, hook) for hook in _HOOKS}
        self.state = threading.local()

    def install(self):
        object.__setattr__(self.optimizer, "_hororing", self)
        object.__setattr__(self.optimizer, "apply", self.apply)
        object.__setattr__(self.optimizer, "_backend_apply_gradients", self.backend_apply)
        object.__setattr__(self.optimizer, "_clip_gradients", self.clip)

    def apply(self, grads, trainable_variables=None):
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
        grads = self.reducer.reduce(grads, getattr(self.state, "variables", None))
        if self.rescale != 1.0:
            grads = [None if grad is None else grad * self.rescale for grad in grads]
        self.state.reduced = True
        return self.original["_clip_gradients"](grads)


class _TfKerasHook:
    """tf-keras: average the gradients on their way into ``apply_gradients``."""

    def __init__(self, optimizer, reducer):
        self.optimizer = optimizer
        self.reducer = reducer
        self.original = optimizer.apply_gradients

    def install(self):
        object.__setattr__(self.optimizer, "_hororing", self)
        object.__setattr__(self.optimizer, "apply_gradients", self.apply_gradients)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        pairs = list(grads_and_vars)
        grads = self.reducer.reduce([grad for grad, _ in pairs], [var for _, var in pairs])
        return self.original(list(zip(grads, [var for _, var in pairs])), *args, **kwargs)
