"""BroadcastGlobalVariablesCallback under tf-keras, eagerly or in a TF1 graph, for a model
built before fit and one Keras builds on its first batch, each rank seeded differently.

    python keras_broadcast.py eager|graph

Checks, on every rank, against values gathered from every rank and references computed here
with plain tf-keras (no hororing):
- after the first batch and at the end, every rank holds the same weights, bit for bit, and
  the same optimizer variables (momentum slots, iterations);
- a model built before fit trains as single-process large-batch training from rank 0's
  initial weights; a model built on its first batch does so from the weights every rank
  holds after that batch (the first step itself averaged gradients of different weights);
- eagerly, an elastic KerasState made before the first step (the optimizer's slots not yet
  created) restores after it;
- in the graph, LearningRateWarmupCallback derives the batches per epoch from arrays (no
  steps_per_epoch) and sets the rate through the session, batch by batch.
"""
import os
import sys

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"
MODE = sys.argv[1]
assert MODE in ("eager", "graph"), MODE

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if MODE == "graph":
    tf.compat.v1.disable_v2_behavior()

import hororing.keras as hvd  # noqa: E402

keras = tf.keras
assert keras.__name__.startswith("tf_keras"), keras.__name__
hvd.init()
rank, size = hvd.rank(), hvd.size()
ROWS, BATCH, FEATURES, EPOCHS, RATE = 12, 3, 5, 2, 0.05
STEPS = ROWS // BATCH
rng = np.random.default_rng(0)
x = rng.normal(size=(ROWS * size, FEATURES)).astype(np.float32)
y = rng.normal(size=(ROWS * size, 2)).astype(np.float32)
mine = slice(rank * ROWS, (rank + 1) * ROWS)


def global_order(first_step=0):
    """Rows of the global batches from ``first_step`` on: batch k is every rank's batch k."""
    return np.concatenate([np.arange(peer * ROWS + BATCH * step, peer * ROWS + BATCH * (step + 1))
                           for step in range(first_step, STEPS) for peer in range(size)])


def build(seed, lazy):
    if MODE == "graph":
        tf.compat.v1.set_random_seed(seed)
    else:
        tf.random.set_seed(seed)
    layers = [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)]
    return keras.Sequential(layers if lazy else [keras.Input((FEATURES,)), *layers])


def sgd(momentum):
    optimizers = keras.optimizers.legacy if MODE == "graph" else keras.optimizers
    return optimizers.SGD(RATE, momentum=momentum)


def optimizer_values(model):
    held = model.optimizer.variables
    variables = held() if callable(held) else held
    return [np.asarray(value) for value in keras.backend.batch_get_value(list(variables))]


def flat(arrays):
    return np.concatenate([np.ravel(array) for array in arrays])


def same_everywhere(what, values):
    everyone = hvd.allgather_object(flat(values))
    assert all(np.array_equal(other, everyone[0]) for other in everyone), f"ranks disagree: {what}"


class AfterFirstBatch(keras.callbacks.Callback):
    """Placed after the broadcast callback: the weights every rank holds after batch 0."""

    def __init__(self):
        super().__init__()
        self.weights = None

    def on_train_batch_end(self, batch, logs=None):
        if self.weights is None:
            self.weights = self.model.get_weights()


def reference(start, order, momentum):
    """Plain single-process tf-keras on the global batches ``order``, from ``start``."""
    model = build(seed=123, lazy=False)
    model.set_weights(start)
    model.compile(optimizer=sgd(momentum), loss="mse")
    model.fit(x[order], y[order], batch_size=BATCH * size, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def train(lazy, momentum, callbacks=()):
    model = build(seed=1 + rank, lazy=lazy)  # a different start on every rank on purpose
    initial = None if lazy else hvd.broadcast_object(model.get_weights(), root_rank=0)
    model.compile(optimizer=hvd.DistributedOptimizer(sgd(momentum)), loss="mse")
    first = AfterFirstBatch()
    model.fit(x[mine], y[mine], batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), first, *callbacks])
    same_everywhere("weights after the first batch", first.weights)
    same_everywhere("weights at the end", model.get_weights())
    same_everywhere("optimizer variables at the end", optimizer_values(model))
    return model, initial, first.weights


# built before fit, momentum: large-batch training from rank 0's initial weights
model, initial, _ = train(lazy=False, momentum=0.9)
expected = reference(initial, np.concatenate([global_order()] * EPOCHS), momentum=0.9)
difference = np.abs(flat(model.get_weights()) - flat(expected)).max()
assert difference < 1e-5, f"built model: {difference} from large-batch training"

# built on the first batch, plain SGD: large-batch training from the weights after batch 0
model, _, after_first = train(lazy=True, momentum=0.0)
rest = np.concatenate([global_order(first_step=1)] + [global_order()] * (EPOCHS - 1))
expected = reference(after_first, rest, momentum=0.0)
difference = np.abs(flat(model.get_weights()) - flat(expected)).max()
assert difference < 1e-5, f"lazily built model: {difference} from large-batch training"

# built on the first batch, momentum: slots and iterations agree too (checked in train)
train(lazy=True, momentum=0.9)

if MODE == "eager":  # an elastic state made before the first step restores after it
    model = build(seed=1 + rank, lazy=False)
    model.compile(optimizer=hvd.DistributedOptimizer(sgd(momentum=0.9)), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.sync()
    saved = model.get_weights() + optimizer_values(model)
    same_everywhere("weights and slots after the elastic state's sync", saved)
    model.fit(x[mine], y[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    state.restore()
    restored = model.get_weights() + optimizer_values(model)
    assert len(restored) == len(saved)
    assert all(np.array_equal(a, b) for a, b in zip(restored, saved)), "restore differs"

if MODE == "graph":
    class Rates(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.rates = []

        def on_train_batch_begin(self, batch, logs=None):
            self.rates.append(float(keras.backend.get_value(self.model.optimizer.lr)))

    rates = Rates()
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=RATE, warmup_epochs=1)
    train(lazy=False, momentum=0.9, callbacks=[warmup, rates])
    expected = [RATE / size * ((batch + 1) / STEPS * (size - 1) + 1) for batch in range(STEPS)]
    np.testing.assert_allclose(rates.rates[:STEPS], expected, rtol=1e-6)

print(f"keras broadcast ({MODE}) agrees on {size} rank(s)", flush=True)
