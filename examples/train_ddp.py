#!/usr/bin/env python
"""A torch.distributed script, unchanged but for the backend's name, on MPI: DDP over hororing.

    mpirun -np 4 python examples/train_ddp.py [--hook fp16]

The same MLP on scikit-learn's bundled digits as train.py, written as a DDP user writes it:
``dist.init_process_group("hororing")`` (rank and size from MPI; no address, no store),
DistributedDataParallel with one of DDP's own comm hooks, a DistributedSampler, and the test
accuracy reduced with ``dist.all_reduce``.
"""

import argparse

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hororing.torch  # noqa: F401  registers the "hororing" backend


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="per rank; scaled by size")
    parser.add_argument("--hook", choices=["none", "fp16", "powersgd"], default="none")
    args = parser.parse_args()

    dist.init_process_group("hororing")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    digits = load_digits()
    features = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    labels = torch.tensor(digits.target)
    train_x, test_x, train_y, test_y = train_test_split(features, labels, test_size=0.25,
                                                        random_state=0, stratify=labels)
    train = TensorDataset(train_x, train_y)
    sampler = DistributedSampler(train, num_replicas=size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10)))
    if args.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=10)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    model.eval()
    with torch.no_grad():  # each rank scores its part of the test set; the counts are summed
        mine = slice(rank, None, size)
        correct = (model(test_x[mine]).argmax(1) == test_y[mine]).sum().float()
        counts = torch.stack([correct, torch.tensor(float(len(test_y[mine])))])
        dist.all_reduce(counts)
    if rank == 0:
        print(f"test accuracy {float(counts[0] / counts[1]):.4f} on {int(counts[1])} held-out "
              f"digits ({size} ranks, DDP over hororing, hook {args.hook})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
