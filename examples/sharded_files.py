#!/usr/bin/env python
"""Training where every rank reads only its own files, through its own input channel.

    mpirun -np 4 python examples/sharded_files.py
    mpirun -np 16 python examples/sharded_files.py

Rank 0 writes the digits training set into 16 record files. Every epoch, each rank takes its
files from hvd.data.shard_files (a new balanced plan per epoch), reads them through its own
FIFO fed by its own producer process (hvd.data.open_channel, never a stream shared between
ranks), and all ranks agree up front on how many batches to run (hvd.data.equal_steps), so no
rank waits for an allreduce another rank never makes. After the first epoch the ranks check
that every file was read by exactly one rank.
"""

import argparse
import glob
import os
import shutil
import tempfile

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hororing.torch as hvd

SAMPLE = np.dtype([("x", np.float32, 64), ("y", np.int64)])  # one record: pixels and label


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="per rank; scaled by size")
    parser.add_argument("--shuffle-buffer", type=int, default=256)
    return parser.parse_args()


def write_record_files(directory, count):
    """Split the digits training set over ``count`` record files; return the test set."""
    digits = load_digits()
    train_x, test_x, train_y, test_y = train_test_split(
        (digits.data / 16.0).astype(np.float32), digits.target, test_size=0.2, random_state=0,
        stratify=digits.target)
    samples = np.empty(len(train_x), dtype=SAMPLE)
    samples["x"], samples["y"] = train_x, train_y
    for index, part in enumerate(np.array_split(samples, count)):
        with hvd.data.RecordWriter(os.path.join(directory, f"digits-{index:02d}.rec")) as out:
            for sample in part:
                out.write(sample.tobytes())
    return test_x, test_y


def batches(payloads, batch_size):
    """Group record payloads into (x, y) tensors of ``batch_size`` samples (last one short)."""
    pending = []
    for payload in payloads:
        pending.append(payload)
        if len(pending) == batch_size:
            yield decode(pending)
            pending = []
    if pending:
        yield decode(pending)


def decode(payloads):
    samples = np.frombuffer(b"".join(payloads), dtype=SAMPLE)
    return torch.from_numpy(samples["x"].copy()), torch.from_numpy(samples["y"].copy())


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(0)
    rank, size = hvd.rank(), hvd.size()
    directory = tempfile.mkdtemp(prefix="hororing-digits-records-") if rank == 0 else None
    test_set = write_record_files(directory, args.files) if rank == 0 else None
    directory, (test_x, test_y) = hvd.broadcast_object((directory, test_set), root_rank=0)
    pattern = os.path.join(directory, "digits-*.rec")

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9),
        named_parameters=model.named_parameters())
    try:
        for epoch in range(args.epochs):
            mine = hvd.data.shard_files(pattern, shuffle=True, epoch=epoch)
            plan = hvd.data.equal_steps(hvd.data.count_samples(mine), args.batch_size,
                                        policy="pad")
            losses = []
            with hvd.data.open_channel(mine, shuffle_buffer=args.shuffle_buffer,
                                       seed=epoch * size + rank) as channel:
                for x, y in plan.take(batches(channel, args.batch_size)):
                    optimizer.zero_grad()
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    optimizer.step()
                    losses.append(loss.item())
            if epoch == 0:
                report_ownership(mine, pattern, plan)
            mean_loss = hvd.allreduce(torch.tensor(np.mean(losses)), name="loss").item()
            if rank == 0 and ((epoch + 1) % 5 == 0 or epoch == 0):
                print(f"epoch {epoch + 1:>3} loss {mean_loss:.4f} ({plan.steps} steps per rank)",
                      flush=True)
        with torch.no_grad():
            mine_x, mine_y = torch.from_numpy(test_x[rank::size]), torch.from_numpy(test_y[rank::size])
            correct = (model(mine_x).argmax(dim=1) == mine_y).sum()
        correct, count = hvd.allreduce(torch.tensor([correct.item(), len(mine_y)]),
                                       op=hvd.Sum, name="accuracy").tolist()
        if rank == 0:
            print(f"test accuracy {correct / count:.4f} on {count} held-out digits ({size} ranks, "
                  f"{args.files} files, one channel per rank)", flush=True)
    finally:
        hvd.barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    hvd.shutdown()


def report_ownership(mine, pattern, plan):
    """Check on every rank that each file was read by exactly one rank; print the plan."""
    shards = hvd.allgather_object([os.path.basename(path) for path in mine])
    read = sorted(name for shard in shards for name in shard)
    expected = sorted(os.path.basename(path) for path in glob.glob(pattern))
    if read != expected:
        raise RuntimeError(f"files read {read} differ from the files written {expected}")
    if hvd.rank() == 0:
        for rank, shard in enumerate(shards):
            print(f"rank {rank:>2} reads {', '.join(shard)} ({plan.samples[rank]} samples)")
        print(f"every one of the {len(read)} files was read by exactly one rank", flush=True)


if __name__ == "__main__":
    main()
