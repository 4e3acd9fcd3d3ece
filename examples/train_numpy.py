#!/usr/bin/env python
"""Data-parallel training of a numpy MLP (hand-written backward pass) on the digits data set.

    mpirun -np 4 python examples/train_numpy.py

No deep-learning framework: parameters are numpy arrays, the optimizer is hororing's SGD,
and hororing.DistributedOptimizer averages the gradients, each allreduce started as soon as
the backward pass has produced that layer's gradient.
"""

import argparse

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hororing as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by size")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="gpu: the model, data and gradients are cupy arrays on this rank's GPU")
    return parser.parse_args()


class MLP:
    """64 -> 64 (ReLU) -> 10, softmax cross-entropy, on numpy or cupy (``xp``)."""

    def __init__(self, rng, xp=np):
        self.xp = xp
        self.params = {name: xp.asarray(value) for name, value in {
            "w1": (rng.standard_normal((64, 64)) * np.sqrt(2 / 64)).astype(np.float32),
            "b1": np.zeros(64, np.float32),
            "w2": (rng.standard_normal((64, 10)) * np.sqrt(2 / 64)).astype(np.float32),
            "b2": np.zeros(10, np.float32),
        }.items()}

    def forward(self, x):
        hidden = self.xp.maximum(x @ self.params["w1"] + self.params["b1"], 0)
        return hidden, hidden @ self.params["w2"] + self.params["b2"]

    def loss_and_backward(self, x, labels, optimizer):
        """Write the gradients into optimizer.grads, last layer first; return the loss."""
        xp = self.xp
        hidden, logits = self.forward(x)
        shifted = logits - logits.max(axis=1, keepdims=True)
        probabilities = xp.exp(shifted)
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        rows = xp.arange(len(labels))
        loss = -xp.log(probabilities[rows, labels] + 1e-12).mean()
        d_logits = probabilities
        d_logits[rows, labels] -= 1
        d_logits /= len(labels)
        grads = optimizer.grads
        grads["w2"][...] = hidden.T @ d_logits
        grads["b2"][...] = d_logits.sum(axis=0)
        optimizer.grad_ready("w2")
        optimizer.grad_ready("b2")  # these reduce while the first layer's gradient is computed
        d_hidden = (d_logits @ self.params["w2"].T) * (hidden > 0)
        grads["w1"][...] = x.T @ d_hidden
        grads["b1"][...] = d_hidden.sum(axis=0)
        return float(loss)


def main():
    args = parse_args()
    xp = np
    if args.device == "gpu":
        import cupy as xp  # imported before init(), which then makes GPU local_rank % count current
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    digits = load_digits()
    train_x, test_x, train_y, test_y = train_test_split(
        (digits.data / 16.0).astype(np.float32), digits.target, test_size=0.2, random_state=0,
        stratify=digits.target)
    train_x, train_y = xp.asarray(train_x[rank::size]), xp.asarray(train_y[rank::size])
    test_x, test_y = xp.asarray(test_x[rank::size]), xp.asarray(test_y[rank::size])

    model = MLP(np.random.default_rng(0), xp)
    for name, value in model.params.items():  # every rank starts from rank 0's weights
        hvd.broadcast_(value, root_rank=0, name=f"init.{name}")
    optimizer = hvd.DistributedOptimizer(hvd.SGD(model.params, lr=args.lr * size, momentum=0.9))
    steps = int(hvd.allreduce(np.array([len(train_x) // args.batch_size]), op=hvd.Min)[0])
    rng = np.random.default_rng(rank)
    for epoch in range(args.epochs):
        order = xp.asarray(rng.permutation(len(train_x)))
        losses = []
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            losses.append(model.loss_and_backward(train_x[batch], train_y[batch], optimizer))
            optimizer.step()
        mean_loss = hvd.allreduce(np.array([np.mean(losses)]), name="loss")[0]
        if rank == 0 and (epoch + 1) % 10 == 0:
            print(f"epoch {epoch + 1:>3} loss {mean_loss:.4f}", flush=True)
    correct = int((model.forward(test_x)[1].argmax(axis=1) == test_y).sum())
    correct, count = hvd.allreduce(np.array([correct, len(test_y)]), op=hvd.Sum).tolist()
    if rank == 0:
        print(f"test accuracy {correct / count:.4f} on {count} held-out digits ({size} ranks, numpy)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
