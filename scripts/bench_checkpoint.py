#!/usr/bin/env python
"""Checkpoints of a sharded Adam: hvd.checkpoint against gathering the full state.

Run under MPI (one job per row; the directory must be one every rank sees):

  mpiexec -n 4 python scripts/bench_checkpoint.py --params 100e6 --dir /tmp/ckpt-bench

An MLP of --params float32 parameters (square layers of --width) trains under
``DistributedOptimizer(Adam, sharded=True)``. Then, in this order, on the same state:

- ``gather``: what a sharded optimizer offered before: ``optimizer.state_dict()`` (the full
  state gathered on every rank) and rank 0 ``torch.save``s it with the model.
- ``save``: ``hvd.checkpoint.save`` (each rank writes its slice; the parameters once).
- ``async1``, ``async``: ``hvd.checkpoint.async_save``'s call, the first (which allocates
  the staging memory) and the second (which reuses it, as every later save of a run does);
  training steps run while the second writes, each against the median of the quiet steps
  taken before the saves and after the write (``--quiet-steps`` on each side).
  ``--rounds N`` repeats the later save and its steps N times (the median call is shown).
  The steps during the writes are compared with the quiet ones twice: median against
  median, 90th percentile against 90th percentile; the first step after each call (which
  waits for the copy of the parameters and the optimizer's state) is shown apart.
- ``load``: ``hvd.checkpoint.load`` into a fresh model and optimizer.

Peak memory is the resident set size sampled every millisecond by a thread while the call
runs, less the size before it: what the call adds. Beside it: this rank's shard of the Adam
state and the largest bucket (the bound a save should stay under). Prints one table; ``--json``
prints the rows.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time

import torch
from mpi4py import MPI

import hororing.torch as hvd
from benchinfo import machine_info, machine_line

COMM = MPI.COMM_WORLD
PAGE = os.sysconf("SC_PAGE_SIZE")


def percentile(values, percent):
    """The ``percent``-th percentile of ``values``, interpolated between the nearest two."""
    ordered = sorted(values)
    place = (len(ordered) - 1) * percent / 100
    low = int(place)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (place - low)


def resident():
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * PAGE


class Peak:
    """The most resident memory above the start, sampled every millisecond."""

    def __enter__(self):
        self.start = self.peak = resident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, resident())
            time.sleep(0.001)

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident())
        self.added = self.peak - self.start


def build(params, width):
    layers = max(1, round(params / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def step(model, optimizer, data):
    optimizer.zero_grad()
    model(data).pow(2).mean().backward()
    optimizer.step()


def steps_until(model, optimizer, data, done):
    """The times of the steps run until ``done(steps so far)`` holds on every rank. The ranks
    meet before each step to ask (an allreduce), as they must during a write to know whether
    every rank's write has ended; quiet steps are timed the same way, with nothing sampling
    beside them, so that the two compare."""
    times = []
    while COMM.allreduce(0 if done(len(times)) else 1):
        start = time.perf_counter()
        step(model, optimizer, data)
        times.append(time.perf_counter() - start)
    return times


def timed(action):
    COMM.Barrier()
    with Peak() as peak:
        start = time.perf_counter()
        action()
        seconds = time.perf_counter() - start
    return seconds, peak.added


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dir", default="/tmp/hororing-bench-checkpoint")
    parser.add_argument("--quiet-steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="later async saves, each with the steps during its write")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(0)
    model = build(int(args.params), args.width)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                         sharded=True)
    data = torch.randn(args.batch_size, args.width,
                       generator=torch.Generator().manual_seed(hvd.rank()))
    step(model, optimizer, data)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    shard = sum(value.nbytes for state in optimizer.state.values()
                for value in state.values() if torch.is_tensor(value))
    bucket = max((bucket.high - bucket.low) * 4 for vectors in optimizer._vectors
                 for vector in vectors for bucket in vector.buckets)
    if hvd.rank() == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    COMM.Barrier()
    rows = {}

    def gather():
        state = optimizer.state_dict()
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": state},
                       os.path.join(args.dir, "gathered.pt"))
        del state
    rows["gather"] = timed(gather)
    rows["save"] = timed(lambda: hvd.checkpoint.save(os.path.join(args.dir, "dcp"), model,
                                                     optimizer, step=1))
    quiet = steps_until(model, optimizer, data, lambda stepped: stepped >= args.quiet_steps)
    handle = []
    # the first async save allocates its staging memory; later ones (a training run's every
    # save after its first) copy into it
    rows["async1"] = timed(lambda: handle.append(hvd.checkpoint.async_save(
        os.path.join(args.dir, "dcp-async"), model, optimizer, step=2)))
    handle.pop().wait()
    during, calls, writes = [], [], []
    firsts = []  # per step during a write: whether it is the first after the call
    for _ in range(args.rounds):  # a later save, steps while it writes, quiet steps again
        calls.append(timed(lambda: handle.append(hvd.checkpoint.async_save(
            os.path.join(args.dir, "dcp-async"), model, optimizer, step=2))))
        write_start = time.perf_counter()
        # every rank steps (once at least) until every rank's write is done
        times = steps_until(model, optimizer, data,
                            lambda stepped: stepped > 0 and handle[0].done())
        during += times
        firsts += [index == 0 for index in range(len(times))]
        handle.pop().wait()
        writes.append(time.perf_counter() - write_start)
        # the machine's own drift, on both sides
        quiet += steps_until(model, optimizer, data,
                             lambda stepped: stepped >= args.quiet_steps)
    # the median round's call (its seconds, and the most memory any round's call added)
    rows["async"] = (statistics.median(call[0] for call in calls), max(call[1] for call in calls))
    write_seconds = statistics.median(writes)
    fresh = build(int(args.params), args.width)
    fresh_optimizer = hvd.DistributedOptimizer(torch.optim.Adam(fresh.parameters(), lr=1e-4),
                                               sharded=True)
    rows["load"] = timed(lambda: hvd.checkpoint.load(os.path.join(args.dir, "dcp"), fresh,
                                                     fresh_optimizer))
    files = sorted((name, os.path.getsize(os.path.join(args.dir, "dcp", name)))
                   for name in os.listdir(os.path.join(args.dir, "dcp")))
    gathered = COMM.gather({name: (seconds, added) for name, (seconds, added) in rows.items()})
    steps = COMM.gather((quiet, during))
    if hvd.rank() != 0:
        return
    size = hvd.size()
    table = []
    for name in rows:
        seconds = max(rank[name][0] for rank in gathered)
        added = [rank[name][1] for rank in gathered]
        table.append({"what": name, "ranks": size, "params": parameters,
                      "seconds": round(seconds, 3), "peak_added_mb_per_rank":
                      [round(value / 2**20) for value in added],
                      "shard_plus_bucket_mb": round((shard + bucket) / 2**20)})
    # a step's time is its slowest rank's, quiet or during the write alike
    quiet_steps = [max(values) for values in zip(*(rank[0] for rank in steps))]
    quiet_step = statistics.median(quiet_steps)
    during_steps = [max(values) for values in zip(*(rank[1] for rank in steps))]
    compared = {"median": (statistics.median(during_steps) / quiet_step),
                "p90": percentile(during_steps, 90) / percentile(quiet_steps, 90)}
    # the first step after each call waits for the copy of the parameters and the state
    first_steps = [value for value, first in zip(during_steps, firsts) if first]
    later_steps = [value for value, first in zip(during_steps, firsts) if not first]
    total = sum(size for _, size in files)
    if args.json:
        print(json.dumps({"rows": table, "quiet_step": quiet_step, "quiet_steps": quiet_steps,
                          "steps_during_async":
                          during_steps, "async_write_seconds": write_seconds,
                          "during_over_quiet": compared, "first_steps": first_steps,
                          "files": files}))
        return
    print(machine_line(machine_info()))
    print(f"{size} ranks, {parameters / 1e6:.1f} M parameters, Adam sharded=True; this "
          f"rank's shard {shard / 2**20:.0f} MiB, largest bucket {bucket / 2**20:.0f} MiB")
    print(f"{'what':8} {'seconds':>8}  peak added per rank (MiB)")
    for row in table:
        print(f"{row['what']:8} {row['seconds']:8.3f}  {row['peak_added_mb_per_rank']}")
    save_seconds = next(row["seconds"] for row in table if row["what"] == "save")
    async_seconds = next(row["seconds"] for row in table if row["what"] == "async")
    print(f"async_save's call / save: {async_seconds / save_seconds:.3f}; background write "
          f"{write_seconds:.2f} s")
    print(f"quiet step {quiet_step:.3f} s (median of {len(quiet_steps)}, before the saves and "
          f"after the write; they range {min(quiet_steps) / quiet_step:.2f}-"
          f"{max(quiet_steps) / quiet_step:.2f}x of it); steps during the write: "
          + ", ".join(f"{value:.3f} ({value / quiet_step:.2f}x)" for value in during_steps)
          + f"; their median {statistics.median(during_steps) / quiet_step:.2f}x")
    print(f"during the write / quiet, {len(during_steps)} against {len(quiet_steps)} steps: "
          f"median {compared['median']:.2f}x, 90th percentile {compared['p90']:.2f}x "
          f"({percentile(during_steps, 90):.3f} against {percentile(quiet_steps, 90):.3f} s)")
    if later_steps:
        print("the first step after each call (it waits for the copy): "
              + ", ".join(f"{value / quiet_step:.2f}x" for value in first_steps)
              + f"; the later steps: median {statistics.median(later_steps) / quiet_step:.2f}x, "
              f"90th percentile {percentile(later_steps, 90) / percentile(quiet_steps, 90):.2f}x"
              f" of the quiet ones'")
    print("files: " + ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in files)
          + f"; largest {max(size for _, size in files) / total:.0%} of {total / 2**20:.0f} MiB")


if __name__ == "__main__":
    sys.exit(main())
