"""A Keras fit under hvd.elastic (Keras 3, or tf-keras with TF_USE_LEGACY_KERAS=1).

KerasState keeps the model and its optimizer (Adam: its moments and step count must survive a
relaunch); CommitStateCallback commits at the end of each epoch (and every 1000 batches, which
never comes), UpdateEpochStateCallback counts the epochs across launches, as Horovod's elastic
Keras example does (``epochs=EPOCHS - state.epoch``). ``--kill E:B`` SIGKILLs the last rank of
the first launch at batch B of epoch E. Rank 0 writes the final weights to ``--out``.
"""
import argparse
import json
import os
import signal

import numpy as np
import tensorflow as tf

import hororing.keras as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--kill", default=None)
args = parser.parse_args()
from hororing.tensorflow.keras._backend import keras  # noqa: E402

LAUNCH = int(os.environ.get("HORORING_ELASTIC_LAUNCH", "0"))
EPOCHS, BATCHES, BATCH = 4, 6, 4
hvd.init()
rng = np.random.default_rng(0)
x = rng.normal(size=(BATCHES * BATCH * 4, 5)).astype(np.float32)
y = (x @ np.arange(1.0, 6.0, dtype=np.float32)[:, None]).astype(np.float32)
keras.utils.set_random_seed(7)
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                          keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
state = hvd.elastic.KerasState(model, epoch=0)


class Kill(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if args.kill and LAUNCH == 0 and hvd.rank() == hvd.size() - 1 and \
                (state.epoch, batch) == tuple(int(v) for v in args.kill.split(":")):
            os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    # every rank reads its share of the same global batches, whatever the size
    size, rank = hvd.size(), hvd.rank()
    per_rank = BATCH * 4 // size
    order = np.arange(len(x)).reshape(BATCHES, BATCH * 4)
    mine = order[:, rank * per_rank:(rank + 1) * per_rank].ravel()
    model.fit(x[mine], y[mine], batch_size=per_rank, epochs=EPOCHS - state.epoch,
              shuffle=False, verbose=0,
              callbacks=[hvd.elastic.UpdateEpochStateCallback(state),
                         hvd.elastic.CommitStateCallback(state, batches_per_commit=1000),
                         Kill()])


train(state)
weights = [w.tolist() for w in model.get_weights()]
everyone = hvd.allgather_object(weights)
assert all(other == weights for other in everyone), "ranks disagree on the weights"
if hvd.rank() == 0:
    with open(args.out, "w") as file:
        json.dump({"weights": weights, "epoch": state.epoch, "launch": LAUNCH,
                   "size": hvd.size()}, file)
