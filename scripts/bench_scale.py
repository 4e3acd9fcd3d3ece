#!/usr/bin/env python
"""Allreduce algorithms timed one against another, for the scale model (simulate_scale.py).

Run under MPI, e.g.  mpiexec -n 8 python scripts/bench_scale.py --json results/scale_8.json

Each algorithm runs alone on its own communicator (no negotiation): hororing's ring, its
Rabenseifner, recursive doubling and gathered path, on one node the allreduce through its
shared memory, and MPI_Allreduce; then the library's
whole path, hvd.allreduce with the algorithm it chooses by default and with the ring forced
(twice, as library_ring and library_ring_again: where the default chooses the ring itself,
the three columns time the same code, and the two forced ones show the run-to-run spread),
and on one node with the shared allreduce forced (library_shared: the route's choice
between the two, with everything the library's path adds to each).
``--shared-segments 4194304,16777216``: also the shared allreduce alone with those segments
(the ``shared`` column's segments are ``cost.SHARED_SEGMENT_BYTES``); these columns reduce
through the rows only, while ``library_shared`` goes around the node where the route's rule
says (``algorithms/shared.py``).
The gathered path (``small``) is not timed where it would hold more than half the node's
memory (every rank's buffer on each of the node's ranks): its cell reads "-" and its JSON row
has no time for it.
A Barrier precedes every call, so each call starts with every rank present and the time is
the slowest rank's, from the Barrier's end to its own return (taken as the maximum over
ranks). The library's calls after each change of algorithm (``--warmup`` of them, untimed)
are its first ones: they make the new plan (rows, lanes), which the later calls reuse, so the
library's columns time its steady state as the other columns do. Algorithms take turns in
--rounds rounds, sizes from --min-bytes to --max-bytes by factors of --factor (4); the median
over rounds is reported, and every result is checked against an exact reference (integer-valued
float32 inputs) on every rank.

It also measures the host's constants the model needs: one Python step (an 8-byte
Isend/Irecv exchange with a neighbour, through hororing's wait), numpy's add and copy on
4 MiB. --emulated names the link the ranks stand behind (for the JSON).
"""

import argparse
import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

import hororing as hvd
from benchinfo import machine_info, machine_line
from hororing import transport
from hororing.algorithms.halving import Rabenseifner, RecursiveDoubling
from hororing.algorithms.ring import Ring
from hororing.algorithms.shared import SharedMemory
from hororing.algorithms.small import GatherReduce
from hororing.config import Config

COMM = MPI.COMM_WORLD


def main():
    args = parse_args()
    hvd.init()
    rank, size = COMM.Get_rank(), COMM.Get_size()
    across_nodes = hvd.cross_size() > 1
    # the ring's pieces as the library cuts them: the sub-chunk, growing across nodes
    config = Config.from_environ()
    subchunk = config.subchunk_bytes(across_nodes)
    ceiling = config.piece_ceiling(across_nodes)
    own = COMM.Dup()
    algorithms = {
        "ring": Ring(own, subchunk, piece_ceiling=ceiling).allreduce,
        "rabenseifner": Rabenseifner(own, subchunk_bytes=subchunk).allreduce,
        "recursive_doubling": RecursiveDoubling(own, subchunk_bytes=subchunk).allreduce,
        "small": GatherReduce(own).allreduce,
        "mpi": lambda buffer, op: own.Allreduce(MPI.IN_PLACE, buffer, MPI.SUM),
    }
    shared = None
    windows = []  # the shared allreduces to free at the end
    if not across_nodes and size > 1:  # one node: the allreduce through its shared memory
        shared = SharedMemory(own.Split_type(MPI.COMM_TYPE_SHARED, key=rank))
        algorithms["shared"] = shared.allreduce
        windows.append(shared)
        for segment in args.shared_segments:  # and with other segments, a window each
            other = SharedMemory(own.Split_type(MPI.COMM_TYPE_SHARED, key=rank),
                                 segment_bytes=segment)
            algorithms[f"shared_{segment >> 10}KiB"] = other.allreduce
            windows.append(other)
    pipeline = hvd.context.current().engine.allreduce
    # the ring forced twice, under two names: the two columns' spread is what the same code
    # gives from run to run, against which the default's against the ring's is read
    library = {"library": None, "library_ring": "ring", "library_ring_again": "ring"}
    if shared is not None and pipeline.has("shared"):  # and the shared allreduce forced
        library["library_shared"] = "shared"
    constants = host_constants(own)
    if rank == 0:
        print(machine_line(machine_info()))
        print(f"# {size} ranks, {hvd.cross_size()} node(s); link: {args.emulated}; "
              f"host: step {constants['step_s'] * 1e6:.1f} us (pairs "
              f"{constants['pair_step_s'] * 1e6:.1f}, MPI's {constants['mpi_step_s'] * 1e6:.1f})"
              f", add "
              f"{constants['reduce_Bps'] / 1e9:.2f} GB/s, copy {constants['copy_Bps'] / 1e9:.2f}"
              f" GB/s")
        print(f"{'bytes':>10} " + " ".join(f"{name:>18}" for name in
                                           list(algorithms) + list(library)) + "  chosen")
    rows = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        count = max(1, nbytes // 4)
        inputs = np.arange(count, dtype=np.float32) % 7 + rank
        expected = (np.arange(count, dtype=np.float32) % 7) * size + size * (size - 1) / 2
        with pipeline.watch() as seen:
            check = hvd.allreduce(inputs, op=hvd.Sum, name=f"scale.check.{count}")
        chosen = seen[0][0] if seen else "?"
        wrong = int(np.count_nonzero(check != expected))
        # the gathered path holds every rank's buffer on every rank: where the node's ranks
        # together would need more than half its memory for that, it is not timed ("-")
        names = [name for name in algorithms
                 if name != "small" or gathered_fits(count * 4, size, hvd.local_size())]
        for run in (algorithms[name] for name in names):
            buffer = inputs.copy()
            run(buffer, "sum")
            wrong += int(np.count_nonzero(buffer != expected))
        times = {name: [] for name in names + list(library)}
        calls = max(args.min_calls,
                    min(args.max_calls, int(args.seconds / max(nbytes * 4e-9, 1e-4))))
        for round_index in range(args.rounds):
            names = list(times)
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                if name in algorithms:
                    times[name].append(timed(algorithms[name], inputs, calls))
                else:
                    times[name].append(timed_library(pipeline, library[name], inputs, calls,
                                                     f"scale.{name}.{count}", args.warmup))
        wrong = COMM.allreduce(wrong)
        row = {"bytes": count * 4, "chosen": chosen, "wrong": wrong,
               "time_us": {name: float(np.median(values)) * 1e6
                           for name, values in times.items()},
               "round_times_us": {name: [value * 1e6 for value in values]
                                  for name, values in times.items()}}
        rows.append(row)
        if rank == 0:
            cells = (f"{row['time_us'][name]:>18.1f}" if name in times else f"{'-':>18}"
                     for name in list(algorithms) + list(library))
            print(f"{count * 4:>10} " + " ".join(cells) + f"  {chosen}"
                  + (f"  WRONG {wrong}" if wrong else ""), flush=True)
        nbytes *= args.factor
    if rank == 0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump({"ranks": size, "nodes": hvd.cross_size(), "link": args.emulated,
                       "subchunk_bytes": subchunk, "piece_ceiling": ceiling,
                       "host": socket.gethostname(),
                       "machine": machine_info(), "constants": constants, "rows": rows,
                       "date": time.strftime("%Y-%m-%d")}, handle, indent=1)
    for window in windows:
        window.free()
    own.Free()
    hvd.shutdown()
    return 1 if any(row["wrong"] for row in rows) else 0


def gathered_fits(nbytes, size, local_size):
    """Whether the gathered path's rows (every rank's ``nbytes`` on each of the node's
    ``local_size`` ranks) take at most half the node's memory."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return local_size * size * nbytes <= memory // 2


def timed(run, inputs, calls, warmup=0):
    """The slowest rank's mean seconds per call, a Barrier before each, after ``warmup``
    calls not timed."""
    buffer = inputs.copy()
    for _ in range(warmup):
        buffer[...] = inputs
        COMM.Barrier()
        run(buffer, "sum")
    total = 0.0
    for _ in range(calls):
        buffer[...] = inputs
        COMM.Barrier()
        started = time.perf_counter()
        run(buffer, "sum")
        total += time.perf_counter() - started
    return COMM.allreduce(total / calls, op=MPI.MAX)


def timed_library(pipeline, kind, inputs, calls, name, warmup):
    pipeline.force(kind)
    try:
        def run(buffer, op):
            hvd.allreduce_(buffer, op=hvd.Sum, name=name)
        return timed(run, inputs, calls, warmup)
    finally:
        pipeline.force(None)


def host_constants(comm):
    """One Python exchange step (8 bytes) with both ring neighbours and with partners
    rank XOR 1, 2, 4, ... (as the halving algorithms pair), one step of MPI's own
    (an 8-byte MPI_Allreduce over ceil(log2 n) steps), numpy's add and copy.

    Each step time is the median over BLOCKS blocks of the slowest rank's mean step: with a
    core per rank, one rank descheduled once in a single long block moved a 16-rank run's
    step from 6-9 us to 19.8 (the model prices every algorithm's steps by it)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    send, receive = np.zeros(2, np.float32), np.zeros(2, np.float32)
    steps = 20

    def median_block(block):
        """The median over BLOCKS of the slowest rank's mean seconds per step of block()."""
        times = []
        for _ in range(BLOCKS):
            comm.Barrier()
            started = time.perf_counter()
            block()
            times.append(comm.allreduce((time.perf_counter() - started) / steps, op=MPI.MAX))
        return float(np.median(times))

    def exchange_steps(peers):
        def block():
            for index in range(steps):
                send_to, recv_from = peers(index)
                requests = [comm.Irecv(receive, recv_from), comm.Isend(send, send_to)]
                for request in requests:
                    transport.wait(request)
        return median_block(block)
    step_s = exchange_steps(lambda index: (right, left))
    power = 1 << (size.bit_length() - 1)
    rounds = max(1, power.bit_length() - 1)

    def partner(index):
        other = rank ^ (1 << (index % rounds)) if rank < power else rank
        other = other if other < size and other != rank else (rank + 1) % size
        return other, other
    pair_step_s = exchange_steps(partner) if power == size else step_s

    def mpi_block():
        for _ in range(steps):
            comm.Allreduce(MPI.IN_PLACE, send, MPI.SUM)
    mpi_step_s = median_block(mpi_block) / max(1, (size - 1).bit_length())
    a, b = np.ones(1 << 20, np.float32), np.ones(1 << 20, np.float32)
    started = time.perf_counter()
    for _ in range(20):
        np.add(a, b, out=a)
    reduce_Bps = 20 * a.nbytes / (time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(20):
        np.copyto(a, b)
    copy_Bps = 20 * a.nbytes / (time.perf_counter() - started)
    return {"step_s": step_s, "pair_step_s": pair_step_s, "mpi_step_s": mpi_step_s,
            "reduce_Bps": comm.allreduce(reduce_Bps, op=MPI.MIN),
            "copy_Bps": comm.allreduce(copy_Bps, op=MPI.MIN)}


BLOCKS = 10  # blocks of 20 steps per host constant


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-bytes", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--factor", type=int, default=4,
                        help="each size this many times the one before")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.05,
                        help="about how long one algorithm's block of calls takes")
    parser.add_argument("--max-calls", type=int, default=20)
    parser.add_argument("--min-calls", type=int, default=1,
                        help="timed calls per block at least (--seconds gives one at 16 MiB)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed library calls after each change of algorithm")
    parser.add_argument("--emulated", default="this host (no shaping)",
                        help="the link the ranks stand behind, for the JSON")
    parser.add_argument("--shared-segments", default=[],
                        type=lambda text: [int(part) for part in text.split(",")],
                        help="on one node, also the shared allreduce with segments of these "
                             "bytes (comma-separated), a column each (shared_<KiB>KiB)")
    parser.add_argument("--json", help="write the results here (rank 0)")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
