"""Horovod's Keras callbacks, for ``model.fit`` (Keras 3, or tf-keras with TF_USE_LEGACY_KERAS=1)."""

import numpy as np

from ... import collectives as core
from ...context import current
from ..functions import broadcast_variables
from ._backend import keras, keras_session


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Give every rank ``root_rank``'s model and optimizer variables.

    A model built before ``fit`` is broadcast when training begins, so every rank takes its
    first step from the same weights and training equals single-process training with the
    combined batch from the first step on. A model that Keras builds on its first batch (a
    ``Sequential`` without an input shape, a subclassed model) has no variables until then:
    they, and the optimizer's slots, which most optimizers also create on the first step,
    are broadcast at the end of the first batch, as Horovod's callback does. From there on
    every rank holds root's values. In a TF1 graph (tf-keras with v2 behaviour disabled) the
    broadcast runs in Keras's session.

    ``local_variables`` (or ``register_local_var``) exempts variables, which keep each
    rank's own values.
    """

    def __init__(self, root_rank=0, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local = set()
        self._sent = set()  # ids of the variables broadcast so far
        for variable in local_variables or ():
            self.register_local_var(variable)

    def register_local_var(self, variable):
        """Leave ``variable`` as each rank has it."""
        self._local.add(id(variable))

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self._broadcast_new()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast_new()
            self.broadcast_done = True

    def _broadcast_new(self):
        """Broadcast the variables that exist now and were not broadcast before.

        Every rank builds the same model, so every rank finds the same new variables.
        """
        variables = [variable for variable in existing_variables(self.model)
                     if id(variable) not in self._local and id(variable) not in self._sent]
        self._sent.update(id(variable) for variable in variables)
        if variables:
            run_in_keras_session(broadcast_variables(variables, root_rank=self.root_rank))


def existing_variables(model):
    """The variables ``model`` and its optimizer hold so far, in a fixed order.

    A model Keras builds on its first batch has none before it (Keras 3 gives an empty list,
    tf-keras raises); an optimizer creates its slots when it first applies gradients. Keras
    3's gradient accumulators (``backward_passes_per_step``) are left out: they hold each
    rank's own gradients until the update step reduces them.
    """
    variables = []
    if getattr(model, "built", True):
        try:
            variables = list(model.variables)
        except ValueError:  # tf-keras: "Weights for model ... have not yet been created"
            variables = []
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:  # tf-keras's legacy optimizers give them by a method
        held = optimizer.variables
        local = {id(variable) for variable in getattr(optimizer, "_accumulated_gradients", ())}
        variables += [variable for variable in (held() if callable(held) else held)
                      if id(variable) not in local]
    return variables


def run_in_keras_session(operation):
    """Run ``operation`` (a graph op, or None when it already ran eagerly) in Keras's session."""
    if operation is not None:
        keras_session().run(operation)


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics over ranks, so every rank logs (and checkpoints on) the same.

    Put it before callbacks that read the metrics (checkpointing, early stopping, logging).
    """

    def __init__(self, device=""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(name for name, value in logs.items() if np.ndim(value) == 0)
        values = np.array([float(logs[name]) for name in names], dtype=np.float64)
        averaged = core.allreduce(values, name=f"hororing.metric_average.{len(names)}")
        for name, value in zip(names, averaged.tolist()):
            logs[name] = value


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``.

    Args:
        multiplier: a number (``multiplier ** (epoch - start_epoch)``) or a function of the
            (fractional, when ``staircase=False``) epoch.
        staircase: change once per epoch (True) or every batch.
        steps_per_epoch: batches per epoch, needed with ``staircase=False`` when ``fit``
            cannot tell.
        momentum_correction: accepted for Horovod compatibility; Keras 3 compiles the
            momentum into the training step, so it is not adjusted.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required")
        self.initial_lr = float(initial_lr)
        self.multiplier = (multiplier if callable(multiplier)
                           else lambda epoch: multiplier ** (epoch - start_epoch))
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = batches_per_epoch(self.params or {})
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__} cannot tell the number of batches per "
                                 f"epoch (fit was given neither steps_per_epoch nor arrays of "
                                 f"known length); pass steps_per_epoch=...")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set(self.initial_lr * self.multiplier(epoch))
        else:
            self._set(self.initial_lr * self.multiplier(epoch + batch / self.steps_per_epoch))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = _value(self.model.optimizer.learning_rate)

    def _set(self, value):
        optimizer = self.model.optimizer
        if isinstance(getattr(optimizer, "_learning_rate", None),
                      keras.optimizers.schedules.LearningRateSchedule):
            raise ValueError("the optimizer's learning rate is a LearningRateSchedule; give it a "
                             "float learning rate to use a hororing learning-rate callback")
        optimizer.learning_rate = value


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    Large-batch training (Goyal et al.): start at the single-process rate and reach the
    size-scaled ``initial_lr`` at the end of the warmup, batch by batch.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        size = current().size

        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            return (epoch * (size - 1) / warmup_epochs + 1) / size
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose and current().rank == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_value(self.model.optimizer.learning_rate):g}.")


def batches_per_epoch(params):
    """The batches in one epoch of ``fit``, from its ``params``, or None where it cannot tell.

    ``fit`` gives ``steps`` (Keras 3 always; tf-keras with ``steps_per_epoch`` or a dataset of
    known length); a TF1 tf-keras ``fit`` on arrays gives ``samples`` and ``batch_size``.
    """
    if params.get("steps"):
        return params["steps"]
    if params.get("samples") and params.get("batch_size"):
        return -(-params["samples"] // params["batch_size"])  # the last batch may be short
    return None


def _value(variable):
    """A number held by a variable, a tensor or a float, eager or in a TF1 graph."""
    if hasattr(keras.backend, "get_value"):  # tf-keras: reads through the session in a graph
        return float(keras.backend.get_value(variable))
    return float(keras.ops.convert_to_numpy(variable))


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the model when ``monitor`` improves, from rank 0 only.

    Pair it with MetricAverageCallback (before it in the list) so the decision uses the
    metric averaged over ranks.
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0, mode="auto", save_freq="epoch"):
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=False, mode=mode, save_freq=save_freq)

    def _save_model(self, *args, **kwargs):
        if current().rank == 0:
            return super()._save_model(*args, **kwargs)
        return None


from .local_sgd import DiLoCoCallback, LocalSGDCallback  # noqa: E402,F401  (hvd.callbacks.*)
