"""Horovod's Keras callbacks, for ``model.fit`` (Keras 3, or tf-keras with TF_USE_LEGACY_KERAS=1)."""

import numpy as np

from ... import collectives as core
from ...context import current
from ..functions import broadcast_variables
from ._backend import keras


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Give every rank ``root_rank``'s model and optimizer variables when training begins.

    Broadcasting before the first step (not after it, as Horovod's callback does) means every
    rank starts from the same weights, so training equals single-process training with the
    combined batch from the first step on. ``local_variables`` (or ``register_local_var``)
    exempts variables, which keep each rank's own values.
    """

    def __init__(self, root_rank=0, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local = set()
        for variable in local_variables or ():
            self.register_local_var(variable)

    def register_local_var(self, variable):
        """Leave ``variable`` as each rank has it."""
        self._local.add(id(variable))

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        variables = [variable for variable in self.model.variables if id(variable) not in self._local]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:  # tf-keras's legacy optimizers give them by a method
            held = optimizer.variables
            variables += list(held() if callable(held) else held)
        broadcast_variables(variables, root_rank=self.root_rank)
        self.broadcast_done = True


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
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__} cannot tell the number of batches per "
                                 f"epoch; pass steps_per_epoch=...")

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


def _value(variable):
    return float(np.asarray(variable.numpy() if hasattr(variable, "numpy") else variable))


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
