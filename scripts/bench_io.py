#!/usr/bin/env python
"""Input benchmark: records per second per rank through its channel vs reading its files.

Run under MPI at each size, e.g.  mpiexec -n 4 python scripts/bench_io.py --json io4.json

Rank 0 writes ``--files`` record files (``--records`` records of ``--record-bytes`` each, in
total) into a temporary directory; every rank takes its files with shard_files and then, in
alternating order, reads them directly in the rank (read_shard) and through its own channel
(open_channel: a FIFO fed by a producer process). Each read consumes every record (a length
sum, checked against the expected total so that neither path can skip work). A rep's rate is
records / the slowest rank's time; the table shows the best of ``--reps`` reps per path and
channel/direct. The files sit in the page cache for both paths, so this measures the cost of
the channel itself, not the disk.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

import hororing as hvd
from benchinfo import machine_info, machine_line

COMM = MPI.COMM_WORLD


def main():
    args = parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    directory = write_files(args) if rank == 0 else None
    directory = COMM.bcast(directory, root=0)
    try:
        mine = hvd.data.shard_files(os.path.join(directory, "*.rec"))
        expected = hvd.data.count_samples(mine)
        results = {"direct": [], "channel": []}
        for rep in range(args.reps):
            order = ["direct", "channel"] if rep % 2 == 0 else ["channel", "direct"]
            for path in order:
                rate = timed(path, mine, expected, args.record_bytes)
                results[path].append(COMM.allreduce(rate, op=MPI.MIN))  # the slowest rank
        if rank == 0:
            report(args, size, {path: max(rates) for path, rates in results.items()})
    finally:
        COMM.barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)


def timed(path, files, expected, record_bytes):
    """Return this rank's records per second for one full read of its files."""
    COMM.barrier()
    start = time.perf_counter()
    if path == "direct":
        count, total = consume(hvd.data.read_shard(files))
    else:
        with hvd.data.open_channel(files) as channel:
            count, total = consume(channel)
    seconds = time.perf_counter() - start
    if count != expected or total != expected * record_bytes:
        raise RuntimeError(f"{path} read {count} records ({total} bytes), expected {expected}")
    return count / seconds


def consume(samples):
    count = 0
    total = 0
    for payload in samples:
        count += 1
        total += len(payload)
    return count, total


def write_files(args):
    directory = tempfile.mkdtemp(prefix="hororing-bench-io-")
    rng = np.random.default_rng(0)
    per_file = args.records // args.files
    payload = rng.integers(0, 256, size=args.record_bytes, dtype=np.uint8).tobytes()
    for index in range(args.files):
        with hvd.data.RecordWriter(os.path.join(directory, f"part-{index:03d}.rec")) as out:
            for _ in range(per_file):
                out.write(payload)
    return directory


def report(args, size, rates):
    info = machine_info()
    direct, channel = rates["direct"], rates["channel"]
    print(f"# hororing input benchmark: {size} ranks, {args.files} files, "
          f"{args.records // args.files * args.files} records of {args.record_bytes} B")
    print(machine_line(info))
    print(f"{'ranks':>5} {'record(B)':>9} {'direct rec/s/rank':>18} {'channel rec/s/rank':>19} "
          f"{'channel/direct':>14}")
    print(f"{size:>5} {args.record_bytes:>9} {direct:>18,.0f} {channel:>19,.0f} "
          f"{channel / direct:>14.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"ranks": size, "files": args.files, "records": args.records,
                       "record_bytes": args.record_bytes, "machine": info,
                       "direct_records_per_s": direct, "channel_records_per_s": channel,
                       "channel_over_direct": channel / direct}, out, indent=1)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--records", type=int, default=2_000_000, help="in all, over all files")
    parser.add_argument("--record-bytes", type=int, default=264,
                        help="default: one digits sample, 64 float32 pixels and an int64 label")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if args.files < 1 or args.records < args.files:
        sys.exit("need --files >= 1 and --records >= --files")
    return args


if __name__ == "__main__":
    main()
