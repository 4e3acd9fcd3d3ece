"""tf-keras (TF_USE_LEGACY_KERAS=1): the optimizer's gradient paths against numpy references.

compute_gradients and apply_gradients reduce once (op=Sum makes a second reduction visible),
backward_passes_per_step sums N passes locally and applies every N-th (counter and iterations
as Horovod keeps them), local variables stay on their rank (divided by the size). Every rank
computes the reference from every rank's data itself.
"""
import os

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hororing.keras as hvd  # noqa: E402

keras = tf.keras
assert keras.__name__.startswith("tf_keras"), keras.__name__
hvd.init()
rank, size = hvd.rank(), hvd.size()


def data(peer, step):
    rng = np.random.default_rng([peer, step])
    return rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)


def gradient(weights, peer, step):
    """d/dw of mean((x w - y)^2) for ``peer``'s batch ``step``."""
    x, y = data(peer, step)
    return 2 * x.T @ (x @ weights - y) / len(y)


def loss_of(variable, step):
    x, y = data(rank, step)
    return lambda: tf.reduce_mean(tf.square(tf.linalg.matvec(x, variable) - y))


start = np.array([0.5, -1.0, 2.0], np.float32)
rate = 0.1

# 1. compute_gradients then apply_gradients (minimize's path), op=Sum: reduced once
variable = tf.Variable(start)
optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(rate), op=hvd.Sum)
pairs = optimizer.compute_gradients(loss_of(variable, 0), [variable])
optimizer.apply_gradients(pairs)
expected = start - rate * sum(gradient(start, peer, 0) for peer in range(size))
np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5)

# 2. a plain tape's gradients straight into apply_gradients: reduced there, once
variable = tf.Variable(start)
optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(rate), op=hvd.Sum)
with tf.GradientTape() as tape:
    loss = loss_of(variable, 0)()
optimizer.apply_gradients([(tape.gradient(loss, variable), variable)])
np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5)

# 3. backward_passes_per_step=3 in a tf.function, as model.fit runs it: sum or mean of passes
for average in (False, True):
    variable = tf.Variable(start)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(rate), backward_passes_per_step=3,
                                         average_aggregated_gradients=average)

    @tf.function
    def train(step):
        x, y = tf.numpy_function(lambda s: data(rank, int(s)), [step], [tf.float32, tf.float32])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.linalg.matvec(x, variable) - y))
        optimizer.apply_gradients([(tape.gradient(loss, variable), variable)])

    weights, pending = start.copy(), np.zeros(3, np.float32)
    for step in range(7):
        train(tf.constant(step))
        pending += np.mean([gradient(weights, peer, step) for peer in range(size)], axis=0)
        if (step + 1) % 3 == 0:
            weights = weights - rate * pending / (3 if average else 1)
            pending[:] = 0
        np.testing.assert_allclose(variable.numpy(), weights, rtol=1e-4, atol=1e-6)
        assert int(optimizer.iterations.numpy()) == step + 1
    assert int(optimizer._agg_helper.counter.numpy()) == 7 % 3

# 4. a local variable: its own gradient over size, not averaged; the others averaged
shared, local = tf.Variable(start), tf.Variable(start)
optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(rate))
optimizer.register_local_var(local)
x, y = data(rank, 1)
pairs = optimizer.compute_gradients(
    lambda: tf.reduce_mean(tf.square(tf.linalg.matvec(x, shared) - y))
    + tf.reduce_mean(tf.square(tf.linalg.matvec(x, local) - y)), [shared, local])
np.testing.assert_allclose(pairs[0][0].numpy(), np.mean(
    [gradient(start, peer, 1) for peer in range(size)], axis=0), rtol=1e-5)
np.testing.assert_allclose(pairs[1][0].numpy(), gradient(start, rank, 1) / size, rtol=1e-5)
print(f"tf-keras gradient paths agree with the references on {size} rank(s)", flush=True)
