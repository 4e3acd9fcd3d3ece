#!/usr/bin/env python
"""Autotuning measured: a training job tuned online against hand-picked settings.

    python scripts/bench_autotune.py [--sizes 2] [--json results/autotune.json]

The driver starts one MPI job per starting point (``--starts``):

  poor      HOROVOD_FUSION_THRESHOLD=1 MiB, HOROVOD_CYCLE_TIME=5 ms, with
            HORORING_AUTOTUNE_FROM_SET=1 (the poor values are where tuning starts)
  defaults  nothing set: tuning starts from hororing's defaults

Each job runs with HOROVOD_AUTOTUNE=1 (and HOROVOD_AUTOTUNE_LOG) and trains
bench_training.py's large MLP (2.2 M parameters) with hvd.DistributedOptimizer on digits until
the autotuner has finished (every rank agrees it has). It then times, side by side in the same
processes, the tuned settings and a grid of hand-picked ones (fusion threshold x cycle time,
the other settings at their defaults), applied to the engine between rounds: each round runs
every setting in turn (the order rotates), a few untimed steps after each change, then
``--steps`` timed steps; a round's step time is the slowest rank's; the table gives the
median over ``--rounds`` rounds. "tuned / best" compares the tuned settings with the fastest
hand-picked one, "tuned / defaults" with hororing's defaults.
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchinfo import machine_info, machine_line
from bench_training import build_mlp, train_steps

MiB = 1024 * 1024
STARTS = {"poor": {"HOROVOD_FUSION_THRESHOLD": str(MiB), "HOROVOD_CYCLE_TIME": "5",
                   "HORORING_AUTOTUNE_FROM_SET": "1"},
          "defaults": {},
          # what hurts most here (docs/tuning.md): tiny ring pieces, the latency path for
          # whole buckets, no fusion to speak of, and long waits before each cycle
          "worst": {"HOROVOD_FUSION_THRESHOLD": str(256 * 1024), "HOROVOD_CYCLE_TIME": "25",
                    "HORORING_RING_SUBCHUNK_BYTES": str(64 * 1024),
                    "HORORING_SMALL_ALLREDUCE_TOTAL_BYTES": str(8 * MiB),
                    "HOROVOD_HIERARCHICAL_ALLREDUCE": "0",  # where the job spans hosts
                    "HORORING_AUTOTUNE_FROM_SET": "1"}}
GRID_FUSION_MIB = (1, 4, 16, 64)
GRID_CYCLE_MS = (0.2, 1.0, 5.0)


def main():
    args = parse_args()
    if args.child:
        child(args)
    else:
        driver(args)


def driver(args):
    results = []
    for size in args.sizes:
        for start in args.starts:
            with tempfile.TemporaryDirectory() as scratch:
                output = os.path.join(scratch, "result.json")
                env = dict(os.environ, HOROVOD_AUTOTUNE="1",
                           HOROVOD_AUTOTUNE_LOG=os.path.join(scratch, "autotune.csv"),
                           **STARTS[start])
                command = [args.mpiexec, *args.mpi_args.split(), "-n", str(size),
                           sys.executable, "-m", "mpi4py", __file__, "--child", "--steps", str(args.steps),
                           "--rounds", str(args.rounds),
                           "--max-tuning-steps", str(args.max_tuning_steps),
                           "--batch-size", str(args.batch_size),
                           "--widths", *map(str, args.widths),
                           "--child-output", output]
                done = subprocess.run(command, env=env, timeout=args.timeout, stdout=sys.stderr)
                if done.returncode != 0:
                    sys.exit(f"bench_autotune: {' '.join(command)} exited with {done.returncode}")
                result = json.load(open(output))
                with open(env["HOROVOD_AUTOTUNE_LOG"]) as handle:
                    result["log_rows"] = list(csv.DictReader(handle))
                result.update(size=size, start=start)
                results.append(result)
    lines = [machine_line(results[0]["machine"]),
             f"# an MLP {'-'.join(map(str, args.widths))} "
             f"({results[0]['parameters'] / 1e6:.1f} M parameters), batch {args.batch_size} "
             f"per rank; "
             f"{args.steps} steps x {args.rounds} rounds per setting", ""]
    for result in results:
        lines += report(result)
    table = "\n".join(lines)
    print(table)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)


def report(result):
    step_ms = result["step_ms"]
    grid = {name: ms for name, ms in step_ms.items() if name not in ("tuned", "start")}
    best = min(grid, key=grid.get)
    tuned = result["tuned"]
    lines = [f"## {result['size']} ranks, tuning started from {result['start']}", "",
             f"Tuning took {result['tuning_steps']} steps ({result['tuning_s']:.1f} s), "
             f"{len(result['log_rows'])} rows in the CSV log; it chose fusion "
             f"{tuned['fusion_threshold'] / MiB:.2f} MiB, cycle {tuned['cycle_time_ms']} ms, "
             f"small total {tuned['small_total_bytes'] / 1024:.0f} KiB, sub-chunk "
             f"{tuned['subchunk_bytes'] / 1024:.0f} KiB, hierarchical "
             f"{'on' if tuned['hierarchical'] else 'off'}.", "",
             "| setting | step (ms) |", "|---|---:|"]
    for name, ms in sorted(step_ms.items(), key=lambda item: item[1]):
        lines.append(f"| {name} | {ms:.2f} |")
    lines += ["", f"tuned / best hand-picked ({best}): {step_ms['tuned'] / grid[best]:.3f}; "
              f"tuned / defaults: {step_ms['tuned'] / step_ms[DEFAULTS]:.3f}; "
              f"tuned / start: {step_ms['tuned'] / step_ms['start']:.3f}", ""]
    return lines


def grid_name(fusion_mib, cycle_ms):
    return f"fusion {fusion_mib} MiB, cycle {cycle_ms} ms"


DEFAULTS = grid_name(64, 1.0)


def child(args):
    import dataclasses

    import numpy as np
    import torch
    from mpi4py import MPI
    from sklearn.datasets import load_digits

    import hororing.torch as hvd
    from hororing.context import current

    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    digits = load_digits()
    features = torch.from_numpy((digits.data / 16.0).astype(np.float32))[rank::size]
    labels = torch.from_numpy(digits.target)[rank::size]
    batch = args.batch_size
    batches = [(features[i:i + batch], labels[i:i + batch])
               for i in range(0, len(features) - batch + 1, batch)]
    model = build_mlp(args.widths)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters())
    engine = current().engine
    tuner = engine.tuner
    defaults = _default_settings(engine)
    started, steps = time.perf_counter(), 0
    # every rank must agree tuning is over: the flag changes inside a cycle, which a rank's
    # step may leave before its engine thread has run that cycle's end
    while comm.allreduce(tuner.active, op=MPI.LOR):
        if steps >= args.max_tuning_steps:
            sys.exit(f"bench_autotune: tuning did not finish in {steps} steps")
        train_steps(model, optimizer, batches, 1, steps)
        steps += 1
    tuning_s = time.perf_counter() - started
    settings = {"tuned": tuner.settings, "start": tuner.history[0]}
    for fusion in GRID_FUSION_MIB:
        for cycle in GRID_CYCLE_MS:
            settings[grid_name(fusion, cycle)] = dataclasses.replace(
                defaults, fusion_threshold=fusion * MiB, cycle_time_ms=cycle)
    names = list(settings)
    times = {name: [] for name in names}
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            comm.Barrier()  # nothing in flight: every rank changes settings between steps
            engine.apply_settings(settings[name])
            train_steps(model, optimizer, batches, 3, 0)  # the buckets are laid out again
            comm.Barrier()
            begun = time.perf_counter()
            train_steps(model, optimizer, batches, args.steps, round_ * args.steps)
            elapsed = comm.allreduce(time.perf_counter() - begun, op=MPI.MAX)
            times[name].append(elapsed / args.steps * 1e3)
    if rank == 0:
        with open(args.child_output, "w") as handle:
            json.dump({"machine": machine_info(), "tuning_steps": steps,
                       "parameters": sum(p.numel() for p in model.parameters()),
                       "tuning_s": tuning_s,
                       "tuned": dataclasses.asdict(tuner.settings),
                       "history": len(tuner.history),
                       "step_ms": {name: statistics.median(values)
                                   for name, values in times.items()}}, handle)
    hvd.shutdown()


def _default_settings(engine):
    """The settings hororing runs with when nothing is set."""
    from hororing.config import Config
    from hororing.context import current
    from hororing.tuning import Settings

    config = Config()
    # by default the hierarchical allreduce runs wherever it is made (a job across hosts)
    hierarchical = "hierarchical" in engine.allreduce.host.algorithms
    across_nodes, size = current().cross_size > 1, current().size
    return Settings(config.fusion_threshold, config.cycle_time_ms,
                    config.small_threshold(size, across_nodes) * size,
                    config.subchunk_bytes(across_nodes=across_nodes), hierarchical)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--starts", nargs="+", default=list(STARTS), choices=list(STARTS))
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 1024, 1024, 1024, 10],
                        help="the MLP's layer widths (default: bench_training.py's large)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per setting a round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-tuning-steps", type=int, default=5000)
    parser.add_argument("--mpiexec", default="mpiexec")
    parser.add_argument("--mpi-args", default="", help="more mpiexec arguments (emulated "
                        "hosts: -f HOSTFILE and the contents of their mpi-args file)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per MPI job")
    parser.add_argument("--json", help="write all results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-output", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    main()
