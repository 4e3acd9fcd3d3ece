#!/usr/bin/env python
"""The phases of a two-rank ring, timed one by one: what the memory system charges for each.

Run under MPI with 2 ranks, e.g.  mpiexec -n 2 python scripts/bench_ring_phases.py

A ring of two ranks exchanges half of the buffer, adds, and exchanges the reduced half back.
Each phase is timed on its own (median over --iterations, per rank):

  send/recv   Sendrecv of half the buffer into a scratch array
  add         the reduction of the scratch into this rank's half, in place (a plain ring's)
  add again   the same reduction at once after it (its cache lines now held by this core)
  send back   Sendrecv of the reduced half (the peer reads it) into the other half
  recv (oop)  Sendrecv into a result array the peer read last time (an out-of-place ring's)
  add (oop)   the reduction written there, where the receive has just written

Where MPI moves large messages by single copy (Linux CMA: MPICH's default here,
MPIR_CVAR_CH4_CMA_ENABLE=0 turns it off), the peer's process reads this rank's memory itself;
its core then holds those lines, and the next write to them (the in-place add) waits for each
to be taken back. How long that takes depends on how far apart the two cores are, which on a
virtual machine can change from run to run: compare ``add`` with ``add again``.
"""

import argparse
import json
import os
import time

import numpy as np
from mpi4py import MPI

from benchinfo import machine_info, machine_line

COMM = MPI.COMM_WORLD
PHASES = ("send/recv", "add", "add again", "send back", "recv (oop)", "add (oop)")


def main():
    args = parse_args()
    if COMM.Get_size() != 2:
        raise SystemExit("bench_ring_phases.py runs with exactly 2 ranks (mpiexec -n 2)")
    rank, peer = COMM.Get_rank(), 1 - COMM.Get_rank()
    half = args.bytes // 8
    buffer = np.ones(2 * half, dtype=np.float32)
    mine, theirs = buffer[rank * half:(rank + 1) * half], buffer[peer * half:(peer + 1) * half]
    scratch = np.empty(half, dtype=np.float32)
    output = np.empty(half, dtype=np.float32)  # an out-of-place ring's result half
    times = {phase: [] for phase in PHASES}
    for iteration in range(args.iterations + args.warmup):
        COMM.Barrier()
        marks = [time.perf_counter()]
        # in place, as a plain ring: receive into scratch, add into this rank's half
        COMM.Sendrecv(theirs, peer, recvbuf=scratch, source=peer)
        marks.append(time.perf_counter())
        np.add(mine, scratch, out=mine)
        marks.append(time.perf_counter())
        np.subtract(mine, scratch, out=mine)  # the same pass again; keeps values bounded
        marks.append(time.perf_counter())
        COMM.Sendrecv(mine, peer, recvbuf=theirs, source=peer)
        marks.append(time.perf_counter())
        # out of place: receive into the result, add there; the peer then reads the result
        COMM.Sendrecv(theirs, peer, recvbuf=output, source=peer)
        marks.append(time.perf_counter())
        np.add(output, mine, out=output)
        marks.append(time.perf_counter())
        COMM.Sendrecv(output, peer, recvbuf=scratch, source=peer)
        if iteration >= args.warmup:
            for phase, start, stop in zip(PHASES, marks, marks[1:]):
                times[phase].append((stop - start) * 1e6)
    medians = {phase: float(np.median(values)) for phase, values in times.items()}
    rows = COMM.gather(medians, root=0)
    if rank == 0:
        cma = os.environ.get("MPIR_CVAR_CH4_CMA_ENABLE", "MPI's default")
        print(f"# two-rank ring phases, {args.bytes} B buffer (halves of {args.bytes // 2} B); "
              f"MPIR_CVAR_CH4_CMA_ENABLE: {cma}")
        print(machine_line(machine_info()))
        print(f"{'rank':>4} " + " ".join(f"{phase:>10}" for phase in PHASES) + "   (us)")
        for index, row in enumerate(rows):
            print(f"{index:>4} " + " ".join(f"{row[phase]:>10.1f}" for phase in PHASES))
        if args.json:
            print(json.dumps({"bytes": args.bytes, "cma": cma, "ranks": rows}))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=1 << 20, help="the whole buffer")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="also print the medians as JSON")
    return parser.parse_args()


if __name__ == "__main__":
    main()
