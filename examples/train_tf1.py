#!/usr/bin/env python
"""Between-graph data-parallel training of a TF1 graph on scikit-learn's bundled digits data.

    mpirun -np 4 python examples/train_tf1.py
    mpirun -np 4 python examples/train_tf1.py --mode ps --ps-servers 1 --replicas-to-aggregate 2

The program TF1 users know: a ``tf.compat.v1`` graph of placeholders and variables, a
``tf.compat.v1.train`` optimizer and ``MonitoredTrainingSession``. Two lines make it
data-parallel: ``hvd.DistributedOptimizer`` averages the gradients over ranks inside the graph,
and ``hvd.BroadcastGlobalVariablesHook(0)`` starts every rank from rank 0's variables. Each
rank reads its own shard. ``--mode ps`` sends the gradients through parameter-server ranks
instead of the ring; with ``--replicas-to-aggregate r`` a server averages the first r of the
workers' pushes each step and drops the late ones, as TensorFlow's SyncReplicasOptimizer did.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hororing.tensorflow as hvd  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=["ring", "ps"],
                        help="how gradients are averaged (default: HORORING_MODE, else ring)")
    parser.add_argument("--ps-servers", help="PS mode: dedicated server ranks (the last k), "
                                             "or 'colocated' (default 1)")
    parser.add_argument("--replicas-to-aggregate", type=int,
                        help="PS mode: pushes a server averages per step (default: every "
                             "worker's)")
    parser.add_argument("--checkpoint-dir", help="rank 0 saves checkpoints here")
    return parser.parse_args()


def load_data(seed):
    digits = load_digits()
    features = (digits.data / 16.0).astype(np.float32)
    return train_test_split(features, digits.target.astype(np.int64), test_size=0.2,
                            random_state=seed, stratify=digits.target)


def build_model(features, seed):
    """A 64-128-64-10 MLP as TF1 variables; returns the logits."""
    hidden = features
    widths = [64, 128, 64, 10]
    for layer, (inputs, outputs) in enumerate(zip(widths, widths[1:])):
        weights = tf.compat.v1.get_variable(
            f"weights{layer}", [inputs, outputs],
            initializer=tf.compat.v1.glorot_uniform_initializer(seed=seed + layer))
        bias = tf.compat.v1.get_variable(f"bias{layer}", [outputs],
                                         initializer=tf.compat.v1.zeros_initializer())
        hidden = tf.matmul(hidden, weights) + bias
        if layer < len(widths) - 2:
            hidden = tf.nn.relu(hidden)
    return hidden


def main():
    args = parse_args()
    tf.compat.v1.disable_eager_execution()
    servers = args.ps_servers
    if args.mode == "ps" and servers is None:
        servers = 1
    if servers is not None and servers != "colocated":
        servers = int(servers)
    # in PS mode the server ranks serve inside init() and exit there when training is done
    hvd.init(mode=args.mode, num_servers=servers,
             replicas_to_aggregate=args.replicas_to_aggregate)
    rank, size = hvd.rank(), hvd.size()
    train_x, test_x, train_y, test_y = load_data(args.seed)
    train_x, train_y = train_x[rank::size], train_y[rank::size]
    test_x, test_y = test_x[rank::size], test_y[rank::size]
    # the same number of steps on every rank, so no rank waits for a collective that never
    # comes: each rank keeps as many whole batches as the smallest shard holds
    batches = min(hvd.allgather_object(len(train_x) // args.batch_size))

    features = tf.compat.v1.placeholder(tf.float32, [None, 64], name="features")
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    logits = build_model(features, args.seed + 100 * rank)  # rank 0's values are broadcast
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=logits))
    predictions = tf.argmax(logits, axis=1)
    step = tf.compat.v1.train.get_or_create_global_step()
    optimizer = hvd.DistributedOptimizer(
        tf.compat.v1.train.MomentumOptimizer(args.lr * size, momentum=0.9))
    train = optimizer.minimize(loss, global_step=step)

    hooks = [hvd.BroadcastGlobalVariablesHook(0)]
    shuffle = np.random.default_rng(args.seed + rank)
    checkpoints = args.checkpoint_dir if rank == 0 else None
    with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoints, hooks=hooks,
                                                     save_summaries_steps=None) as session:
        for epoch in range(args.epochs):
            order = shuffle.permutation(len(train_x))
            losses = []
            for batch in range(batches):
                chosen = order[batch * args.batch_size:(batch + 1) * args.batch_size]
                _, value = session.run([train, loss], {features: train_x[chosen],
                                                       labels: train_y[chosen]})
                losses.append(value)
            average = np.mean(hvd.allgather_object(float(np.mean(losses))))
            if rank == 0:
                print(f"epoch {epoch + 1}: loss {average:.4f}", flush=True)
        correct = int((session.run(predictions, {features: test_x}) == test_y).sum())
    totals = hvd.allgather_object((correct, len(test_x)))
    stats = hvd.ps_stats()
    mode = "ring" if stats is None else f"PS, {stats['servers']} server(s)"
    if rank == 0:
        correct, count = (sum(values) for values in zip(*totals))
        print(f"test accuracy {correct / count:.4f} on {count} held-out digits "
              f"({size} ranks, {mode})")
    hvd.shutdown()


if __name__ == "__main__":
    main()
