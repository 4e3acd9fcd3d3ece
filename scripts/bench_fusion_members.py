#!/usr/bin/env python
"""Fused buckets with large members: packed into the fusion buffer, reduced where they lie,
or not fused at all, taking turns in one job.

Run under MPI, e.g.  mpiexec -n 2 python scripts/bench_fusion_members.py --json out.json

Each call is one ``hvd.grouped_allreduce_`` (Sum, float32, in place) of a bucket of numpy
arrays, as a framework hands over a gradient list. Buckets (--buckets):

  large8    eight 4 MiB arrays
  mixed     a model's gradient list: per layer a weight of 0.25-4 MiB and a 4 KiB bias
  small64   64 arrays of 16 KiB (no member is large: every way is the same packing)

Ways, alternating call by call (the route changed on every rank between calls):

  packed    every member copied into the fusion buffer and back (HORORING_IN_PLACE_MEMBER_
            BYTES=0)
  segments  members from the cost model's size up reduced where they lie, the ring cutting its
            pieces at their ends, the small ones packed (the default)
  unfused   one ring per member (a fusion threshold of one byte)

Calls are spaced as in training: before each, every rank touches 16 MiB of other memory
(the step's other work, which leaves the caches cold) and waits a random 0-1 ms (ranks
arrive at different times). The time is the slowest rank's, from a Barrier before the wait
to the call's return, less the wait; the median over --calls per way.
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchinfo import machine_info, machine_line  # noqa: E402

import hororing as hvd  # noqa: E402
from hororing._mpi import MPI  # noqa: E402
from hororing.context import current  # noqa: E402

MiB = 1 << 20


def buckets():
    layers = [(1024, 1024), (512, 1024), (256, 1024), (1024, 256), (64, 1024), (1024, 64)]
    return {
        "large8": [4 * MiB // 4] * 8,
        "mixed": [count for rows, cols in layers for count in (rows * cols, 1024)],
        "small64": [16 * 1024 // 4] * 64,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--buckets", nargs="+", default=list(buckets()),
                        choices=list(buckets()))
    parser.add_argument("--calls", type=int, default=30, help="timed calls per way and bucket")
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()
    hvd.init()
    comm = MPI.COMM_WORLD
    pipeline = current().engine.allreduce
    route = pipeline.route
    ways = {"packed": dict(member_bytes=0),
            "segments": dict(member_bytes=route.member_bytes),
            "unfused": dict(member_bytes=0, fusion_threshold=1)}
    rng = np.random.default_rng(comm.rank)
    other_work = np.zeros(16 * MiB // 8)
    rows = []
    for bucket in args.buckets:
        sizes = buckets()[bucket]
        arrays = [np.ones(count, np.float32) for count in sizes]
        times = {way: [] for way in ways}
        for call in range(args.calls + 2):  # the first two warm up
            for way, changes in ways.items():
                pipeline.reroute(member_bytes=changes["member_bytes"],
                                 fusion_threshold=changes.get("fusion_threshold",
                                                              route.fusion_threshold))
                for array in arrays:
                    array.fill(1.0)
                other_work += 1.0
                pause = rng.uniform(0, 1e-3)
                comm.Barrier()
                started = time.perf_counter()
                time.sleep(pause)
                hvd.grouped_allreduce_(arrays, op=hvd.Sum, name=f"members.{bucket}")
                elapsed = time.perf_counter() - started - pause
                if not all(float(array[0]) == comm.size and float(array[-1]) == comm.size
                           for array in arrays):
                    raise SystemExit(f"{bucket}/{way}: wrong result on rank {comm.rank}")
                if call >= 2:
                    times[way].append(comm.allreduce(elapsed, op=MPI.MAX))
        row = {"bucket": bucket, "members": len(sizes), "mib": sum(sizes) * 4 / MiB,
               "member_bytes": route.member_bytes,
               "large": sum(1 for count in sizes if 4 * count >= route.member_bytes)}
        row.update({f"{way}_ms": 1e3 * statistics.median(values) for way, values in times.items()})
        rows.append(row)
    if comm.rank == 0:
        print(machine_line(machine_info()), f"{comm.size} ranks")
        print(f"{'bucket':>8} {'members':>7} {'MiB':>6} {'large':>5} {'packed ms':>10} "
              f"{'segments ms':>12} {'unfused ms':>11} {'seg/packed':>10}")
        for row in rows:
            print(f"{row['bucket']:>8} {row['members']:>7} {row['mib']:>6.2f} {row['large']:>5} "
                  f"{row['packed_ms']:>10.2f} {row['segments_ms']:>12.2f} "
                  f"{row['unfused_ms']:>11.2f} {row['segments_ms'] / row['packed_ms']:>10.2f}")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"ranks": comm.size, "machine": machine_info(), "rows": rows},
                          handle, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
