"""hvd.callbacks.LocalSGDCallback and DiLoCoCallback in model.fit, against every rank's
training simulated on one process with plain Keras (each rank's model stepped by
train_on_batch on its own batches, the syncs computed from all of them here)."""

import numpy as np
import pytest

pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import hororing.keras as hvd  # noqa: E402
from hororing.periodic import cut  # noqa: E402
from reference import int8_mean  # noqa: E402

ROWS, BATCH, FEATURES = 24, 3, 5  # 8 steps an epoch


def data(rank):
    rng = np.random.default_rng(100 + rank)
    return (rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
            rng.normal(size=(ROWS, 2)).astype(np.float32))


def build(seed, optimizer):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(7, activation="tanh"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def inner():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def outer():
    return keras.optimizers.SGD(0.8, momentum=0.5, nesterov=True)


def fit(callback, epochs=2):
    model = build(1 + hvd.rank(), inner())  # every rank its own: rank 0's must win
    model.fit(*data(hvd.rank()), batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[callback])
    return [variable.numpy() for variable in model.trainable_variables]


def replicas():
    return [build(1, inner()) for _ in range(hvd.size())]


def batches(epochs):
    """Where each step's batch starts in a rank's rows (fit without shuffling)."""
    return [start for _ in range(epochs) for start in range(0, ROWS, BATCH)]


def step_all(models, start):
    for rank, model in enumerate(models):
        x, y = data(rank)
        model.train_on_batch(x[start:start + BATCH], y[start:start + BATCH])


def weights(model):
    return [variable.numpy() for variable in model.trainable_variables]


def simulate_local_sgd(sync_every, epochs=2):
    models = replicas()
    for step, start in enumerate(batches(epochs), start=1):
        step_all(models, start)
        if step % sync_every == 0 or step == epochs * ROWS // BATCH:  # and at the end
            average = [np.mean(values, axis=0) for values in zip(*map(weights, models))]
            for model in models:
                for variable, value in zip(model.trainable_variables, average):
                    variable.assign(value)
    return weights(models[hvd.rank()])


def simulate_diloco(sync_every, fragments, epochs=2, int8=False):
    models = replicas()
    held = weights(models[0])  # the global weights
    residuals = [[np.zeros(value.shape) for _ in models] for value in held]  # int8's
    steps = epochs * ROWS // BATCH
    runs = cut([value.size for value in held], fragments)
    offsets = [(index + 1) * sync_every // len(runs) % sync_every for index in range(len(runs))]
    shadow = build(1, outer())  # the outer optimizer steps these, one fragment at a time
    shadow.optimizer.build(shadow.trainable_variables)
    last = [0] * len(runs)
    for step, start in enumerate(batches(epochs), start=1):
        step_all(models, start)
        due = [index for index, offset in enumerate(offsets) if step % sync_every == offset]
        if step == steps:
            due = [index for index in range(len(runs)) if index in due or last[index] != step]
        for index in due:
            last[index] = step
            members = runs[index]
            mean = (lambda changes, position: int8_mean(changes, residuals[position],
                                                        np.float32)) \
                if int8 else (lambda changes, position: np.mean(changes, axis=0))
            changes = [mean([held[position] - weights(model)[position] for model in models],
                            position) for position in members]
            variables = [shadow.trainable_variables[position] for position in members]
            for variable, position in zip(variables, members):
                variable.assign(held[position])
            shadow.optimizer.apply_gradients(zip(changes, variables))
            for variable, position in zip(variables, members):
                held[position] = variable.numpy()
                for model in models:
                    model.trainable_variables[position].assign(held[position])
    return weights(models[hvd.rank()])


def assert_close(values, expected):
    for value, wanted in zip(values, expected):
        np.testing.assert_allclose(value, wanted, rtol=1e-5, atol=1e-6)


def assert_same_on_every_rank(values):
    gathered = hvd.allgather_object(values)
    for other in gathered:
        for value, first in zip(other, gathered[0]):
            np.testing.assert_array_equal(value, first)


@pytest.mark.parametrize("sync_every", [1, 5])
def test_local_sgd_averages_the_weights_every_h_steps_and_at_the_end(sync_every):
    trained = fit(hvd.callbacks.LocalSGDCallback(sync_every))
    assert_close(trained, simulate_local_sgd(sync_every))
    assert_same_on_every_rank(trained)


@pytest.mark.parametrize("sync_every,fragments", [(3, 1), (5, 2), (3, 4)])
def test_diloco_steps_the_outer_optimizer_with_the_averaged_change(sync_every, fragments):
    trained = fit(hvd.callbacks.DiLoCoCallback(outer(), sync_every, fragments=fragments))
    assert_close(trained, simulate_diloco(sync_every, fragments))
    assert_same_on_every_rank(trained)


def test_diloco_in_16_bits_stays_near_the_exact_one():
    exact = fit(hvd.callbacks.DiLoCoCallback(outer(), 3, fragments=2))
    rounded = fit(hvd.callbacks.DiLoCoCallback(outer(), 3, fragments=2,
                                               compression=hvd.Compression.fp16))
    for value, wanted in zip(rounded, exact):
        np.testing.assert_allclose(value, wanted, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("sync_every,fragments", [(1, 1), (3, 2)])
def test_diloco_in_int8_sends_what_the_reference_sends_and_keeps_the_rest(sync_every,
                                                                          fragments):
    trained = fit(hvd.callbacks.DiLoCoCallback(outer(), sync_every, fragments=fragments,
                                               int8=True))
    assert_close(trained, simulate_diloco(sync_every, fragments, int8=True))
    assert_same_on_every_rank(trained)
    exact = fit(hvd.callbacks.DiLoCoCallback(outer(), sync_every, fragments=fragments))
    for value, wanted in zip(trained, exact):
        np.testing.assert_allclose(value, wanted, rtol=2e-2, atol=2e-2)


def test_without_the_sync_at_the_end_the_ranks_keep_their_own_weights():
    trained = fit(hvd.callbacks.LocalSGDCallback(5, sync_at_end=False))  # 16 steps: 1 after
    gathered = hvd.allgather_object(trained)
    if hvd.size() > 1:
        assert not np.array_equal(gathered[0][0], gathered[1][0])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="sync_every must be an integer >= 1"):
        hvd.callbacks.LocalSGDCallback(0)
    with pytest.raises(TypeError, match="outer optimizer must be a Keras optimizer"):
        hvd.callbacks.DiLoCoCallback("sgd", 3)
    with pytest.raises(ValueError, match="Compression.none, .fp16 or .bf16"):
        hvd.callbacks.DiLoCoCallback(outer(), 3, compression="int8")
    with pytest.raises(ValueError, match="int8=True sends int8 rows"):
        hvd.callbacks.DiLoCoCallback(outer(), 3, compression=hvd.Compression.fp16, int8=True)
    with pytest.raises(ValueError, match="fragments must be an integer from 1 to the model's 4"):
        fit(hvd.callbacks.DiLoCoCallback(outer(), 3, fragments=5))


@pytest.mark.parametrize("int8", [False, True])
def test_diloco_resumed_from_its_state_goes_on_as_if_never_stopped(int8):
    """One fit of two epochs' steps against one epoch, every rank's checkpoint (its weights,
    its inner optimizer's variables, the callback's state) taken at the sync that ends it,
    and a new model and callback loaded from it for the second epoch."""
    x, y = data(hvd.rank())

    def callback():
        return hvd.callbacks.DiLoCoCallback(outer(), 3, fragments=2, int8=int8)

    def fit_epoch(model, diloco):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[diloco])

    whole, diloco = build(1 + hvd.rank(), inner()), callback()
    for _ in range(2):
        fit_epoch(whole, diloco)
    first, stopped = build(1 + hvd.rank(), inner()), callback()
    fit_epoch(first, stopped)  # 8 steps; the sync at the end syncs both fragments
    checkpoint = (weights(first), [variable.numpy() for variable in first.optimizer.variables],
                  stopped.state_dict())
    if int8:
        assert checkpoint[2]["residuals"]
    resumed, diloco = build(50 + hvd.rank(), inner()), callback()
    resumed.optimizer.build(resumed.trainable_variables)
    for variable, value in zip(resumed.trainable_variables, checkpoint[0]):
        variable.assign(value)
    for variable, value in zip(resumed.optimizer.variables, checkpoint[1]):
        variable.assign(value)
    diloco.load_state_dict(checkpoint[2])
    fit_epoch(resumed, diloco)
    assert_close(weights(resumed), weights(whole))
    for value, wanted in zip(diloco.state_dict()["global"], weights(whole)):
        np.testing.assert_allclose(value, wanted, rtol=1e-6, atol=1e-7)
    assert_same_on_every_rank(weights(resumed))


def test_a_diloco_state_that_does_not_fit_is_named():
    x, y = data(hvd.rank())
    model, diloco = build(1 + hvd.rank(), inner()), hvd.callbacks.DiLoCoCallback(outer(), 3)
    with pytest.raises(ValueError, match="no state before training begins"):
        diloco.state_dict()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[diloco])
    state = diloco.state_dict()
    with pytest.raises(ValueError, match="lacks 'outer'"):
        diloco.load_state_dict({key: state[key] for key in ("global", "steps", "synced_at")})
    with pytest.raises(ValueError, match="saved after step 5, and the model's optimizer is "
                                         "at step 8"):
        diloco.load_state_dict(dict(state, steps=5))
    with pytest.raises(ValueError, match="global weights of shapes"):
        diloco.load_state_dict(dict(state, **{"global": state["global"][:2]}))
