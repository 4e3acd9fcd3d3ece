#!/usr/bin/env python
"""The measurement behind each tuning default in hororing/config.py, one --setting each.

Run under MPI, e.g.  mpiexec -n 2 python scripts/bench_tuning.py --setting all --json t.json
(and with more ranks than cores for the waits and poll settings, which exist for that case).

  subchunk  ring_subchunk_bytes: the ring alone (no engine) with 256 KiB, 1, 2 and 4 MiB
            sub-chunks, beside the plain 20-line ring, 128 KiB to 32 MiB.
  small     small_allreduce_bytes (automatic: small_allreduce_total_bytes / ranks): the whole
            library path with every size on the latency path (one MPI_Allgather, then the
            reduction; a repeated call folds into negotiation) against every size on the
            ring, 8 KiB to 1 MiB: the automatic threshold should stay below the crossover.
  waits     wait_spin_tests, wait_yield_tests, wait_max_sleep_us: blocking allreduces of 4 KiB
            and 1 MiB under each candidate back-off, with the CPU time each call costs (what a
            data loader on the same cores does not get).
  poll      poll_active_us, poll_idle_us: a loop of blocking 4 KiB allreduces in which the odd
            ranks arrive late by a skew (sleeping, as a rank waiting on I/O or its GPU does),
            against MPI_Allreduce in the same loop, and the CPU an idle job burns.

Every table is in microseconds: candidates take turns in --rounds rounds, each round timing a
block of calls on every rank and keeping the slowest rank's mean per call; the median round
is reported (the timing of scripts/bench_allreduce.py). The default is marked with '*'.
"""

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import hororing as hvd
from bench_allreduce import COMM, check, run_plain, timed_rounds
from benchinfo import machine_info, machine_line
from hororing import transport
from hororing.algorithms.ring import Ring
from hororing.config import Config
from hororing.context import current

KiB, MiB = 1024, 1024 * 1024
DEFAULTS = Config()


def sweep_subchunk(args):
    comm = COMM.Dup()
    candidates = {"256K": 256 * KiB, "1M": MiB, "2M": 2 * MiB, "4M": 4 * MiB}
    rings = {label + ("*" if nbytes == DEFAULTS.subchunk_bytes(across_nodes=False) else ""): Ring(comm, nbytes)
             for label, nbytes in candidates.items()}
    algorithms = {label: (lambda buffer, ring=ring: ring.allreduce(buffer, "sum"))
                  for label, ring in rings.items()}
    algorithms["plain"] = run_plain
    rows = []
    for nbytes in (128 * KiB, 2 * MiB, 8 * MiB, 32 * MiB):
        times = timed_rounds(algorithms, nbytes // 4, args)
        rows.append({"bytes": nbytes, **{label: median_us(t) for label, t in times.items()},
                     "wrong": wrong(algorithms, nbytes // 4)})
    comm.Free()
    table("ring_subchunk_bytes: Ring.allreduce alone, float32", rows, list(algorithms))
    return rows


def sweep_small(args):
    hvd.init(small_allreduce_bytes=1 << 40)  # every size may take the latency path
    pipeline = current().engine.allreduce

    def on(kind):
        def run(buffer):
            pipeline.force(kind)
            hvd.allreduce_(buffer, op=hvd.Sum, name="tuning.small")
        return run
    algorithms = {"latency": on(None), "ring": on("ring")}
    rows = []
    for nbytes in (8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, MiB):
        times = timed_rounds(algorithms, nbytes // 4, args)
        rows.append({"bytes": nbytes, **{label: median_us(t) for label, t in times.items()},
                     "wrong": wrong(algorithms, nbytes // 4)})
    pipeline.force(None)
    hvd.shutdown()
    table("small_allreduce_bytes: the library path, blocking, float32", rows, list(algorithms))
    crossover = next((row["bytes"] for row in rows if row["ring"] <= row["latency"]), None)
    size = COMM.Get_size()
    _say(f"the ring is as fast as the latency path from {crossover} B (ranks x bytes = "
         f"{None if crossover is None else crossover * size} B); the automatic threshold at "
         f"{size} ranks: {DEFAULTS.small_threshold(size)} B")
    return rows


WAIT_CANDIDATES = {  # label: (spin tests, yield tests, max sleep us)
    "sleep-at-once": (0, 0, 1000),
    "default*": (DEFAULTS.wait_spin_tests, DEFAULTS.wait_yield_tests, DEFAULTS.wait_max_sleep_us),
    "long-spin": (2000, 20000, 1000),
    "sleep<=100us": (DEFAULTS.wait_spin_tests, DEFAULTS.wait_yield_tests, 100),
    "sleep<=10ms": (DEFAULTS.wait_spin_tests, DEFAULTS.wait_yield_tests, 10000),
    "yield<=20000": (DEFAULTS.wait_spin_tests, 20000, DEFAULTS.wait_max_sleep_us),
    "spin-then-yield": (DEFAULTS.wait_spin_tests, 1 << 62, DEFAULTS.wait_max_sleep_us),
    "yield-only": (0, 1 << 62, 1000),
}
STRAGGLER_S = 0.05


def sweep_waits(args):
    hvd.init()
    rows = []
    cpu = {}  # label -> [CPU seconds, calls]

    def under(label):
        spin, yields, sleep_us = WAIT_CANDIDATES[label]

        def run(buffer):
            transport.set_backoff(spin, yields, sleep_us / 1e6)
            started = time.process_time()
            hvd.allreduce_(buffer, op=hvd.Sum, name="tuning.waits")
            spent = cpu.setdefault(label, [0.0, 0])
            spent[0] += time.process_time() - started
            spent[1] += 1
        return run
    algorithms = {label: under(label) for label in WAIT_CANDIDATES}
    for nbytes in (4 * KiB, MiB):
        cpu.clear()
        times = timed_rounds(algorithms, nbytes // 4, args)
        row = {"bytes": nbytes}
        for label in algorithms:
            row[label] = median_us(times[label])
            seconds, calls = cpu[label]
            row[label + " cpu"] = COMM.allreduce(seconds / calls) / COMM.Get_size() * 1e6
        row["wrong"] = wrong(algorithms, nbytes // 4)
        rows.append(row)
    rows.append(straggler_cpu(algorithms))
    hvd.shutdown()
    transport.set_backoff(DEFAULTS.wait_spin_tests, DEFAULTS.wait_yield_tests,
                          DEFAULTS.wait_max_sleep_us / 1e6)
    labels = list(algorithms)
    table("wait back-off: blocking allreduce, time per call", rows[:-1], labels)
    table("wait back-off: process CPU time per call (mean over ranks; all threads); last row: "
          f"CPU of the even ranks in a call the odd ranks reach {STRAGGLER_S * 1e3:.0f} ms late",
          rows, [label + " cpu" for label in labels])
    return rows


def straggler_cpu(algorithms):
    """CPU time (us) an even rank spends in a 4 KiB allreduce that the odd ranks reach
    STRAGGLER_S late: what waiting for a straggler takes from other work on the cores."""
    buffer = np.zeros(1024, dtype=np.float32)
    rank = COMM.Get_rank()
    row = {"bytes": f"late {STRAGGLER_S * 1e3:.0f} ms"}
    for label, run in algorithms.items():
        spent = []
        for _ in range(3):
            COMM.Barrier()
            if rank % 2:
                time.sleep(STRAGGLER_S)
            started = time.process_time()
            run(buffer)
            spent.append(time.process_time() - started)
        mine = float(np.median(spent)) * 1e6 if rank % 2 == 0 else 0.0
        row[label + " cpu"] = COMM.allreduce(mine) / ((COMM.Get_size() + 1) // 2)
    return row


POLL_CANDIDATES = {"100/1000": (100, 1000), "500/5000*": (500, 5000),
                   "2000/20000": (2000, 20000), "10000/10000": (10000, 10000)}


def sweep_poll(args):
    """Late arrivals: the odd ranks sleep ``skew`` before each call, the even ranks do not."""
    rank = COMM.Get_rank()
    buffer = np.zeros(1024, dtype=np.float32)
    rows = []
    for skew_us in (0, 100, 1000, 3000, 10000):
        delay = skew_us / 1e6 if rank % 2 else 0.0

        def step(reduce):
            if delay:
                time.sleep(delay)
            reduce()
        results = {label: [] for label in ["native", *POLL_CANDIDATES]}
        iterations = max(5, min(2000, int(args.seconds / args.rounds / (skew_us / 1e6 + 5e-5))))
        for round_index in range(args.rounds):
            labels = list(results)
            shift = round_index % len(labels)
            for label in labels[shift:] + labels[:shift]:
                if label == "native":
                    reduce = lambda: COMM.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
                else:
                    active, idle = POLL_CANDIDATES[label]
                    hvd.init(poll_active_us=active, poll_idle_us=idle)
                    reduce = lambda: hvd.allreduce_(buffer, op=hvd.Sum, name="tuning.poll")
                for _ in range(5):
                    step(reduce)
                COMM.Barrier()
                started = time.perf_counter()
                for _ in range(iterations):
                    step(reduce)
                elapsed = time.perf_counter() - started
                results[label].append(COMM.allreduce(elapsed, op=MPI.MAX) / iterations)
                hvd.shutdown()
        rows.append({"skew_us": skew_us, **{label: median_us(t) for label, t in results.items()}})
    labels = ["native", *POLL_CANDIDATES]
    table("engine poll (active/idle us): a step = odd ranks sleep skew, then a 4 KiB allreduce",
          rows, labels, key="skew_us")
    rows.append(idle_cpu())
    return rows


def idle_cpu():
    """CPU ms per second an idle job burns, under each candidate: a second just after a
    collective (the active rate), then a second later (the idle rate)."""
    row = {"skew_us": "idle CPU ms/s, 1st s / 2nd s"}
    buffer = np.zeros(1024, dtype=np.float32)
    for label, (active, idle) in POLL_CANDIDATES.items():
        hvd.init(poll_active_us=active, poll_idle_us=idle)
        hvd.allreduce_(buffer, name="tuning.idle")
        spent = []
        for _ in range(2):
            started = time.process_time()
            time.sleep(1.0)
            spent.append((time.process_time() - started) * 1e3)
        hvd.shutdown()
        mean = COMM.allreduce(np.array(spent), op=MPI.SUM) / COMM.Get_size()
        row[label] = f"{mean[0]:.1f} / {mean[1]:.1f}"
    _say(f"{row['skew_us']}: " + ", ".join(f"{label} {row[label]}" for label in POLL_CANDIDATES))
    return row


SETTINGS = {"subchunk": sweep_subchunk, "small": sweep_small, "waits": sweep_waits,
            "poll": sweep_poll}


def wrong(algorithms, count):
    """Elements that differ from the exact sum, over every candidate (bench_allreduce.check)."""
    return sum(check(run, count) for run in algorithms.values())


def median_us(seconds):
    return float(np.median(seconds)) * 1e6


def _say(text):
    if COMM.Get_rank() == 0:
        print(text, flush=True)


def table(title, rows, labels, key="bytes"):
    _say(f"\n## {title}")
    _say(f"{key:>12} " + " ".join(f"{label:>18}" for label in labels) + "  #wrong")
    for row in rows:
        _say(f"{row[key]:>12} " + " ".join(f"{row[label]:>18.1f}" for label in labels)
             + f"  {row.get('wrong', '-')}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--setting", choices=[*SETTINGS, "all"], default="all")
    parser.add_argument("--seconds", type=float, default=0.6,
                        help="time per size and candidate, spread over the rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the rows as JSON (rank 0)")
    args = parser.parse_args()
    _say(f"# hororing tuning benchmark: {COMM.Get_size()} ranks\n{machine_line(machine_info())}")
    chosen = list(SETTINGS) if args.setting == "all" else [args.setting]
    results = {name: SETTINGS[name](args) for name in chosen}
    if args.json and COMM.Get_rank() == 0:
        with open(args.json, "w") as handle:
            json.dump({"ranks": COMM.Get_size(), "machine": machine_info(), **results}, handle,
                      indent=1)


if __name__ == "__main__":
    main()
