#!/usr/bin/env python
"""Data-parallel Keras training of a small MLP on scikit-learn's bundled digits data set.

    mpirun -np 4 python examples/train_keras.py
    mpirun -np 5 python examples/train_keras.py --mode ps --ps-servers 1

Keras 3 with the TensorFlow backend: ``model.fit`` on each rank's own shard, gradients
averaged by hororing (the ring, or parameter-server ranks with ``--mode ps``), every rank
starting from rank 0's weights, metrics averaged over ranks, and the learning rate scaled
by the number of ranks after a warmup.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hororing.keras as hvd  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="per rank; scaled by size")
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=["ring", "ps"],
                        help="how gradients are averaged (default: HORORING_MODE, else ring)")
    parser.add_argument("--ps-servers", help="PS mode: dedicated server ranks (the last k), "
                                             "or 'colocated' (default: HORORING_PS_SERVERS, else 1)")
    parser.add_argument("--placement", choices=["round_robin", "greedy_bytes", "partitioned"],
                        help="PS mode: which server holds which tensor")
    parser.add_argument("--checkpoint", help="keep the best model (by averaged loss) here, .keras")
    return parser.parse_args()


def load_data(seed):
    digits = load_digits()
    features = (digits.data / 16.0).astype(np.float32)
    return train_test_split(features, digits.target.astype(np.int64), test_size=0.2,
                            random_state=seed, stratify=digits.target)


def build_model():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])


def main():
    args = parse_args()
    servers = args.ps_servers
    if servers is not None and servers != "colocated":
        servers = int(servers)
    # in PS mode the server ranks serve inside init() and exit there when training is done
    hvd.init(mode=args.mode, num_servers=servers, placement=args.placement)
    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(args.seed + rank)  # rank 0's weights are broadcast
    train_x, test_x, train_y, test_y = load_data(args.seed)
    train_x, train_y = train_x[rank::size], train_y[rank::size]
    test_x, test_y = test_x[rank::size], test_y[rank::size]
    # the same number of steps on every rank, so no rank waits for a collective that never
    # comes: each rank keeps as many whole batches as the smallest shard holds
    steps = min(hvd.allgather_object(len(train_x) // args.batch_size))
    train_x, train_y = train_x[:steps * args.batch_size], train_y[:steps * args.batch_size]

    model = build_model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * size, momentum=0.9))
    model.compile(optimizer=optimizer, jit_compile=False, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    if args.warmup_epochs:
        callbacks.append(hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=args.lr * size, warmup_epochs=args.warmup_epochs, steps_per_epoch=steps))
    if args.checkpoint:
        callbacks.append(hvd.callbacks.BestModelCheckpoint(args.checkpoint, monitor="loss"))
    model.fit(train_x, train_y, batch_size=args.batch_size, epochs=args.epochs,
              callbacks=callbacks, verbose=2 if rank == 0 else 0)

    correct = int((np.argmax(model.predict(test_x, verbose=0), axis=1) == test_y).sum())
    totals = hvd.allgather_object((correct, len(test_x)))
    stats = hvd.ps_stats()
    mode = "ring" if stats is None else (
        f"PS, {stats['servers']} server(s) holding {stats['held_bytes']} B, {stats['placement']}")
    if rank == 0:
        correct, count = (sum(values) for values in zip(*totals))
        print(f"test accuracy {correct / count:.4f} on {count} held-out digits "
              f"({size} ranks, {mode})")
    hvd.shutdown()


if __name__ == "__main__":
    main()
