"""``hvd.elastic`` for Keras: ``KerasState``, ``run`` and the three state callbacks."""

from ...elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run_fn
from ..elastic import TensorFlowKerasState, run
from ._backend import keras

__all__ = ["CommitStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt", "KerasState",
           "ObjectState", "State", "TensorFlowKerasState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run", "run_fn"]


class KerasState(TensorFlowKerasState):
    """State of a Keras model and optimizer (Horovod's ``hvd.elastic.KerasState``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        **kwargs: plain Python objects to keep too (``epoch``, ``batch``...), as attributes.
    """

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of each epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the last finished batch of the epoch (0 after an epoch), and
    shorten a resumed epoch by the batches it already did."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        steps = self.params.get("steps") if self.params else None
        if steps:
            if self.steps_per_epoch is None:
                self.steps_per_epoch = steps
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` as the number of epochs finished, counted across relaunches."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
