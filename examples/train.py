#!/usr/bin/env python
"""Data-parallel training of a small MLP on scikit-learn's bundled digits data set.

    mpirun -np 4 python examples/train.py

Each rank trains on its own shard of the training set; gradients are averaged by
hororing's ring. The learning rate is
scaled by the number of ranks, rank 0 shows progress and writes a checkpoint every epoch,
and a restarted job resumes from it (--resume), every rank starting from rank 0's state.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hororing.torch as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="per rank; scaled by size")
    parser.add_argument("--checkpoint", default=os.path.join("results", "digits-checkpoint.pt"))
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=["ring", "ps"],
                        help="how gradients are averaged (default: HORORING_MODE, else ring)")
    parser.add_argument("--ps-servers", help="PS mode: dedicated server ranks (the last k), "
                                             "or 'colocated' (default: HORORING_PS_SERVERS, else 1)")
    parser.add_argument("--placement", choices=["round_robin", "greedy_bytes", "partitioned"],
                        help="PS mode: which server holds which tensor")
    parser.add_argument("--ps-async", action="store_true",
                        help="PS mode: asynchronous SGD on the servers (AsyncPSOptimizer) instead "
                             "of synchronous averaging")
    parser.add_argument("--sharded", type=int, nargs="?", const=1, default=0, choices=[1, 2],
                        help="shard the optimizer's state across the ranks (ZeRO stage 1; "
                             "--sharded 2: the gradients too, stage 2)")
    parser.add_argument("--comm-hook", choices=["allreduce", "fp16", "bf16", "powersgd"],
                        help="reduce the gradients through this communication hook "
                             "(hvd.comm_hooks; default: the optimizer's own allreduce)")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--powersgd-start", type=int,
                        help="plain steps before PowerSGD (default: a tenth of all steps)")
    parser.add_argument("--history", help="write each epoch's train loss and accuracy (JSON)")
    parser.add_argument("--save-params", help="write the final parameters here (.npz)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the model and data live; cuda: GPU local_rank %% GPU count")
    return parser.parse_args()


def load_data(seed):
    digits = load_digits()
    features = (digits.data / 16.0).astype(np.float32)
    train_x, test_x, train_y, test_y = train_test_split(
        features, digits.target, test_size=0.2, random_state=seed, stratify=digits.target)
    return ((torch.from_numpy(train_x), torch.from_numpy(train_y)),
            (torch.from_numpy(test_x), torch.from_numpy(test_y)))


def shard(tensors, rank, size):
    """This rank's rows: every size-th sample, starting at rank."""
    return tuple(tensor[rank::size] for tensor in tensors)


def pick_device(name):
    """The CPU, or this rank's GPU: local rank modulo the GPUs this node has."""
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        sys.exit("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is "
                 "False); install a CUDA build of torch or run with --device cpu")
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def comm_hook(args, total_steps):
    """The communication hook ``--comm-hook`` names (None: the optimizer's own allreduce)."""
    if args.comm_hook is None:
        return None
    if args.comm_hook == "powersgd":
        start = args.powersgd_start if args.powersgd_start is not None else total_steps // 10
        return hvd.comm_hooks.powersgd(rank=args.powersgd_rank, start_iter=start)
    return getattr(hvd.comm_hooks, args.comm_hook)


def averaged(values):
    """Sum (loss, correct, count) over ranks: every rank gets the same epoch metrics."""
    return hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Sum, name="metrics").tolist()


def progress(epoch, step, steps, loss):
    """A bar redrawn in place on a terminal; in a log file (sbatch, a pipe) one line an epoch,
    written with the epoch's summary, instead of a carriage-return update per step."""
    if not sys.stdout.isatty():
        if step == steps:
            sys.stdout.write(f"epoch {epoch:>3} {steps} steps, last loss {loss:.4f}")
        return
    width = 30
    done = int(width * step / steps)
    sys.stdout.write(f"\repoch {epoch:>3} [{'#' * done}{'.' * (width - done)}] "
                     f"{step}/{steps} loss {loss:.4f}")
    sys.stdout.flush()


def main():
    args = parse_args()
    if args.sharded and (args.mode == "ps" or args.ps_async):
        sys.exit("--sharded shards the ring's optimizer state; it does not apply to PS mode")
    servers = args.ps_servers
    if servers is not None and servers != "colocated":
        servers = int(servers)
    # in PS mode the server ranks serve inside init() and exit there when training is done
    hvd.init(mode=args.mode, num_servers=servers, placement=args.placement)
    rank, size = hvd.rank(), hvd.size()
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    (train_x, train_y), (test_x, test_y) = load_data(args.seed)
    train_x, train_y = shard((train_x, train_y), rank, size)
    test_x, test_y = shard((test_x, test_y), rank, size)
    train_x, train_y, test_x, test_y = (t.to(device) for t in (train_x, train_y, test_x, test_y))

    model = build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
    first_epoch = 0
    if args.resume and rank == 0 and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, map_location=device)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        first_epoch = saved["epoch"] + 1
    # every rank starts from rank 0's weights, optimizer state and epoch
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    first_epoch = hvd.broadcast_object(first_epoch, root_rank=0)
    if args.ps_async:
        # the servers hold the weights and apply each rank's gradient as it arrives, with
        # the unscaled learning rate: every push is one SGD step of one rank's batch
        optimizer = hvd.AsyncPSOptimizer(model.named_parameters(), lr=args.lr, momentum=0.9)
    history = []
    # the same number of steps on every rank, so no rank waits for a collective that never comes
    steps = int(hvd.allreduce(torch.tensor([len(train_x) // args.batch_size]), op=hvd.Min)[0])
    if not args.ps_async:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             sharded=args.sharded,
                                             comm_hook=comm_hook(args, steps * args.epochs))
    loss_fn = torch.nn.CrossEntropyLoss()
    started = time.time()
    for epoch in range(first_epoch, args.epochs):
        model.train()
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(epoch + 1000 * rank))
        totals = [0.0, 0.0, 0.0]
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            logits = model(train_x[batch])
            loss = loss_fn(logits, train_y[batch])
            loss.backward()
            optimizer.step()
            totals[0] += loss.item() * len(batch)
            totals[1] += (logits.argmax(1) == train_y[batch]).sum().item()
            totals[2] += len(batch)
            if rank == 0:
                progress(epoch, step + 1, steps, loss.item())
        loss_sum, correct, count = averaged(totals)
        # a sharded optimizer gathers its full state from every rank: all of them ask
        state = optimizer.state_dict() if rank == 0 or args.sharded else None
        history.append({"epoch": epoch, "loss": loss_sum / count, "accuracy": correct / count})
        if rank == 0:
            print(f"  train loss {loss_sum / count:.4f} acc {correct / count:.3f}")
            os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": state,
                        "epoch": epoch}, args.checkpoint)

    model.eval()
    with torch.no_grad():
        correct = (model(test_x).argmax(1) == test_y).sum().item()
    _, correct, count = averaged([0.0, correct, len(test_x)])
    stats = hvd.ps_stats()
    mode = "ring" if stats is None else (
        f"PS, {stats['servers']} server(s) holding {stats['held_bytes']} B, {stats['placement']}")
    if args.ps_async:
        stale = optimizer.staleness()
        print(f"rank {rank}: {stale['updates']} asynchronous updates, staleness mean "
              f"{stale['mean']:.2f} max {stale['max']} (server steps)")
    if rank == 0:
        print(f"test accuracy {correct / count:.4f} on {int(count)} held-out digits "
              f"({size} ranks, {mode}, {time.time() - started:.1f} s of training)")
        if args.history:
            with open(args.history, "w") as handle:
                json.dump({"hook": args.comm_hook, "ranks": size, "epochs": history,
                           "test_accuracy": correct / count}, handle, indent=1)
        if args.save_params:
            np.savez(args.save_params, **{name: value.detach().cpu().numpy()
                                          for name, value in model.state_dict().items()})
    hvd.shutdown()


if __name__ == "__main__":
    main()
