#!/usr/bin/env python
"""A blocking allreduce when the ranks arrive at different times, against MPI and a plain ring.

Run under MPI, e.g.  mpiexec -n 2 python scripts/bench_skewed_arrival.py

Every rank of a real job reaches its collective at its own time: one finished its forward
pass a little earlier, another waited on its data loader. Each iteration here is: a Barrier,
then a random wait of 0 to --skew-us microseconds drawn per rank (busy, as compute is), then one
timed blocking allreduce (Sum, float32) of the row's size. The implementations take turns
inside every iteration (the order rotates), so each sees the same machine state:

  hororing   hvd.allreduce_ on a numpy array (hororing's numpy API)
  torch      hororing.torch.allreduce_ on a CPU tensor (the verb a torch script calls)
  MPI        MPI_Allreduce on the same communicator (the MPI's own algorithm choice)
  ring       a plain ring in Python: scatter-reduce then allgather, one Sendrecv per step
             and np.add, no pipelining (what a user would write in twenty lines)

A rank's time runs from its own arrival to its return, so an early rank's time includes the
wait for the last one, for every implementation alike. Each cell is the median over the
iterations of the mean over ranks (us); the ratios are the other's time over hororing's (1.0
is parity, above 1 hororing is faster).
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
DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB,64MiB"


def main():
    args = parse_args()
    hvd.init()
    calls = {"hororing": None, "mpi": None, "ring": None}
    torch_hvd = None
    if not args.no_torch:
        import torch
        import hororing.torch as torch_hvd
        torch.set_num_threads(1)
        calls["torch"] = None
    rank, size = COMM.Get_rank(), COMM.Get_size()
    rng = np.random.default_rng(1000 + rank)
    rows = []
    if rank == 0:
        print(f"# blocking allreduce after a Barrier and a random 0-{args.skew_us:g} us skew "
              f"per rank, {size} ranks")
        print(machine_line(machine_info()))
        heads = ["size", "hororing", "torch", "MPI", "ring", "MPI/hvd", "ring/hvd",
                 "MPI/torch", "ring/torch"]
        print(" ".join(f"{head:>10}" for head in heads))
    for nbytes in args.sizes:
        count = nbytes // 4
        buffer = np.zeros(count, dtype=np.float32)  # sums of zeros stay finite
        scratch = np.empty(-(-count // size) + 1, dtype=np.float32)
        calls["hororing"] = lambda: hvd.allreduce_(buffer, op=hvd.Sum, name="skewed")
        calls["mpi"] = lambda: COMM.Allreduce(MPI.IN_PLACE, buffer)
        calls["ring"] = lambda: plain_ring(buffer, scratch)
        if torch_hvd is not None:
            tensor = torch.zeros(count, dtype=torch.float32)
            calls["torch"] = lambda: torch_hvd.allreduce_(tensor, op=torch_hvd.Sum,
                                                          name="skewed.torch")
        iterations = args.calls or max(20, min(400, (256 << 20) // max(nbytes, 1)))
        names = list(calls)
        times = {name: np.empty(iterations) for name in names}
        for _ in range(5):  # warm up: caches, the negotiation's cache, the fold
            for name in names:
                calls[name]()
        for index in range(iterations):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                COMM.Barrier()
                spin(rng.uniform(0.0, args.skew_us) * 1e-6)
                started = time.perf_counter()
                calls[name]()
                times[name][index] = time.perf_counter() - started
        row = {"bytes": nbytes, "iterations": iterations}
        for name in names:
            every = np.empty((size, iterations)) if rank == 0 else None
            COMM.Gather(times[name], every, root=0)
            if rank == 0:
                row[f"{name}_us"] = float(np.median(every.mean(axis=0))) * 1e6
        if rank == 0:
            for verb in ("hororing", "torch"):
                if f"{verb}_us" in row:
                    row[f"mpi_over_{verb}"] = row["mpi_us"] / row[f"{verb}_us"]
                    row[f"ring_over_{verb}"] = row["ring_us"] / row[f"{verb}_us"]
            rows.append(row)
            cells = [human(nbytes)] + [f"{row.get(key, float('nan')):.1f}" for key in
                                       ("hororing_us", "torch_us", "mpi_us", "ring_us")]
            cells += [f"{row.get(key, float('nan')):.2f}" for key in
                      ("mpi_over_hororing", "ring_over_hororing", "mpi_over_torch",
                       "ring_over_torch")]
            print(" ".join(f"{cell:>10}" for cell in cells), flush=True)
    check()
    if args.json and rank == 0:
        with open(args.json, "w") as handle:
            json.dump({"ranks": size, "skew_us": args.skew_us, "machine": machine_info(),
                       "rows": rows}, handle, indent=1)
    hvd.shutdown()


def spin(seconds):
    """Busy for ``seconds`` (compute, not a sleep: the core stays taken)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def plain_ring(buffer, scratch):
    """Sum ``buffer`` over COMM in place: scatter-reduce then allgather around the ring."""
    size, rank = COMM.Get_size(), COMM.Get_rank()
    if size == 1:
        return
    chunks = np.array_split(buffer, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send, receive = (rank - step) % size, (rank - step - 1) % size
        incoming = scratch[:chunks[receive].size]
        COMM.Sendrecv(chunks[send], right, recvbuf=incoming, source=left)
        np.add(chunks[receive], incoming, out=chunks[receive])
    for step in range(size - 1):
        send, receive = (rank - step + 1) % size, (rank - step) % size
        COMM.Sendrecv(chunks[send], right, recvbuf=chunks[receive], source=left)


def check():
    """Each implementation sums right on fresh values, not divisible by the rank count."""
    rank, size = COMM.Get_rank(), COMM.Get_size()
    expected = np.float32(size * (size + 1) / 2)
    for label, run in (("hororing", lambda a: hvd.allreduce_(a, op=hvd.Sum, name="skewed.check")),
                       ("ring", lambda a: plain_ring(a, np.empty(a.size, np.float32)))):
        values = np.full(1001, rank + 1, dtype=np.float32)
        run(values)
        if not np.all(values == expected):
            sys.exit(f"rank {rank}: wrong sum from {label}")


def human(nbytes):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


def parse_size(text):
    text = text.strip()
    for unit, shift in (("KiB", 10), ("MiB", 20), ("GiB", 30)):
        if text.endswith(unit):
            return int(text[:-len(unit)]) << shift
    return int(text)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        type=lambda text: [parse_size(part) for part in text.split(",")],
                        help=f"comma-separated sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--skew-us", type=float, default=200.0,
                        help="each rank waits a random 0..skew us before each call")
    parser.add_argument("--calls", type=int, default=0,
                        help="iterations per size (default: 400 for small sizes, fewer above)")
    parser.add_argument("--no-torch", action="store_true", help="leave out the torch verb")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
