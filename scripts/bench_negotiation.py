#!/usr/bin/env python
"""What one negotiation cycle costs as the job grows: time and bytes per cycle.

Run under MPI at several sizes, e.g.
    for n in 2 4 8 16; do mpiexec -n $n python scripts/bench_negotiation.py; done

Rows, all from the same run:
  barrier    hvd.barrier() in a loop: a cycle of the engine with nothing to move (its name
             is cached after the first call), so the time is the negotiation alone, with
             the Python around it
  allreduce  a blocking 4-byte hvd.allreduce of a cached name: negotiation and a tiny
             data exchange (its result is checked once, untimed: "wrong" counts bad ranks)
  gather     the exchange alone, as one header row per rank gathered to every rank
             (MPI_Iallgather of the header: the bytes grow with the ranks)
  vote       the exchange alone, as one fixed-size bitwise-AND reduction of the same
             words (MPI_Iallreduce with MPI_BAND: the bytes do not grow)

bytes/cycle is what each rank receives per cycle for gather and vote (the header has
4 + ceil(capacity / 64) words; the vote 1 + ceil(capacity / 64)); for barrier and
allreduce it is the engine's own count of negotiation bytes received, per cycle, and
"gathers" counts the cycles that needed the full exchange (a new name or a flag).

Times: the median over --rounds rounds of a block's mean per call, slowest rank.
"""

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

import hororing as hvd
from benchinfo import machine_info, machine_line
from hororing.context import current
from hororing.engine.negotiation import header_words, vote_words

COMM = MPI.COMM_WORLD


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--seconds", type=float, default=0.3, help="time per block")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="append the rows as one JSON line to this file (rank 0)")
    args = parser.parse_args()
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    engine = current().engine
    capacity = engine.config.cache_capacity
    value = np.ones(1, dtype=np.float32)

    def barrier():
        hvd.barrier()

    def allreduce():
        return hvd.allreduce(value, name="bench.negotiation", op=hvd.Sum)

    comm = COMM.Dup()
    header = np.zeros(header_words(capacity), dtype=np.int64)
    headers = np.zeros((size, header.size), dtype=np.int64)
    vote = np.full(vote_words(capacity), -1, dtype=np.int64)
    agreed = np.empty_like(vote)

    def gather():
        comm.Iallgather(header, headers).Wait()

    def reduce_vote():
        comm.Iallreduce(vote, agreed, op=MPI.BAND).Wait()

    cases = {"barrier": barrier, "allreduce": allreduce, "gather": gather, "vote": reduce_vote}
    exchange_bytes = {"gather": headers.nbytes, "vote": agreed.nbytes}
    rows = []
    if rank == 0:
        print(machine_line(machine_info()))
        print(f"# negotiation, {size} ranks, cache capacity {capacity}")
        print(f"{'case':>10} {'time(us)':>10} {'bytes/cycle':>12} {'gathers':>8}")
    for name, run in cases.items():
        for _ in range(20):
            run()
        before = engine.stats()
        times, calls = timed(run, args)
        after = engine.stats()
        cycles = after["cycles"] - before["cycles"]
        if name in exchange_bytes:
            per_cycle, gathers = exchange_bytes[name], 0
        else:
            per_cycle = (after["received_bytes"] - before["received_bytes"]) / max(cycles, 1)
            gathers = after["gather_cycles"] - before["gather_cycles"]
        wrong = 0
        if name == "allreduce":  # checked outside the timing: every rank's sum is the size
            wrong = COMM.allreduce(int(allreduce()[0] != size), op=MPI.SUM)
        row = {"case": name, "ranks": size, "time_us": float(np.median(times)) * 1e6, "wrong": wrong,
               "round_times_us": [t * 1e6 for t in times], "bytes_per_cycle": per_cycle,
               "gather_cycles": COMM.allreduce(gathers, op=MPI.MAX), "calls": calls}
        rows.append(row)
        if rank == 0:
            print(f"{name:>10} {row['time_us']:>10.1f} {per_cycle:>12.0f} "
                  f"{row['gather_cycles']:>8}", flush=True)
    comm.Free()
    if rank == 0 and args.json:
        with open(args.json, "a") as handle:
            handle.write(json.dumps({"ranks": size, "capacity": capacity, "rows": rows}) + "\n")
    hvd.shutdown()


def timed(run, args):
    """Per-call seconds of each round (slowest rank) and the calls per round."""
    COMM.Barrier()
    started = time.perf_counter()
    for _ in range(50):  # the same count on every rank: the calls are collective
        run()
    per_call = (time.perf_counter() - started) / 50
    calls = COMM.allreduce(max(10, int(args.seconds / per_call)), op=MPI.MIN)
    times = []
    for _ in range(args.rounds):
        COMM.Barrier()
        started = time.perf_counter()
        for _ in range(calls):
            run()
        times.append(COMM.allreduce((time.perf_counter() - started) / calls, op=MPI.MAX))
    return times, calls


if __name__ == "__main__":
    sys.exit(main())
