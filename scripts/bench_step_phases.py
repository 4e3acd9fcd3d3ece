#!/usr/bin/env python
"""Where a training step's time goes: hororing's optimizer beside DDP's, one step at a time.

Run under MPI, e.g. across emulated hosts (docs/compression.md):
    mpiexec -f D/hostfile $(cat D/mpi-args) -genvall -n 4 python scripts/bench_step_phases.py

bench_compression.py's model is trained (forward, backward, SGD step) for --steps steps with
hororing's DistributedOptimizer (no hook: the optimizer's own allreduce), then with DDP over
gloo (25 MB buckets). Each step starts after a Barrier; the times are rank 0's, in ms from the
step's start:

  fwd, bwd   the end of the forward and of the backward pass (DDP's backward holds its
             allreduces: it returns once every bucket is reduced)
  sync       the end of ``optimizer.synchronize()`` (hororing: every bucket reduced)
  sgd        the SGD step's own time
  slowest    the step as the slowest rank took it
  grads      when each parameter's gradient was accumulated (name:ms)
  rings      each ring allreduce of the engine, [start-end bucket MB] (hororing only)
  cycles     each negotiation cycle, c<thread>[start-end q<new requests> r<responses run>]
             (hororing only)

The engine's ring and cycle are wrapped to note their times (a few microseconds a call).
"""

import argparse
import contextlib
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compression import batches, build, interface, start_gloo  # noqa: E402

import hororing.torch as hvd  # noqa: E402
from hororing._mpi import MPI  # noqa: E402
from hororing.algorithms.ring import Ring  # noqa: E402
from hororing.engine.cycle import Cycle  # noqa: E402

EVENTS = []  # (kind, start, end, details...) of the step being timed


def _noted_ring(run):
    def ring_run(self, buffer, *args, **kwargs):
        started = time.perf_counter()
        run(self, buffer, *args, **kwargs)
        EVENTS.append(("ring", started, time.perf_counter(), buffer.nbytes))
    return ring_run


def _noted_cycle(run):
    def cycle_run(self, fresh, *args, **kwargs):
        started = time.perf_counter()
        decision = run(self, fresh, *args, **kwargs)
        EVENTS.append(("cycle", started, time.perf_counter(), threading.current_thread().name[:4],
                       len(fresh), -1 if decision is None else len(decision.responses)))
        return decision
    return cycle_run


def train(comm, model_name, steps, ddp):
    model = build(model_name)
    accumulated = {}
    for name, parameter in model.named_parameters():
        parameter.register_post_accumulate_grad_hook(
            lambda _, name=name: accumulated.setdefault(name, time.perf_counter()) and None)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=25)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        synchronize, skip = (lambda: None), contextlib.nullcontext
    else:
        forward = model
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                             model.named_parameters())
        synchronize, skip = optimizer.synchronize, optimizer.skip_synchronize
    stream = batches(model_name, comm.rank)
    lines = []
    for step in range(steps):
        inputs, labels = next(stream)
        comm.Barrier()
        EVENTS.clear()
        accumulated.clear()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(inputs), labels)
        forward_end = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        synchronize()
        sync_end = time.perf_counter()
        with skip():
            optimizer.step()
        end = time.perf_counter()
        slowest = comm.allreduce(end - start, op=MPI.MAX)

        def ms(moment):
            return 1e3 * (moment - start)
        rings = " ".join(f"[{ms(e[1]):.0f}-{ms(e[2]):.0f} {e[3] / 1e6:.1f}MB]"
                         for e in EVENTS if e[0] == "ring")
        cycles = " ".join(f"c{e[3]}[{ms(e[1]):.0f}-{ms(e[2]):.0f} q{e[4]} r{e[5]}]"
                          for e in EVENTS if e[0] == "cycle")
        grads = " ".join(f"{name}:{ms(moment):.0f}" for name, moment
                         in sorted(accumulated.items(), key=lambda item: item[1]))
        lines.append(f"{'ddp' if ddp else 'hororing'} step {step}: slowest {1e3 * slowest:.0f} | "
                     f"fwd {ms(forward_end):.0f} bwd {ms(backward_end):.0f} "
                     f"sync {ms(sync_end):.0f} sgd {1e3 * (end - sync_end):.0f} | "
                     f"grads {grads}" + (f"\n    rings {rings}\n    cycles {cycles}"
                                         if not ddp else ""))
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--model", choices=["large", "train"], default="large")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    Ring._run = _noted_ring(Ring._run)
    Cycle.run = _noted_cycle(Cycle.run)
    link, address = interface(comm)
    start_gloo(comm, link, address)
    for ddp in (False, True):
        lines = train(comm, args.model, args.steps, ddp)
        if comm.rank == 0:
            print("\n".join(lines), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
