#!/usr/bin/env python
"""A small blocking allreduce made between other work, against MPI_Allreduce in the same loop.

Run under MPI, e.g.  mpiexec -n 2 python scripts/bench_small_between_work.py

A training step calls its collectives between other work: a forward pass, a data loader, a
metric reduced with plain MPI. Each row is a loop in which every rank does some work, then
one blocking allreduce of --bytes (float32); only the collective call is timed. The same loop
runs with hvd.allreduce_ and with MPI_Allreduce, taking turns in --rounds rounds.

  back-to-back  no work between calls
  compute       numpy work on 8 MB of arrays (~0.3-1 ms, every rank the same)
  mpi           an MPI_Allreduce of 64 KiB on another communicator (work that is itself
                communication, as a metric or a holdout evaluation does)
  sleep         time.sleep(300 us) (a rank waiting on I/O or its GPU)

Columns: the median call (us) over the round's calls, on the slowest rank (median of rounds),
for hororing and MPI, and MPI's speed relative to hororing's (MPI time / hororing time: 1.0 is
parity, 0.33 means hororing takes three times as long).
"""

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

import hororing as hvd
from benchinfo import machine_info, machine_line

COMM = MPI.COMM_WORLD


def main():
    args = parse_args()
    hvd.init()
    other = COMM.Dup()
    buffer = np.zeros(args.bytes // 4, dtype=np.float32)  # sums of zeros stay finite
    left, right = np.ones(1 << 20, np.float32), np.ones(1 << 20, np.float32)
    metric = np.ones(16384, np.float32)

    def compute():
        for _ in range(4):
            np.add(left, right, out=left)

    def mpi():
        other.Allreduce(MPI.IN_PLACE, metric)

    works = {"back-to-back": None, "compute": compute, "mpi": mpi,
             "sleep": lambda: time.sleep(300e-6)}
    calls = {"hororing": lambda: hvd.allreduce_(buffer, op=hvd.Sum, name="between.work"),
             "mpi": lambda: COMM.Allreduce(MPI.IN_PLACE, buffer)}
    rows = []
    if COMM.Get_rank() == 0:
        print(f"# {args.bytes} B blocking allreduce between other work, {COMM.Get_size()} ranks")
        print(f"{machine_line(machine_info())}")
        print(f"{'work':>14} {'hororing(us)':>13} {'MPI(us)':>9} {'MPI/hororing':>13}")
    for label, work in works.items():
        rounds = {name: [] for name in calls}
        for round_index in range(args.rounds):
            order = list(calls) if round_index % 2 == 0 else list(calls)[::-1]
            for name in order:
                rounds[name].append(timed(calls[name], work, args.calls))
        row = {"work": label, **{f"{name}_us": float(np.median(times)) for name, times in
                                 rounds.items()}}
        row["ratio"] = row["mpi_us"] / row["hororing_us"]
        rows.append(row)
        if COMM.Get_rank() == 0:
            print(f"{label:>14} {row['hororing_us']:>13.1f} {row['mpi_us']:>9.1f} "
                  f"{row['ratio']:>13.2f}", flush=True)
    check(buffer)
    if args.json and COMM.Get_rank() == 0:
        with open(args.json, "w") as handle:
            json.dump({"ranks": COMM.Get_size(), "machine": machine_info(), "rows": rows},
                      handle, indent=1)
    other.Free()
    hvd.shutdown()


def timed(call, work, count):
    """The median time of ``call`` over ``count`` iterations of work-then-call, slowest rank."""
    for _ in range(10):
        if work is not None:
            work()
        call()
    COMM.Barrier()
    times = np.empty(count)
    for index in range(count):
        if work is not None:
            work()
        started = time.perf_counter()
        call()
        times[index] = time.perf_counter() - started
    return COMM.allreduce(float(np.median(times)), op=MPI.MAX) * 1e6


def check(buffer):
    """The allreduce sums right (one untimed call on fresh values)."""
    rank, size = COMM.Get_rank(), COMM.Get_size()
    buffer[...] = rank + 1
    hvd.allreduce_(buffer, op=hvd.Sum, name="between.work")
    if not np.all(buffer == size * (size + 1) / 2):
        sys.exit(f"rank {rank}: wrong sum from hororing")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=500, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the rows here (rank 0)")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
