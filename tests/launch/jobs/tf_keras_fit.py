"""tf-keras (TF_USE_LEGACY_KERAS=1) fit with hororing.keras: the large-batch result on every rank."""
import os

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hororing.keras as hvd  # noqa: E402

keras = tf.keras
assert keras.__name__.startswith("tf_keras"), keras.__name__
hvd.init()
rank, size = hvd.rank(), hvd.size()
rows, batch = 12, 3
rng = np.random.default_rng(0)
x = rng.normal(size=(rows * size, 6)).astype(np.float32)
y = rng.normal(size=(rows * size, 1)).astype(np.float32)


def build(seed):
    tf.random.set_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


model = build(1 + rank)  # different on every rank: the broadcast callback makes them rank 0's
initial = model.get_weights()
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
mine = slice(rank * rows, (rank + 1) * rows)
model.fit(x[mine], y[mine], batch_size=batch, epochs=2, shuffle=False, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd.callbacks.MetricAverageCallback()])
weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
everyone = hvd.allgather_object(weights)
assert all(np.array_equal(other, everyone[0]) for other in everyone), "ranks disagree"
if rank == 0:
    reference = build(1)
    reference.set_weights(initial)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    order = np.concatenate([np.arange(peer * rows + batch * step, peer * rows + batch * (step + 1))
                            for step in range(rows // batch) for peer in range(size)])
    reference.fit(x[order], y[order], batch_size=batch * size, epochs=2, shuffle=False, verbose=0)
    expected = np.concatenate([v.numpy().ravel() for v in reference.trainable_variables])
    print(f"tf-keras max difference from large-batch training {np.abs(expected - weights).max():.3g}",
          flush=True)
