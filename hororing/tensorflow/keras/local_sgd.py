"""LocalSGD and DiLoCo for ``model.fit``: callbacks that talk every ``sync_every`` steps.

The model is compiled with its plain optimizer (not ``DistributedOptimizer``): between syncs
every rank steps on its own batches and nothing crosses the network. A step is one of the
optimizer's updates (its ``iterations``): with gradient accumulation a step is an update, and
with ``steps_per_execution`` k a sync due inside an execution runs at its end (callbacks run
only between executions).

    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=...)
    diloco = hvd.callbacks.DiLoCoCallback(
        keras.optimizers.SGD(0.8, momentum=0.5, nesterov=True), sync_every=50)
    model.fit(x_shard, y_shard, callbacks=[diloco])

- ``LocalSGDCallback``: every ``sync_every`` steps the trainable weights are averaged.
- ``DiLoCoCallback``: every ``sync_every`` steps (per fragment, staggered as
  ``hororing.periodic`` schedules them) the change each rank made since the last sync is
  averaged (in 16 bits, or as int8 rows with error feedback), and ``outer_optimizer`` steps
  the global weights with it as the gradient.

Both give every rank rank 0's weights when training first begins, and sync once more when it
ends (``sync_at_end``), so that ``evaluate`` and ``save`` see the ranks' consensus.
"""

import itertools

import numpy as np

from ... import collectives, ops
from ...compression import Compression as _ArrayCompression
from ...periodic import Schedule, check_every, check_fragments, check_sent, cut
from ...quantized import Int8Feedback, finish_average, start_average
from ..compression import Compression
from ._backend import keras

_INSTANCES = itertools.count()  # made in one order on every rank: names agree


class _Periodic(keras.callbacks.Callback):
    """The step count, the start from rank 0's weights, the sync at the end."""

    def __init__(self, sync_every, sync_at_end):
        super().__init__()
        check_every(sync_every)
        self.sync_every = sync_every
        self.sync_at_end = sync_at_end
        self.steps = 0
        self._variables = None
        self._prefix = f"{type(self).__name__.lower()}{next(_INSTANCES)}"

    def on_train_begin(self, logs=None):
        if self._variables is not None:
            return  # a later fit goes on from where the last one left
        variables = list(self.model.trainable_variables)
        if not variables:
            raise ValueError(f"{type(self).__name__} needs the model built before fit (give "
                             f"it its input shape, keras.Input), to start every rank from "
                             f"rank 0's weights")
        values = [np.array(variable.numpy()) for variable in variables]
        handles = [collectives.broadcast_async_(value, 0, name=f"{self._prefix}.start.{index}")
                   for index, value in enumerate(values)]
        for variable, value, handle in zip(variables, values, handles):
            collectives.synchronize(handle)
            variable.assign(value)
        self._variables = variables
        self.steps = int(self.model.optimizer.iterations.numpy())
        self._begin()

    def on_train_batch_end(self, batch, logs=None):
        done = int(self.model.optimizer.iterations.numpy())
        stepped, self.steps = range(self.steps + 1, done + 1), done
        self._after(stepped)

    def on_train_end(self, logs=None):
        if self.sync_at_end:
            self.sync_now()

    def _values(self, indices):
        return [np.array(self._variables[index].numpy()) for index in indices]

    def _begin(self):
        pass


class LocalSGDCallback(_Periodic):
    """Average the model's trainable weights over the ranks every ``sync_every`` steps.

    Args:
        sync_every: the optimizer's steps between averages (1: every step).
        sync_at_end: average once more when ``fit`` ends (unless it just did).
    """

    def __init__(self, sync_every, sync_at_end=True):
        super().__init__(sync_every, sync_at_end)
        self._averaged_at = 0

    def _after(self, stepped):
        if any(step % self.sync_every == 0 for step in stepped):
            self.sync_now()

    def sync_now(self):
        """Average the weights now, unless they were at this step."""
        if self._averaged_at == self.steps:
            return
        values = self._values(range(len(self._variables)))
        collectives.grouped_allreduce_(values, name=f"{self._prefix}.weights", op=ops.Average)
        for variable, value in zip(self._variables, values):
            variable.assign(value)
        self._averaged_at = self.steps


class DiLoCoCallback(_Periodic):
    """Every ``sync_every`` steps (per fragment) the averaged change since the last sync is the
    gradient of ``outer_optimizer``, which steps the global weights every rank goes on from.

    Args:
        outer_optimizer: a Keras optimizer for the outer steps (the paper's: SGD with
            momentum and Nesterov); it holds its own state over the trainable weights.
        sync_every: inner steps between two syncs of a fragment (H).
        fragments: how many fragments the weights are cut into (whole variables, balanced
            by size: ``hororing.periodic.cut``), each synced at its own step.
        compression: ``hvd.Compression.none``, ``.fp16`` or ``.bf16``: the averaged changes
            in 16 bits on the wire.
        sync_at_end: sync every fragment not synced at the last step when ``fit`` ends.
        int8: send each change as int8 with one scale per variable, gathered and averaged
            in rank order; what rounding takes from a rank's change is added to its next
            one (``hororing.quantized``). A quarter of float32's bytes; at 2 ranks half of
            16-bit's, level with it at 4, more beyond (the rows are gathered).
    """

    def __init__(self, outer_optimizer, sync_every, fragments=1,
                 compression=Compression.none, sync_at_end=True, int8=False):
        super().__init__(sync_every, sync_at_end)
        if not isinstance(outer_optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"DiLoCoCallback's outer optimizer must be a Keras optimizer, "
                            f"got {type(outer_optimizer).__name__}")
        compression = check_sent(compression, int8, Compression.none, Compression.fp16,
                                 Compression.bf16, "DiLoCoCallback", "hvd.Compression")
        kinds = {Compression.none: "none", Compression.fp16: "fp16", Compression.bf16: "bf16"}
        self._int8 = Int8Feedback() if int8 else None
        self.outer_optimizer = outer_optimizer
        self.compression = getattr(_ArrayCompression, kinds[compression])
        self._fragments = fragments
        self.fragments = self.schedule = self._global = None
        self._loaded = None  # a state to go on from when training begins

    def _begin(self):
        check_fragments(self._fragments, len(self._variables))
        self.fragments = cut([int(np.prod(variable.shape)) for variable in self._variables],
                             self._fragments)
        self.schedule = Schedule(self.sync_every, len(self.fragments))
        self.schedule.restore(self.steps)
        self._global = self._values(range(len(self._variables)))
        self.outer_optimizer.build(self._variables)
        state, self._loaded = self._loaded, None
        if state is not None:
            self._restore(state)

    def state_dict(self):
        """What the callback holds beside the model and its optimizer, as numpy arrays and
        ints: the global weights, the outer optimizer's variables, the step count, each
        fragment's last sync and, with int8, what rounding took from each change. Save it
        with the model (its weights and its optimizer) at a sync point (after
        ``sync_now()``, or a step where every fragment synced), where every rank's weights
        are the global ones. The inner optimizer's state, and with int8 the rounding's
        residuals, are each rank's own: saved and loaded per rank, the job goes on exactly
        as if never stopped; resumed from rank 0's files alone, from rank 0's."""
        if self._global is None:
            raise ValueError("DiLoCoCallback has no state before training begins: call "
                             "state_dict() after fit has started")
        state = {"global": [value.copy() for value in self._global], "steps": self.steps,
                 "synced_at": list(self.schedule.synced_at),
                 "outer": [np.array(variable.numpy())
                           for variable in self.outer_optimizer.variables]}
        if self._int8 is not None:
            state["residuals"] = self._int8.state_dict()
        return state

    def load_state_dict(self, state):
        """Go on from ``state`` (``state_dict``'s): when training begins, after the start
        from rank 0's weights, or at once where it has begun. The model's optimizer must be
        at the step the state was saved at (load it with the model)."""
        for key in ("global", "steps", "synced_at", "outer"):
            if key not in state:
                raise ValueError(f"a DiLoCoCallback state holds 'global', 'steps', "
                                 f"'synced_at' and 'outer'; this one lacks {key!r}")
        if self._global is None:
            self._loaded = state
        else:
            self._restore(state)

    def _restore(self, state):
        shapes = [tuple(variable.shape) for variable in self._variables]
        saved = [tuple(np.shape(value)) for value in state["global"]]
        if saved != shapes:
            raise ValueError(f"the state holds global weights of shapes {saved}, the model "
                             f"{shapes}")
        if state["steps"] != self.steps:
            raise ValueError(f"the state was saved after step {state['steps']}, and the "
                             f"model's optimizer is at step {self.steps}: load the "
                             f"optimizer's state with the model's (keras.models.load_model, "
                             f"or the optimizer's variables) before fit")
        outer = self.outer_optimizer.variables
        if len(state["outer"]) != len(outer):
            raise ValueError(f"the state holds {len(state['outer'])} outer optimizer "
                             f"variables, this outer optimizer {len(outer)}: give the "
                             f"callback the kind of optimizer it was saved with")
        self.schedule.restore(self.steps, state["synced_at"])
        self._global = [np.array(value, dtype=np.asarray(mine).dtype)
                        for value, mine in zip(state["global"], self._global)]
        for variable, value in zip(outer, state["outer"]):
            variable.assign(value)
        if self._int8 is not None:
            self._int8.load_state_dict(state.get("residuals", {}))

    def _after(self, stepped):
        due = sorted({index for step in stepped for index in self.schedule.due(step)})
        for index in due:
            self._sync(index)

    def sync_now(self):
        """Sync every fragment not synced at this step: every rank then holds the global
        weights."""
        for index in self.schedule.unsynced(self.steps):
            self._sync(index)

    def _sync(self, index):
        import tensorflow as tf
        self.schedule.synced(index, self.steps)
        members = self.fragments[index]
        started = [start_average(self._global[position] - value,
                                 f"{self._prefix}.fragment{index}.{position}",
                                 self.compression, self._int8, position)
                   for position, value in zip(members, self._values(members))]
        averaged = [finish_average(handle, how) for handle, how in started]
        variables = [self._variables[position] for position in members]
        for variable, position in zip(variables, members):
            variable.assign(self._global[position])
        self.outer_optimizer.apply_gradients(
            [(tf.constant(change, dtype=variable.dtype), variable)
             for change, variable in zip(averaged, variables)])
        for variable, position in zip(variables, members):
            self._global[position] = np.array(variable.numpy())
