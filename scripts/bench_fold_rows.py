#!/usr/bin/env python
"""The fold's exchange written out by hand: rows gathered by MPI against rows in shared memory.

Run under MPI on one node, e.g.  mpiexec -n 2 python scripts/bench_fold_rows.py

A folded allreduce (hororing/engine/fold.py) is one exchange of every rank's row (a header
and the data), then a reduction of the rows in rank order. This times that exchange with no
engine around it, three ways taking turns, a Barrier before each call:

  gathered  the row copied into a send buffer, one persistent MPI_Allgather, the headers
            compared, the rows reduced (the fold's path across nodes, and below 8 KiB)
  shared    the row written into this rank's slot of a shared-memory window of the node
            (two sets of slots used in turn), one barrier, the headers compared, the rows
            reduced from the window (engine/exchange.py's SharedRows)
  MPI       MPI_Allreduce in place, the floor

Both folds are checked against the sum every call. The time is the slowest rank's median.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from benchinfo import machine_info, machine_line, parse_size

COMM = MPI.COMM_WORLD
HEAD = 16  # two int64 fields, as the fold's rows
LINE = 64


def main():
    args = parse_args()
    rank, size = COMM.Get_rank(), COMM.Get_size()
    node = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    if node.Get_size() != size:
        sys.exit("bench_fold_rows.py: every rank must be on one node (shared memory)")
    if rank == 0:
        print(machine_line(machine_info()))
        print(f"# {size} ranks; medians in us of {args.calls} calls, a Barrier before each")
        print(f"{'bytes':>9} {'gathered':>10} {'shared':>10} {'MPI':>8} {'MPI/gathered':>13} "
              f"{'MPI/shared':>11}")
    wrong = 0
    for nbytes in args.sizes:
        times, bad = run_size(node, nbytes // 4, args.calls)
        wrong += bad
        medians = {name: COMM.allreduce(statistics.median(values), op=MPI.MAX) * 1e6
                   for name, values in times.items()}
        if rank == 0:
            print(f"{nbytes:>9} {medians['gathered']:>10.1f} {medians['shared']:>10.1f} "
                  f"{medians['mpi']:>8.1f} {medians['mpi'] / medians['gathered']:>13.2f} "
                  f"{medians['mpi'] / medians['shared']:>11.2f}")
    wrong = COMM.allreduce(wrong)
    node.Free()
    if rank == 0 and wrong:
        print(f"WRONG: {wrong} results")
    return 1 if wrong else 0


def run_size(node, count, calls):
    rank, size = COMM.Get_rank(), COMM.Get_size()
    width = HEAD + 4 * count
    pitch = -(-width // LINE) * LINE
    window = MPI.Win.Allocate_shared(2 * size * pitch if node.Get_rank() == 0 else 0, 1,
                                     comm=node)
    memory, _ = window.Shared_query(0)
    sets = np.frombuffer(memory, dtype=np.uint8, count=2 * size * pitch).reshape(2, size, pitch)
    window.Lock_all(MPI.MODE_NOCHECK)
    row = np.zeros(width, dtype=np.uint8)
    rows = np.zeros((size, width), dtype=np.uint8)
    gather = COMM.Allgather_init(row, rows)
    header = np.array([-1, 7], dtype=np.int64)
    data = np.empty(count, dtype=np.float32)
    out = np.empty(count, dtype=np.float32)
    floor = np.empty(count, dtype=np.float32)
    turn = [0]

    def reduce(all_rows):
        if all_rows[:, :HEAD].tobytes() != header.tobytes() * size:
            raise RuntimeError("the rows' headers differ")
        values = all_rows[:, HEAD:width].view(np.float32)
        np.copyto(out, values[0])
        for other in values[1:]:
            np.add(out, other, out=out)

    def gathered():
        row[:HEAD].view(np.int64)[:] = header
        row[HEAD:].view(np.float32)[:] = data
        gather.Start()
        wait(gather)
        reduce(rows)

    def shared():
        turn[0] ^= 1
        slots = sets[turn[0]]
        mine = slots[rank]
        mine[:HEAD].view(np.int64)[:] = header
        mine[HEAD:width].view(np.float32)[:] = data
        window.Sync()
        wait(node.Ibarrier())
        window.Sync()
        reduce(slots)

    def mpi():
        COMM.Allreduce(MPI.IN_PLACE, floor)

    times = {"gathered": [], "shared": [], "mpi": []}
    runs = {"gathered": gathered, "shared": shared, "mpi": mpi}
    expected = np.float32(sum(range(1, size + 1)))
    bad = 0
    for index in range(calls + 20):
        order = list(runs) if index % 2 else list(runs)[::-1]
        for name in order:
            data[...] = rank + 1
            floor[...] = rank + 1
            COMM.Barrier()
            started = time.perf_counter()
            runs[name]()
            if index >= 20:
                times[name].append(time.perf_counter() - started)
            if name != "mpi":
                bad += int(np.count_nonzero(out != expected))
    gather.Free()
    window.Unlock_all()
    window.Free()
    return times, bad


def wait(request):
    """Spin on ``request``, yielding the core between tests (ranks may share cores)."""
    while not request.Test():
        os.sched_yield()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda text: [parse_size(part) for part in text.split(",")],
                        default=[4096, 8192, 16384, 32768, 65536, 262144])
    parser.add_argument("--calls", type=int, default=2000)
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
