#!/usr/bin/env python
"""Where the time of one blocking allreduce goes, phase by phase, against its floor.

Run under MPI, e.g.  mpiexec -n 2 python scripts/bench_call_phases.py --sizes 4KiB,1MiB

Each iteration is a Barrier, then one timed blocking ``hvd.allreduce_`` (Sum, float32) on a
numpy array; the engine's entry points are wrapped so that each rank records when the call
reaches them (the wrappers cost well under a microsecond each), and the table gives the
median time between consecutive marks on rank 0:

  front      from the call to the engine's submit_blocking (validation, the request)
  drive      from there to the negotiation cycle (the drive lock, the queue's checks, the
             wake-up check; the cycle runs within the call where nothing else is queued)
  vote       the cycle up to the executor (the vote's exchange, including the wait for the
             last rank to arrive)
  pipeline   the executor and the allreduce pipeline up to the algorithm, and back
  algorithm  the reduction itself (the ring, or on one node the shared-memory allreduce;
             the latency path for small sizes)
  return     from the cycle's end back to the caller

Beside it, in the same loop, taking turns: ``ring``, the library's ring algorithm called
directly on the buffer (no negotiation, no engine), ``floor``, the least a negotiated call
can cost in this design (the vote's persistent exchange, then the ring algorithm), the plain
Python ring of ``bench_skewed_arrival.py``, and MPI_Allreduce. Sizes that repeat on the latency path
(below the small-message threshold) are folded into the cycle's first exchange: there
``vote`` holds the whole exchange and the reduction, and ``pipeline`` and ``algorithm`` are
empty. Once folded, such a call runs its lane (``engine/lane.py``): ``front`` then ends where
the door hands it to ``Engine.run_lane``, and ``drive`` is the lane's checks.
"""

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import hororing as hvd
from bench_skewed_arrival import human, parse_size, plain_ring
from benchinfo import machine_info, machine_line
from hororing import transport
from hororing.context import current

COMM = MPI.COMM_WORLD
PHASES = [("front", "start", "submit>"), ("drive", "submit>", "cycle>"),
          ("vote", "cycle>", "execute>"), ("pipeline", "execute>", "algorithm>"),
          ("algorithm", "algorithm>", "algorithm<"), ("pipeline back", "algorithm<", "cycle<"),
          ("return", "cycle<", "end")]


def main():
    args = parse_args()
    hvd.init()
    engine = current().engine
    marks = {}
    wrap(engine, "submit_blocking", "submit", marks)
    wrap(engine, "_run_cycle", "cycle", marks)  # the cycle, then what it decided
    # a repeated call's lane (engine/lane.py): its one cycle, written out, and its result
    wrap(engine, "run_lane", "submit", marks)
    wrap(engine.cycle, "run_lane", "cycle", marks)
    wrap(engine._folding, "finish", "cycle", marks)
    wrap(engine.executor, "execute", "execute", marks)
    algorithms = engine.executor.allreduce.host.algorithms
    for kind in ("ring", "small", "shared"):
        if kind in algorithms:  # shared: where the ranks share a node
            wrap(algorithms[kind], "allreduce", "algorithm", marks)
    ring = algorithms["ring"]
    # the floor's vote: a persistent bitwise AND of the vote's size, on a communicator of its own
    words = np.zeros(engine.cycle._vote.size, dtype=np.int64)
    vote_comm = COMM.Dup()
    vote = transport.Exchange(vote_comm, "allreduce", words, np.zeros_like(words), op=MPI.BAND)
    if COMM.rank == 0:
        print(machine_line(machine_info()))
        print(f"# one blocking allreduce after a Barrier, {COMM.size} ranks; medians in us")
        print(f"{'size':>8} " + " ".join(f"{name:>13}" for name, _, _ in PHASES) +
              f" {'total':>8} {'ring':>8} {'floor':>8} {'plain':>8} {'MPI':>8}")
    for nbytes in args.sizes:
        count = nbytes // 4
        buffer = np.zeros(count, dtype=np.float32)
        scratch = np.empty(-(-count // COMM.size) + 1, dtype=np.float32)

        def floor():
            transport.wait(vote.start())
            ring.allreduce(buffer, "sum")
        others = {"ring": lambda: ring.allreduce(buffer, "sum"), "floor": floor,
                  "plain": lambda: plain_ring(buffer, scratch),
                  "MPI": lambda: COMM.Allreduce(MPI.IN_PLACE, buffer)}
        spans = {name: [] for name, _, _ in PHASES}
        spans.update({"total": []}, **{name: [] for name in others})
        for index in range(args.calls + 10):
            COMM.Barrier()
            marks.clear()
            marks["start"] = time.perf_counter()
            hvd.allreduce_(buffer, op=hvd.Sum, name="phases")
            marks["end"] = time.perf_counter()
            if index >= 10:
                marks.setdefault("execute>", marks["cycle<"])  # folded: no executor pass
                marks.setdefault("algorithm>", marks["execute>"])
                marks.setdefault("algorithm<", marks["algorithm>"])
                for name, start, stop in PHASES:
                    spans[name].append(marks[stop] - marks[start])
                spans["total"].append(marks["end"] - marks["start"])
            for name, call in others.items():
                COMM.Barrier()
                started = time.perf_counter()
                call()
                if index >= 10:
                    spans[name].append(time.perf_counter() - started)
        if COMM.rank == 0:
            cells = [np.median(spans[name]) * 1e6 for name, _, _ in PHASES]
            tail = [np.median(spans[name]) * 1e6 for name in ("total", *others)]
            print(f"{human(nbytes):>8} " + " ".join(f"{cell:13.1f}" for cell in cells) +
                  " " + " ".join(f"{cell:8.1f}" for cell in tail), flush=True)
    vote_comm.Free()
    hvd.shutdown()


def wrap(owner, attribute, label, marks):
    """Record ``label>`` when ``owner.attribute`` is entered and ``label<`` when it returns
    (the first entry and the last return of one call)."""
    inner = getattr(owner, attribute)

    def marked(*args, **kwargs):
        marks.setdefault(label + ">", time.perf_counter())
        try:
            return inner(*args, **kwargs)
        finally:
            marks[label + "<"] = time.perf_counter()
    setattr(owner, attribute, marked)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--sizes", default="4KiB,64KiB,1MiB,16MiB",
                        type=lambda text: [parse_size(part) for part in text.split(",")])
    parser.add_argument("--calls", type=int, default=300)
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
