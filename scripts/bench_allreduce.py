#!/usr/bin/env python
"""Allreduce benchmark in the nccl-tests format: hororing's ring against its peers.

Run under MPI, e.g.  mpiexec -n 2 python scripts/bench_allreduce.py --json results/ar2.json

Algorithms, all on the same buffers in the same run:
  ring    hororing.allreduce_ (the whole library path: negotiation, fusion, the ring)
  outplace hororing.allreduce, out of place: a new output array per call, the input untouched
  adasum  hororing.allreduce_(op=hvd.Adasum): the Adasum tree (its #wrong is checked against
          parallel inputs, whose Adasum is their average)
  native  MPI_Allreduce through mpi4py
  plain   a 20-line Python ring: blocking Sendrecv + np.add, no sub-chunks (the baseline)
  gloo    torch.distributed's gloo all_reduce (when torch is installed)
  flat    hororing's pipelined ring alone, on its own communicator (no negotiation)
  flatout the same ring alone, out of place into a result reused from call to call: what
          outplace costs without the engine (outplace - flatout is the engine's share)
  hier    hororing's hierarchical allreduce alone (reduce in each node, across nodes by
          slices, gather), on its own communicator

--hierarchical times ring (the library's choice under the job's settings), flat, hier and native
from 1 MiB up and reports, for flat and hier,
the bytes one allreduce sends between nodes, per rank (nodes as MPI_COMM_TYPE_SHARED sees
them: run it under MPIR_CVAR_NUM_CLIQUES=2 to split one machine into two).

Columns: size (B), count, dtype, time (us: the algorithms take turns in --rounds rounds, each
round timing a block of calls; the median over rounds of a block's mean per call on the
slowest rank), algbw and busbw
(GB/s; busbw = algbw * 2(n-1)/n), #wrong (elements differing from an exact reference, from a
separate untimed call), and the ring cost model's prediction with measured/predicted.

The model's constants come from this run: alpha is half a 8-byte Sendrecv round trip,
beta is the per-byte time of a 16 MiB Sendrecv exchange, gamma the per-byte time of np.add
on 16 MiB. The memory-bound reference is the single-core copy bandwidth measured with
np.copyto on 64 MiB (one read and one write per byte): on one host every ring step is
memory copies and adds, so busbw is bounded by a small multiple of it.
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
from benchinfo import machine_info, machine_line, setup_torch_distributed
from hororing.algorithms.hierarchical import Hierarchical, node_layout
from hororing.algorithms.ring import Ring
from hororing.config import Config
from hororing.costmodel import Machine, bus_bandwidth, ring_time

COMM = MPI.COMM_WORLD
WARMUP = 6  # MPICH switches MPI_Allreduce to its shared-memory algorithm after the 5th call


def main():
    args = parse_args()
    hvd.init()
    rank, size = COMM.Get_rank(), COMM.Get_size()
    machine, copy_bw = calibrate()
    if args.hierarchical:
        args.algorithms = ["ring", "flat", "hier", "native"]
        if args.min_bytes == 8:  # not given: from 1 MiB
            args.min_bytes = 1024 * 1024
    algorithms = {name: ALGORITHMS[name] for name in args.algorithms}
    if "gloo" in algorithms and not setup_torch_distributed(COMM, "gloo"):
        del algorithms["gloo"]
    if rank == 0:
        print(header(size, copy_bw, machine))
        print(f"{'size(B)':>12} {'count':>10} {'dtype':>7} {'algorithm':>9} {'time(us)':>10} "
              f"{'algbw':>7} {'busbw':>7} {'#wrong':>6} {'model(us)':>10} {'meas/model':>10}")
    rows = []
    for nbytes in sizes(args.min_bytes, args.max_bytes):
        count = nbytes // 4
        wrong = {name: check(run, count) for name, run in algorithms.items()}
        times = timed_rounds(algorithms, count, args)
        crossing = cross_node_bytes(count) if args.hierarchical else {}
        for name in algorithms:
            seconds = float(np.median(times[name]))
            predicted = ring_time(machine, size, count * 4)
            row = {"bytes": count * 4, "count": count, "dtype": "float32", "algorithm": name,
                   "time_us": seconds * 1e6, "round_times_us": [t * 1e6 for t in times[name]],
                   "algbw_GBs": count * 4 / seconds / 1e9,
                   "busbw_GBs": bus_bandwidth(size, count * 4, seconds) / 1e9,
                   "wrong": wrong[name], "model_us": predicted * 1e6,
                   "measured_over_model": seconds / predicted if predicted else None}
            if name in crossing:
                row["cross_node_bytes_per_rank"] = crossing[name]
            rows.append(row)
            if rank == 0:
                print(f"{row['bytes']:>12} {count:>10} {'float32':>7} {name:>9} "
                      f"{row['time_us']:>10.1f} {row['algbw_GBs']:>7.2f} {row['busbw_GBs']:>7.2f} "
                      f"{wrong[name]:>6} {row['model_us']:>10.1f} "
                      f"{(row['measured_over_model'] or 0):>10.2f}", flush=True)
    fusion = fusion_benchmark(args) if args.fusion else None
    if args.hierarchical and rank == 0:
        print(f"\nbytes sent between nodes per rank by one allreduce ({Layout.get().nodes} "
              f"nodes of {Layout.get().node_sizes} ranks):")
        for row in rows:
            if "cross_node_bytes_per_rank" in row:
                print(f"{row['bytes']:>12} {row['algorithm']:>9} "
                      f"{row['cross_node_bytes_per_rank']:>14.0f} "
                      f"({row['cross_node_bytes_per_rank'] / row['bytes']:.3f} x size)")
    if rank == 0:
        if fusion:
            print(f"\nfusion: 64 x 16 KiB allreduces: blocking {fusion['blocking_us']:.0f} us, "
                  f"async + synchronize {fusion['async_us']:.0f} us, "
                  f"speed-up {fusion['speedup']:.2f}x")
        report = {"ranks": size, "host": socket.gethostname(), "machine": machine_info(),
                  "copy_bandwidth_GBs": copy_bw / 1e9, "model": machine.__dict__,
                  "rows": rows, "fusion": fusion}
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=1)
        if args.plot:
            plot(rows, size, copy_bw, args.plot)
    hvd.shutdown()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--min-bytes", type=int, default=8)
    parser.add_argument("--max-bytes", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--algorithms", nargs="+", default=["ring", "native", "plain", "gloo"],
                        choices=sorted(ALGORITHMS))
    parser.add_argument("--seconds", type=float, default=0.3,
                        help="target timed seconds per size and algorithm")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds per size; every algorithm is timed once per round")
    parser.add_argument("--fusion", action="store_true", help="also time 64 x 16 KiB async vs blocking")
    parser.add_argument("--hierarchical", action="store_true",
                        help="flat ring vs hierarchical vs native from 1 MiB, with the bytes "
                             "sent between nodes")
    parser.add_argument("--json", help="write results as JSON (rank 0)")
    parser.add_argument("--plot", help="write a PNG of busbw against size (rank 0)")
    return parser.parse_args()


def sizes(low, high):
    """8 B, x4 up to 512 KiB, then every power of two from 1 MiB."""
    nbytes = max(low, 4)
    while nbytes <= high:
        yield nbytes
        nbytes = nbytes * 4 if nbytes * 4 <= 1024 * 1024 else nbytes * 2


# ---- the algorithms -----------------------------------------------------------------------

class Buffers:
    """One reusable buffer per element count, so every algorithm runs on the same memory."""
    cache = {}

    @classmethod
    def get(cls, count):
        if count not in cls.cache:
            cls.cache.clear()
            cls.cache[count] = np.zeros(count, dtype=np.float32)  # sums stay finite
        return cls.cache[count]


def run_ring(buffer):
    hvd.allreduce_(buffer, op=hvd.Sum, name="bench")


def run_outplace(buffer):
    return hvd.allreduce(buffer, op=hvd.Sum, name="bench.outplace")


def run_adasum(buffer):
    hvd.allreduce_(buffer, op=hvd.Adasum, name="bench.adasum")


def run_native(buffer):
    COMM.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)


def run_plain(buffer):
    """The baseline: a textbook ring with blocking Sendrecv and np.add, no pipelining."""
    size, rank = COMM.Get_size(), COMM.Get_rank()
    bounds = np.linspace(0, buffer.size, size + 1).astype(int)
    chunk = lambda index: buffer[bounds[index % size]:bounds[index % size + 1]]
    right, left = (rank + 1) % size, (rank - 1) % size
    scratch = np.empty(bounds[1] - bounds[0] + 1, dtype=buffer.dtype)
    for step in range(size - 1):
        incoming = chunk(rank - step - 1)
        COMM.Sendrecv(chunk(rank - step), right, recvbuf=scratch[:incoming.size], source=left)
        np.add(incoming, scratch[:incoming.size], out=incoming)
    for step in range(size - 1):
        COMM.Sendrecv(chunk(rank - step + 1), right, recvbuf=chunk(rank - step), source=left)


def run_gloo(buffer):
    import torch
    import torch.distributed as dist
    dist.all_reduce(torch.from_numpy(buffer))


class Layout:
    """The flat ring and the hierarchical allreduce on communicators of their own."""
    made = None

    @classmethod
    def get(cls):
        if cls.made is None:
            cls.made = cls()
        return cls.made

    def __init__(self):
        config = Config.from_environ()
        local, nodes, _ = node_layout(COMM)
        # the sub-chunks the library would take for these rings
        self.flat = Ring(COMM.Dup(), config.subchunk_bytes(across_nodes=nodes > 1),
                         piece_ceiling=config.piece_ceiling(across_nodes=nodes > 1))
        self.hier = Hierarchical(COMM.Dup(), config.subchunk_bytes(across_nodes=False),
                                 cross_subchunk_bytes=config.subchunk_bytes(across_nodes=True),
                                 cross_piece_ceiling=config.piece_ceiling(across_nodes=True))
        self.nodes = self.hier.nodes
        self.results = {}  # flatout's result arrays, by element count
        leader = local.bcast(COMM.Get_rank(), root=0)  # a node's id: its first rank
        self.node_of = COMM.allgather(leader)
        self.node_sizes = sorted((self.node_of.count(node) for node in set(self.node_of)),
                                 reverse=True)
        local.Free()


def run_flat(buffer):
    Layout.get().flat.allreduce(buffer, "sum")


def run_flat_outplace(buffer):
    layout = Layout.get()
    result = layout.results.get(buffer.size)
    if result is None:
        result = layout.results[buffer.size] = np.empty_like(buffer)
    layout.flat.allreduce(result, "sum", source=buffer)
    return result


def run_hier(buffer):
    Layout.get().hier.allreduce(buffer, "sum")


def cross_node_bytes(count):
    """Bytes one call sends between nodes, averaged over the ranks, for flat and hier."""
    layout = Layout.get()
    rank, size = COMM.Get_rank(), COMM.Get_size()
    buffer = np.zeros(count, dtype=np.float32)
    before = layout.flat.bytes_sent
    run_flat(buffer)
    crosses = layout.node_of[(rank + 1) % size] != layout.node_of[rank]  # right neighbour
    flat = (layout.flat.bytes_sent - before) if crosses else 0
    before = layout.hier.cross_bytes_sent()
    run_hier(buffer)
    hier = layout.hier.cross_bytes_sent() - before
    return {"flat": COMM.allreduce(flat) / size, "hier": COMM.allreduce(hier) / size}


ALGORITHMS = {"ring": run_ring, "outplace": run_outplace, "adasum": run_adasum,
              "native": run_native, "plain": run_plain, "gloo": run_gloo,
              "flat": run_flat, "flatout": run_flat_outplace, "hier": run_hier}


# ---- measuring ----------------------------------------------------------------------------

def check(run, count):
    """Count elements that differ from the exact sum (integer-valued floats sum exactly); an
    out-of-place algorithm that changed its input counts every element wrong."""
    rank, size = COMM.Get_rank(), COMM.Get_size()
    values = (np.arange(count) % 7 + rank).astype(np.float32)
    expected = (np.arange(count) % 7 * size + size * (size - 1) // 2).astype(np.float32)
    if run is run_adasum:  # parallel vectors: Adasum averages them
        values = (np.arange(count) % 7 + 1).astype(np.float32) * (rank + 1)
        expected = (np.arange(count) % 7 + 1).astype(np.float32) * (size + 1) / 2
        run(values)
        wrong = int(np.count_nonzero(~np.isclose(values, expected, rtol=1e-5)))
        return COMM.allreduce(wrong, op=MPI.SUM)
    original = values.copy()
    result = run(values)
    if result is None:  # in place
        result = values
    elif not np.array_equal(values, original):  # out of place leaves its input alone
        result = np.full_like(values, np.nan)
    wrong = int(np.count_nonzero(result != expected))
    return COMM.allreduce(wrong, op=MPI.SUM)


def timed_rounds(algorithms, count, args):
    """Time every algorithm in ``args.rounds`` rounds, the order rotating from round to round.

    Each round gives every algorithm one block of about ``seconds / rounds`` (mean per call,
    slowest rank), so a transient slowdown of the shared machine lands on all of them
    instead of on whichever was being timed; the table reports the median over rounds.
    """
    buffer = Buffers.get(count)
    names = list(algorithms)
    iterations = {}
    for name in names:
        run = algorithms[name]
        for _ in range(WARMUP):
            run(buffer)
        COMM.Barrier()
        started = time.perf_counter()
        run(buffer)
        once = COMM.allreduce(time.perf_counter() - started, op=MPI.MAX)
        block_seconds = args.seconds / args.rounds
        iterations[name] = int(min(max(block_seconds / max(once, 1e-7), 3), 20000))
    times = {name: [] for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            run = algorithms[name]
            COMM.Barrier()
            started = time.perf_counter()
            for _ in range(iterations[name]):
                run(buffer)
            elapsed = time.perf_counter() - started
            times[name].append(COMM.allreduce(elapsed, op=MPI.MAX) / iterations[name])
    return times


def calibrate():
    """Measure alpha, beta, gamma and the single-core copy bandwidth on this machine."""
    rank, size = COMM.Get_rank(), COMM.Get_size()
    peer = rank ^ 1 if (rank ^ 1) < size else rank
    small, small_in = np.zeros(2, np.float32), np.zeros(2, np.float32)
    big, big_in = np.ones(4 << 20, np.float32), np.empty(4 << 20, np.float32)
    alpha = _per_call(lambda: COMM.Sendrecv(small, peer, recvbuf=small_in, source=peer), 2000) / 2
    exchange = _per_call(lambda: COMM.Sendrecv(big, peer, recvbuf=big_in, source=peer), 20)
    beta = max(exchange - alpha, 0) / big.nbytes
    gamma = _per_call(lambda: np.add(big, big_in, out=big_in), 20) / big.nbytes
    src, dst = np.ones(16 << 20, np.float32), np.empty(16 << 20, np.float32)
    copy = _per_call(lambda: np.copyto(dst, src), 20)
    values = COMM.allreduce(np.array([alpha, beta, gamma, copy]), op=MPI.SUM) / size
    return Machine(*values[:3].tolist()), src.nbytes / values[3]


def _per_call(function, iterations):
    for _ in range(3):
        function()
    COMM.Barrier()
    started = time.perf_counter()
    for _ in range(iterations):
        function()
    return (time.perf_counter() - started) / iterations


def fusion_benchmark(args):
    """64 async allreduces of 16 KiB then synchronize, against 64 blocking calls."""
    tensors = [np.ones(4096, np.float32) for _ in range(64)]

    def blocking():
        for index, tensor in enumerate(tensors):
            hvd.allreduce_(tensor, name=f"fusion.{index}")

    def asynchronous():
        handles = [hvd.allreduce_async_(tensor, name=f"fusion.{index}")
                   for index, tensor in enumerate(tensors)]
        for handle in handles:
            hvd.synchronize(handle)

    # the two take turns in rounds (as in the size sweep); the median round counts
    rounds = {"blocking_us": [], "async_us": []}
    for _ in range(args.rounds):
        for label, function in (("blocking_us", blocking), ("async_us", asynchronous)):
            seconds = _per_call(function, 10)
            rounds[label].append(COMM.allreduce(seconds, op=MPI.MAX) * 1e6)
    result = {label: float(np.median(times)) for label, times in rounds.items()}
    result["speedup"] = result["blocking_us"] / result["async_us"]
    result["rounds"] = rounds
    return result


# ---- reporting ----------------------------------------------------------------------------

def header(size, copy_bw, machine):
    return (f"# hororing allreduce benchmark: {size} ranks on {socket.gethostname()}\n"
            f"{machine_line(machine_info())}\n"
            f"# single-core copy bandwidth (np.copyto, 64 MiB): {copy_bw / 1e9:.2f} GB/s\n"
            f"# ring model: alpha {machine.alpha * 1e6:.2f} us, beta {1 / machine.beta / 1e9:.2f} GB/s, "
            f"gamma {1 / machine.gamma / 1e9:.2f} GB/s (np.add)")


def plot(rows, size, copy_bw, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(row["algorithm"] for row in rows):
        mine = [row for row in rows if row["algorithm"] == name]
        axes.plot([row["bytes"] for row in mine], [row["busbw_GBs"] for row in mine], marker="o",
                  label=name)
    axes.axhline(copy_bw / 1e9, linestyle="--", color="gray", label="single-core copy bandwidth")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("bytes per rank")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(f"allreduce busbw, {size} ranks")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
