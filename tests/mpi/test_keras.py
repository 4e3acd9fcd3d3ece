"""hororing.keras with Keras 3: fit with DistributedOptimizer equals large-batch training.

The reference is plain single-process Keras on the concatenated global batches, computed
on every rank from the same seeded data, never with hororing.
"""

import os

import numpy as np
import pytest

pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import hororing.keras as hvd  # noqa: E402

ROWS_PER_RANK, BATCH, FEATURES = 12, 3, 6


def data():
    rng = np.random.default_rng(0)
    total = ROWS_PER_RANK * hvd.size()
    return (rng.normal(size=(total, FEATURES)).astype(np.float32),
            rng.normal(size=(total, 1)).astype(np.float32))


def build(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def shard(x, y):
    rows = slice(hvd.rank() * ROWS_PER_RANK, (hvd.rank() + 1) * ROWS_PER_RANK)
    return x[rows], y[rows]


def global_order():
    """The rows of each global batch: batch k is rows k of every rank's shard, in rank order."""
    steps = ROWS_PER_RANK // BATCH
    return np.concatenate([np.arange(peer * ROWS_PER_RANK + BATCH * step,
                                     peer * ROWS_PER_RANK + BATCH * (step + 1))
                           for step in range(steps) for peer in range(hvd.size())])


def weights(model):
    return np.concatenate([variable.numpy().ravel() for variable in model.trainable_variables])


def reference_weights(lr, passes=1, epochs=2):
    x, y = data()
    model = build(seed=1)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    order = global_order()
    model.fit(x[order], y[order], batch_size=BATCH * hvd.size() * passes, epochs=epochs,
              shuffle=False, verbose=0)
    return weights(model)


def train(optimizer, callbacks=(), epochs=2):
    x, y = shard(*data())
    model = build(seed=1 + hvd.rank())  # different starting weights: the broadcast fixes them
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), *callbacks])
    return model, history


def assert_same_on_every_rank(values):
    gathered = hvd.allgather_object(values)
    for other in gathered:
        np.testing.assert_array_equal(other, gathered[0])


def test_fit_equals_large_batch_training_and_ranks_agree():
    model, _ = train(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    assert_same_on_every_rank(weights(model))
    np.testing.assert_allclose(weights(model), reference_weights(0.1), rtol=1e-5, atol=1e-6)


def test_adam_state_stays_identical_across_ranks():
    model, _ = train(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    assert_same_on_every_rank(weights(model))
    assert_same_on_every_rank(np.concatenate([np.ravel(v.numpy()) for v in model.optimizer.variables]))


@pytest.mark.parametrize("average, reference_lr", [(True, 0.1), (False, 0.2)])
def test_backward_passes_per_step_accumulates_locally(average, reference_lr):
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                         average_aggregated_gradients=average)
    model, _ = train(optimizer)
    # two local batches per update: the mean (or, by default, the sum) of two global batches
    np.testing.assert_allclose(weights(model), reference_weights(reference_lr, passes=2),
                               rtol=1e-5, atol=1e-6)


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.rates = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


class AfterFirstBatch(keras.callbacks.Callback):
    """Placed after the broadcast callback: the weights every rank holds after batch 0."""

    def __init__(self):
        super().__init__()
        self.weights = None

    def on_train_batch_end(self, batch, logs=None):
        if self.weights is None:
            self.weights = [np.array(value) for value in self.model.get_weights()]


def build_lazily(seed):
    """A Sequential without an input shape: Keras creates its weights on the first batch."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])


def test_model_built_on_its_first_batch_is_rank_zeros_from_then_on():
    x, y = shard(*data())
    model = build_lazily(seed=1 + hvd.rank())  # a different start on every rank on purpose
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    first = AfterFirstBatch()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), first])
    assert_same_on_every_rank(np.concatenate([w.ravel() for w in first.weights]))
    assert_same_on_every_rank(weights(model))
    # from the broadcast on, single-process large-batch training on the remaining batches
    x_all, y_all = data()
    reference = build(seed=5)
    reference.set_weights(first.weights)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    per_epoch = BATCH * hvd.size()
    order = global_order()
    order = np.concatenate([order[per_epoch:], order])  # epoch 1 less its first batch, epoch 2
    reference.fit(x_all[order], y_all[order], batch_size=per_epoch, epochs=1, shuffle=False,
                  verbose=0)
    np.testing.assert_allclose(weights(model), weights(reference), rtol=1e-5, atol=1e-6)


def test_optimizer_variables_come_from_the_root_rank_lazily_built_or_not():
    x, y = shard(*data())
    for model in (build(seed=1 + hvd.rank()), build_lazily(seed=1 + hvd.rank())):
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.iterations.assign(10 * hvd.rank())  # e.g. restored from different checkpoints
        model.compile(optimizer=hvd.DistributedOptimizer(optimizer), loss="mse")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        assert int(optimizer.iterations.numpy()) == ROWS_PER_RANK // BATCH  # root's count, 0
        assert_same_on_every_rank(weights(model))
        assert_same_on_every_rank(np.concatenate([np.ravel(v.numpy())
                                                  for v in model.optimizer.variables]))


def test_elastic_state_made_before_the_first_step_restores_after_it():
    x, y = shard(*data())
    model = build(seed=1 + hvd.rank())
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.sync()  # every rank takes root's weights and (already created) Adam moments
    saved = [np.array(v.numpy()) for v in model.variables + list(model.optimizer.variables)]
    assert_same_on_every_rank(np.concatenate([value.ravel() for value in saved]))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    state.restore()  # a failure before the first commit: back to the state as made
    restored = [v.numpy() for v in model.variables + list(model.optimizer.variables)]
    assert len(restored) == len(saved)
    for value, expected in zip(restored, saved):
        np.testing.assert_array_equal(value, expected)


def test_metric_average_callback_averages_the_logs():
    before, after = Recorder(), Recorder()
    train(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
          callbacks=[before, hvd.callbacks.MetricAverageCallback(), after], epochs=1)
    own = before.epochs[0]["loss"]
    expected = np.mean(hvd.allgather_object(own))
    assert after.epochs[0]["loss"] == pytest.approx(expected, rel=1e-6)


def test_learning_rate_warmup_ramps_from_the_single_rank_rate():
    recorder = Recorder()
    steps, size = ROWS_PER_RANK // BATCH, hvd.size()
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2,
                                                      steps_per_epoch=steps)
    train(hvd.DistributedOptimizer(keras.optimizers.SGD(0.4)), callbacks=[warmup, recorder],
          epochs=3)
    first = 0.4 / size * ((1.0 / steps) * (size - 1) / 2 + 1)
    assert recorder.rates[0] == pytest.approx(first, rel=1e-6)
    last_warm = 0.4 / size * ((1 + (steps - 1 + 1) / steps) * (size - 1) / 2 + 1)
    assert recorder.rates[2 * steps - 1] == pytest.approx(last_warm, rel=1e-6)
    assert recorder.rates[-1] == pytest.approx(0.4, rel=1e-6)  # after warmup: left alone


def test_best_model_checkpoint_writes_from_rank_zero_only_and_load_model_resumes(tmp_path):
    base = hvd.broadcast_object(str(tmp_path), root_rank=0)
    path = os.path.join(base, f"best-from-rank{hvd.rank()}.keras")
    checkpoint = hvd.callbacks.BestModelCheckpoint(path, monitor="loss")
    model, _ = train(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                     callbacks=[hvd.callbacks.MetricAverageCallback(), checkpoint])
    hvd.barrier()
    written = sorted(name for name in os.listdir(base) if name.endswith(".keras"))
    assert written == ["best-from-rank0.keras"]
    loaded = hvd.load_model(os.path.join(base, "best-from-rank0.keras"))
    assert getattr(loaded.optimizer, "_hororing", None) is not None
    x, y = shard(*data())
    loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_same_on_every_rank(weights(loaded))
    hvd.barrier()  # rank 0's directory outlives every rank's read


def test_wrapping_errors_name_the_fix():
    import tensorflow as tf
    with pytest.raises(TypeError, match="Keras 3 or tf-keras optimizer"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="already wrapped"):
        hvd.DistributedOptimizer(optimizer)
    used = keras.optimizers.SGD(0.1)
    variable = keras.Variable(np.ones(2, np.float32))
    used.apply([np.ones(2, np.float32)], [variable])
    with pytest.raises(ValueError, match="has not been used yet"):
        hvd.DistributedOptimizer(used, backward_passes_per_step=2)
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)


def _batch(peer):
    rng = np.random.default_rng([7, peer])
    return rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)


def _gradient(start, peer):
    x, y = _batch(peer)
    return 2 * x.T @ (x @ start - y) / len(y)


def test_compute_gradients_then_apply_reduces_once_and_local_variables_stay():
    import tensorflow as tf
    size, rank = hvd.size(), hvd.rank()
    start = np.array([0.5, -1.0, 2.0], np.float32)
    shared, local = keras.Variable(start), keras.Variable(start)
    # op=Sum: a second reduction of the same gradients would multiply them by size again
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum)
    optimizer.register_local_var(local)
    x, y = _batch(rank)

    def loss():
        return (tf.reduce_mean(tf.square(tf.linalg.matvec(x, shared) - y))
                + tf.reduce_mean(tf.square(tf.linalg.matvec(x, local) - y)))
    pairs = optimizer.compute_gradients(loss, [shared, local])
    summed = np.sum([_gradient(start, peer) for peer in range(size)], axis=0)
    np.testing.assert_allclose(pairs[0][0].numpy(), summed, rtol=1e-5)
    np.testing.assert_allclose(pairs[1][0].numpy(), _gradient(start, rank) / size, rtol=1e-5)
    optimizer.apply_gradients(pairs)
    np.testing.assert_allclose(shared.numpy(), start - 0.1 * summed, rtol=1e-5)
    np.testing.assert_allclose(local.numpy(), start - 0.1 * _gradient(start, rank) / size,
                               rtol=1e-5)


def test_partial_optimizer_and_the_broadcast_callback_keep_local_layers_local():
    size, rank = hvd.size(), hvd.rank()
    x, y = shard(*data())
    model = build(seed=1 + rank)
    own = [variable.numpy() for variable in model.layers[0].variables]
    optimizer = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.0),
                                                local_layers=model.layers[0])
    model.compile(optimizer=optimizer, loss="mse")
    local = list(model.layers[0].variables)
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(size - 1, local_variables=local)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    # learning rate 0: only the broadcast moved anything, and not the first layer
    for variable, mine in zip(model.layers[0].variables, own):
        np.testing.assert_array_equal(variable.numpy(), mine)
    assert_same_on_every_rank(model.layers[1].get_weights()[0])
    with pytest.raises(ValueError, match="local_layers must be Keras layers, got str"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=["dense"])
