#!/usr/bin/env python
"""Sharded optimizer state (DistributedOptimizer(sharded=True)): memory and step time.

Run under MPI:

  mpiexec -n 2 python scripts/bench_sharded.py memory --variant sharded
  mpiexec -n 2 python scripts/bench_sharded.py memory --variant sharded2
  mpiexec -n 2 python scripts/bench_sharded.py memory --variant unsharded
  mpiexec -n 2 python scripts/bench_sharded.py time

``memory`` builds an MLP of --params parameters (float32, square layers), takes two Adam
steps with one variant (one per job, so each job's peak RSS is its own) and prints per rank
the optimizer-state bytes (the optimizer's state tensors, read after the steps), the gradient
bytes held after the step (the model's ``.grad``; a sharded optimizer's own gradient
vectors) and the peak resident set size.

``time`` trains one smaller MLP per variant in the same processes, taking turns step by step
(the order rotates), each rank on its own batch; a step is zero_grad, forward, backward,
step. Variants: ``unsharded`` (hvd.DistributedOptimizer(Adam)), ``sharded`` (the same with
sharded=True), ``sharded2`` (sharded=2: the gradients sharded too), ``torch-zero`` (torch's
ZeroRedundancyOptimizer(Adam) with its model in DistributedDataParallel over gloo), ``fsdp2`` (torch's ``fully_shard`` on every layer and on
the model, Adam on the sharded parameters, over gloo). The table gives the median step over
the steps, on the slowest rank, and each variant's time over the sharded one's.
"""

import argparse
import json
import resource
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import hororing.torch as hvd
from benchinfo import machine_info, machine_line, setup_torch_distributed

COMM = MPI.COMM_WORLD


def build(params, width):
    """Square float32 layers of ``width`` adding up to about ``params`` parameters."""
    layers = max(1, round(params / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return model, width


def state_bytes(optimizer):
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value))


SHARDED = {"unsharded": False, "sharded": True, "sharded2": 2}  # DistributedOptimizer's sharded=


def gradient_bytes(model, optimizer):
    """The gradient memory held: a sharded optimizer's own vectors, else the model's .grad."""
    if hasattr(optimizer, "held_gradient_bytes"):
        return optimizer.held_gradient_bytes()
    return sum(parameter.grad.nbytes for parameter in model.parameters()
               if parameter.grad is not None)


def memory(args):
    torch.manual_seed(0)
    model, width = build(args.params, args.width)
    adam = torch.optim.Adam(model.parameters(), lr=1e-4)
    optimizer = hvd.DistributedOptimizer(adam, named_parameters=model.named_parameters(),
                                         sharded=SHARDED[args.variant])
    data = torch.randn(args.batch_size, width,
                       generator=torch.Generator().manual_seed(hvd.rank()))
    for _ in range(2):
        optimizer.zero_grad()
        model(data).pow(2).mean().backward()
        optimizer.step()
    held = state_bytes(optimizer)
    gradients = gradient_bytes(model, optimizer)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    parameters = sum(parameter.numel() for parameter in model.parameters())
    rows = COMM.gather({"rank": hvd.rank(), "state_bytes": held, "gradient_bytes": gradients,
                        "peak_rss_bytes": peak}, root=0)
    if hvd.rank() == 0:
        result = {"measure": "memory", "variant": args.variant, "ranks": hvd.size(),
                  "parameters": parameters, "rows": rows, "machine": machine_info()}
        print(machine_line(result["machine"]))
        print(f"# {parameters / 1e6:.1f} M parameters, Adam, {args.variant}, {hvd.size()} ranks")
        for row in rows:
            print(f"rank {row['rank']}: optimizer state {row['state_bytes'] / 2**20:.1f} MiB, "
                  f"gradients held {row['gradient_bytes'] / 2**20:.1f} MiB, "
                  f"peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB")
        print(json.dumps(result))


def timing(args):
    size = hvd.size()
    variants = {}
    for name in args.variants:
        torch.manual_seed(0)
        model, width = build(args.params, args.width)
        adam = torch.optim.Adam(model.parameters(), lr=1e-4)
        variants[name] = (model, hvd.DistributedOptimizer(
            adam, named_parameters=model.named_parameters(), sharded=SHARDED[name]))
    if size > 1 and setup_torch_distributed(COMM):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        torch.manual_seed(0)
        model, width = build(args.params, args.width)
        model = torch.nn.parallel.DistributedDataParallel(model)
        variants["torch-zero"] = (model, ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4))
        fsdp = fsdp2(args)
        if fsdp is not None:
            variants["fsdp2"] = fsdp
    names = list(variants)
    times = {name: [] for name in names}
    generator = torch.Generator().manual_seed(hvd.rank())
    for step in range(args.steps + 2):
        data = torch.randn(args.batch_size, width, generator=generator)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            model, optimizer = variants[name]
            COMM.Barrier()
            started = time.perf_counter()
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            optimizer.step()
            elapsed = COMM.allreduce(time.perf_counter() - started, op=MPI.MAX)
            if step >= 2:  # the first steps create the optimizers' state
                times[name].append(elapsed)
    # every variant trained the same steps from the same start: the same parameters
    reference = [parameter.detach() for parameter in variants["unsharded"][0].parameters()]
    differences = {name: max(float((_full(parameter) - ref).abs().max()) for parameter, ref in
                             zip(variants[name][0].parameters(), reference)) for name in names}
    medians = {name: float(np.median(values)) * 1e3 for name, values in times.items()}
    if hvd.rank() == 0:
        parameters = sum(parameter.numel() for parameter in variants["sharded"][0].parameters())
        print(machine_line(machine_info()))
        print(f"# step time (ms), {parameters / 1e6:.1f} M parameters, Adam, batch "
              f"{args.batch_size} per rank, {size} ranks, median of {args.steps} steps")
        for name in names:
            print(f"{name:>11} {medians[name]:9.1f} ms  {medians[name] / medians['sharded']:.2f}"
                  f" x sharded   max |param - unsharded's| {differences[name]:.2e}")
        print(json.dumps({"measure": "time", "ranks": size, "parameters": parameters,
                          "median_ms": medians, "max_difference": differences,
                          "machine": machine_info()}))


def fsdp2(args):
    """torch's FSDP2 (``fully_shard`` on each layer and the model, over gloo on the CPU) with
    Adam, or None where this torch cannot run it (the reason printed on rank 0)."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (hvd.size(),))
        torch.manual_seed(0)
        model, _ = build(args.params, args.width)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    except (ImportError, RuntimeError, ValueError, NotImplementedError) as error:
        if hvd.rank() == 0:
            print(f"# fsdp2 left out: {type(error).__name__}: {error}")
        return None


def _full(parameter):
    """A parameter's whole value (FSDP2's are sharded DTensors: gathered, a collective)."""
    parameter = parameter.detach()
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("measure", choices=["memory", "time"])
    parser.add_argument("--variant", choices=list(SHARDED), default="sharded",
                        help="memory: the optimizer to measure (one per job)")
    parser.add_argument("--variants", nargs="+", choices=list(SHARDED), default=list(SHARDED),
                        help="time: hororing's optimizers to train side by side (unsharded and "
                             "sharded always; torch's follow where torch.distributed runs)")
    parser.add_argument("--params", type=float, default=None,
                        help="parameters (default: 100e6 for memory, 8e6 for time)")
    parser.add_argument("--width", type=int, default=None,
                        help="layer width (default: 4096 for memory, 1024 for time)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.params is None:
        args.params = 100e6 if args.measure == "memory" else 8e6
    if args.width is None:
        args.width = 4096 if args.measure == "memory" else 1024
    args.variants = ["unsharded", "sharded"] + [name for name in args.variants
                                                if name not in ("unsharded", "sharded")]
    return args


def main():
    args = parse_args()
    hvd.init()
    if args.measure == "memory":
        memory(args)
    else:
        timing(args)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
