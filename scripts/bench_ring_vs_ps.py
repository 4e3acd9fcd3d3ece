#!/usr/bin/env python
"""Ring against parameter servers: measured times beside the calibrated cost model.

    python scripts/bench_ring_vs_ps.py --ns 2,3,4 --json results/ps.json --plot results/ps

The driver (run without mpiexec) starts one MPI job per worker count n with n + k ranks
(``mpiexec -n n+k python bench_ring_vs_ps.py --child ...``). In each job the first n ranks
are workers and the last k are servers, and on the same buffers it times:

  ring        hororing's pipelined ring over the n workers
  ps1         PS with one dedicated server (round_robin: the buffer is one tensor)
  psK         PS partitioned over K dedicated servers (the buffer split evenly)
  colocated   PS with every worker holding one shard (partitioned)
  native      MPI_Allreduce over the n workers

at the algorithm level (no negotiation), each on float32 buffers. Each point is timed in
--blocks blocks; a block's time is the mean per call on the slowest worker, and the point's
time is the fastest block (other processes on a shared host only ever add time). busbw = bytes/time · 2(n-1)/n for all of them. The driver then
fits alpha, beta, gamma by least squares to the ring and ps1 times of sizes >= --fit-from
(all n), and prints (a) a size sweep at --size-n, (b) an n sweep at 4 MiB and 64 MiB, (c)
the fit, its residuals and the predicted crossovers.
"""

import argparse
import json
import os
import shlex
import sys
import time

import numpy as np

MiB = 1 << 20
ALGORITHM_MODEL = {"ring": ("ring", 1), "ps1": ("ps", 1), "colocated": ("ps_colocated", 0)}


def main():
    args = parse_args()
    if args.child:
        child(args)
    else:
        driver(args)


# ---- driver ------------------------------------------------------------------------------

def driver(args):
    from benchinfo import machine_info, machine_line
    from hororing.costmodel import calibrate, crossover_bytes, predict
    ns = [int(n) for n in args.ns.split(",")]
    rows = []
    if args.rows_from:  # the measurements of an earlier run, analysed (and plotted) again
        with open(args.rows_from) as saved:
            rows = [{key: value for key, value in row.items() if key != "model_s"}
                    for row in json.load(saved)["rows"] if row["n"] in ns]
    else:
        for n in ns:
            rows += run_child(args, n)
    cores = os.cpu_count()
    info = machine_info()
    samples = [(ALGORITHM_MODEL[row["algorithm"]][0], row["n"], row["bytes"],
                ALGORITHM_MODEL[row["algorithm"]][1], row["time_s"])
               for row in rows if row["algorithm"] in ("ring", "ps1")
               and row["bytes"] >= args.fit_from]
    fit = calibrate(samples)
    machine = fit.machine
    for row in rows:
        model = model_of(row, args.servers)
        row["model_s"] = predict(machine, model[0], row["n"], row["bytes"], model[1]) \
            if model else None
    print(f"# hororing ring vs parameter-server benchmark on {info['host']}")
    print(machine_line(info))
    print(f"# On one host every 'link' is the same memory system and the same {cores} cores: the "
          f"measured PS/ring ratio is bounded by the number of cores, and a job with more "
          f"busy ranks than cores is marked oversubscribed.")
    print(f"# fit (least squares on ring and ps1, sizes >= {args.fit_from} B, n in {ns}): "
          f"alpha {machine.alpha * 1e6:.2f} us, beta {fmt_rate(machine.beta)}, "
          f"gamma {fmt_rate(machine.gamma)}; worst measured/predicted in the fit "
          f"{fit.worst:.2f}")
    size_sweep(rows, args.size_n, args.servers)
    n_sweep(rows, ns, machine, args.servers, cores)
    print("\n(c) fitted constants and predicted crossovers")
    print(f"  alpha {machine.alpha:.3e} s/message, beta {machine.beta:.3e} s/B, "
          f"gamma {machine.gamma:.3e} s/B")
    print(f"  fit residuals (measured/predicted): min {min(fit.ratios):.2f}, "
          f"max {max(fit.ratios):.2f} over {len(fit.ratios)} samples")
    for n in ns:
        for first, second in (("ring", "recursive_doubling"), ("rabenseifner", "recursive_doubling")):
            crossing = crossover_bytes(machine, first, second, n)
            where = f"{crossing} B" if crossing else "none in 1 B..16 GiB"
            print(f"  n={n}: {first} faster than {second} from {where}")
        print(f"  n={n}: model PS(k=1)/ring at 64 MiB = "
              f"{predict(machine, 'ps', n, 64 * MiB, 1) / predict(machine, 'ring', n, 64 * MiB):.2f}"
              f"; PS(k=1) is never faster than the ring in this model (2n·alpha > 2(n-1)·alpha, "
              f"2n·S·beta > 2(n-1)/n·S·beta)")
    report = {"machine": info, "fit": {"alpha": machine.alpha, "beta": machine.beta,
                                       "gamma": machine.gamma, "ratios": list(fit.ratios)},
              "fit_from_bytes": args.fit_from, "rows": rows}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    if args.plot:
        plot(rows, ns, args, machine)


def run_child(args, n):
    from benchinfo import json_rows_of
    command = shlex.split(args.mpiexec) + [
        "-n", str(n + args.servers), sys.executable, "-m", "mpi4py", __file__, "--child",
        "--workers", str(n), "--servers", str(args.servers), "--sizes", args.sizes,
        "--seconds", str(args.seconds), "--blocks", str(args.blocks)]
    return json_rows_of(command, args.timeout, f"benchmark job with n={n}")


def model_of(row, servers):
    if row["algorithm"] in ALGORITHM_MODEL:
        return ALGORITHM_MODEL[row["algorithm"]]
    if row["algorithm"] == f"ps{servers}":
        return ("ps", servers)
    return None


def size_sweep(rows, n, servers):
    print(f"\n(a) size sweep at n = {n} workers (PS: + dedicated servers)")
    print(f"{'size(B)':>10} {'algorithm':>10} {'time(us)':>11} {'busbw':>7} {'model(us)':>11} "
          f"{'meas/model':>10}")
    for row in rows:
        if row["n"] != n:
            continue
        model = row.get("model_s")
        print(f"{row['bytes']:>10} {row['algorithm']:>10} {row['time_s'] * 1e6:>11.1f} "
              f"{row['busbw_GBs']:>7.2f} {(model or 0) * 1e6:>11.1f} "
              f"{(row['time_s'] / model if model else float('nan')):>10.2f}")


def n_sweep(rows, ns, machine, servers, cores):
    from hororing.costmodel import predict
    for nbytes in (4 * MiB, 64 * MiB):
        print(f"\n(b) n sweep at {nbytes // MiB} MiB")
        print(f"{'n':>3} {'ring(us)':>11} {'ps1(us)':>11} {'native(us)':>11} {'PS/ring':>8} "
              f"{'model PS/ring':>13} {'ring t(n)/t(2)':>14} {'2(n-1)/n':>8}  note")
        by = {(row["n"], row["algorithm"]): row["time_s"] for row in rows
              if row["bytes"] == nbytes}
        base = by.get((ns[0], "ring")) if ns[0] == 2 else None
        for n in ns:
            ring, ps1, native = by.get((n, "ring")), by.get((n, "ps1")), by.get((n, "native"))
            if ring is None:
                continue
            model_ratio = predict(machine, "ps", n, nbytes, 1) / predict(machine, "ring", n,
                                                                         nbytes)
            growth = f"{ring / base:>14.2f}" if base else f"{'-':>14}"
            note = "oversubscribed" if n + 1 > cores else ""
            print(f"{n:>3} {ring * 1e6:>11.0f} {ps1 * 1e6:>11.0f} {native * 1e6:>11.0f} "
                  f"{ps1 / ring:>8.2f} {model_ratio:>13.2f} {growth} {2 * (n - 1) / n:>8.2f}  "
                  f"{note}")


def fmt_rate(seconds_per_byte):
    return f"{1 / seconds_per_byte / 1e9:.2f} GB/s" if seconds_per_byte > 0 else "unbounded"


def plot(rows, ns, args, machine):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from hororing.costmodel import predict
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for nbytes, style in ((4 * MiB, "--"), (64 * MiB, "-")):
        for algorithm, model in (("ring", ("ring", 1)), ("ps1", ("ps", 1)), ("native", None)):
            points = [(row["n"], row["time_s"]) for row in rows
                      if row["algorithm"] == algorithm and row["bytes"] == nbytes]
            if points:
                axis.plot(*zip(*points), style, marker="o",
                          label=f"{algorithm} {nbytes // MiB} MiB")
            if model and points:  # no model line for a size that was not measured
                axis.plot(ns, [predict(machine, model[0], n, nbytes, model[1]) for n in ns], ":",
                          color="gray")
    axis.set(xlabel="workers n", ylabel="time per allreduce (s)", yscale="log",
             title="time against n (dotted: calibrated model)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(args.plot + "_time_vs_n.png", dpi=120)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for algorithm in sorted({row["algorithm"] for row in rows}):
        points = [(row["bytes"], row["time_s"]) for row in rows
                  if row["algorithm"] == algorithm and row["n"] == args.size_n]
        axis.plot(*zip(*points), marker="o", label=algorithm)
    axis.set(xlabel="bytes per worker", ylabel="time per allreduce (s)", xscale="log",
             yscale="log", title=f"time against size, n = {args.size_n}")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(args.plot + "_time_vs_size.png", dpi=120)


# ---- one MPI job -------------------------------------------------------------------------

def child(args):
    from mpi4py import MPI

    from hororing.algorithms.ps.placement import Placement
    from hororing.algorithms.ps.server import serve
    from hororing.algorithms.ps.workers import Colocated, ServerClient
    from hororing.algorithms.hierarchical import node_layout
    from hororing.algorithms.ring import Ring
    from hororing.config import Config
    from hororing.costmodel import bus_bandwidth

    world = MPI.COMM_WORLD
    rank, n, k = world.Get_rank(), args.workers, args.servers
    is_worker = rank < n
    workers = world.Split(color=0 if is_worker else 1, key=rank)
    sizes = [int(size) for size in args.sizes.split(",")]
    algorithms = []
    if is_worker:
        local, nodes, _ = node_layout(workers)
        local.Free()
        config = Config.from_environ()
        ring = Ring(workers.Dup(), config.subchunk_bytes(across_nodes=nodes > 1),
                    piece_ceiling=config.piece_ceiling(across_nodes=nodes > 1))
        colocated = Colocated(workers.Dup(), Placement(n, "partitioned", partition_bytes=1))
        algorithms = [("ring", ring.allreduce), ("colocated", colocated.allreduce),
                      ("native", lambda buffer, op: workers.Allreduce(MPI.IN_PLACE, buffer))]
    rows = []
    for name, run in algorithms:
        rows += measure(name, run, sizes, workers, n, args.seconds, args.blocks, bus_bandwidth)
    idle_barrier(world)
    for servers, placement in ((1, "round_robin"), (k, "partitioned")):
        comm = world.Dup()
        name = f"ps{servers}"
        if is_worker:
            client = ServerClient(comm, range(n, n + servers),
                                  Placement(servers, placement, partition_bytes=1), n, 0)
            rows += measure(name, client.allreduce, sizes, workers, n, args.seconds,
                            args.blocks, bus_bandwidth)
            client.close()  # frees comm
        else:
            if rank < n + servers:
                failure, _ = serve(comm, list(range(n)), n, rank - n)
                if failure:
                    raise RuntimeError(failure)
            comm.Free()
        idle_barrier(world)
    if rank == 0:
        for row in rows:
            print(json.dumps(row), flush=True)


def measure(name, run, sizes, workers, n, seconds, blocks, bus_bandwidth):
    from mpi4py import MPI
    rows = []
    for nbytes in sizes:
        buffer = np.ones(nbytes // 4, dtype=np.float32)
        run(buffer, "sum")
        run(buffer, "sum")  # warm-up: scratch buffers, MPI's protocol switches
        workers.Barrier()
        started = time.perf_counter()
        run(buffer, "sum")
        single = workers.allreduce(time.perf_counter() - started, op=MPI.MAX)
        reps = max(blocks, min(200, int(seconds / max(single, 1e-6))))
        check = np.arange(nbytes // 4, dtype=np.float32) % 7 + workers.Get_rank()
        run(check, "sum")
        expected = (np.arange(nbytes // 4, dtype=np.float32) % 7) * n + n * (n - 1) / 2
        wrong = int(np.count_nonzero(check != expected))
        # several timed blocks; the fastest block's mean is the time. On a shared machine
        # other processes only ever add time, so the minimum is the least disturbed estimate
        per_block = max(1, reps // blocks)
        block_means = []
        for _ in range(blocks):
            workers.Barrier()
            started = time.perf_counter()
            for _ in range(per_block):
                run(buffer, "sum")
            block_means.append(workers.allreduce((time.perf_counter() - started) / per_block,
                                                 op=MPI.MAX))
        elapsed = min(block_means)
        rows.append({"algorithm": name, "n": n, "bytes": nbytes, "time_s": elapsed,
                     "median_s": float(np.median(block_means)), "reps": per_block * blocks,
                     "blocks": blocks, "wrong": workers.allreduce(wrong),
                     "busbw_GBs": bus_bandwidth(n, nbytes, elapsed) / 1e9})
        buffer[...] = 1  # the sums grow; keep the values finite
    return rows


def idle_barrier(world):
    """A barrier for ranks with nothing to do meanwhile: it sleeps 20 ms between checks.

    MPICH's Barrier spins, and even hororing's back-off wakes every millisecond; on a host
    with few cores every such wake-up can preempt a rank that is being timed.
    """
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.02)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--ns", default="2,3,4", help="worker counts to sweep")
    parser.add_argument("--servers", type=int, default=2, help="K of the partitioned PS")
    parser.add_argument("--sizes", default=",".join(str(4 ** i * 1024) for i in range(9)),
                        help="bytes per worker (default 1 KiB ... 64 MiB)")
    parser.add_argument("--size-n", type=int, default=3, help="n of the size sweep (a)")
    parser.add_argument("--fit-from", type=int, default=MiB, help="smallest size in the fit")
    parser.add_argument("--seconds", type=float, default=0.3, help="timed seconds per point")
    parser.add_argument("--blocks", type=int, default=5,
                        help="timed blocks per point; the time is the fastest block's mean")
    parser.add_argument("--json")
    parser.add_argument("--rows-from", metavar="JSON",
                        help="take the measurements from the --json of an earlier run instead "
                             "of running jobs (to fit, print or plot them again)")
    parser.add_argument("--plot", help="PNG path prefix")
    parser.add_argument("--mpiexec", default="mpiexec",
                        help="the launcher, with its arguments as one string (e.g. hosts: "
                             "\"mpiexec -f HOSTFILE $(cat MPI_ARGS)\", scripts/emulated_hosts.sh)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    main()
