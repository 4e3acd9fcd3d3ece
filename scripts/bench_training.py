#!/usr/bin/env python
"""Training step time: hororing's DistributedOptimizer beside plain PyTorch and DDP.

    python scripts/bench_training.py [--json results/training.json] [--markdown table.md]

The driver (run without mpiexec) starts one MPI job per size: ``mpiexec -n 1`` and
``mpiexec -n 2`` by default (``--sizes``). Each job trains two models on scikit-learn's
digits, each rank on its own shard with batch ``--batch-size``:

  small   examples/train.py's MLP (64-128-64-10, 17 K parameters)
  large   an MLP 64-1024-1024-1024-10 (2.2 M parameters, 8.7 MB of float32 gradients)

Variants, timed side by side in the same processes: at size 1 ``torch`` (the optimizer
alone) and ``hororing`` (the same optimizer wrapped by hvd.DistributedOptimizer); at larger
sizes ``hororing`` and ``ddp`` (torch DistributedDataParallel: over gloo on the CPU; with
``--device cuda`` over NCCL when every rank has a GPU of its own, else over gloo, since NCCL
refuses two ranks on one GPU). Every round times
``--steps`` steps of each variant in turn (the order rotates between rounds); the step time
of a round is the slowest rank's, and the table gives the median over ``--rounds`` rounds.

After timing, a few hororing steps run under the timeline (rank 0 writes it) and
``hororing.timeline.overlap_report`` reads from it how much of the allreduce work ran while
backward was still producing gradients (``hidden``). Every variant trains the same steps on
the same batches from the same initial weights, so the table also gives the largest
difference between hororing's parameters and its peer's at the end (a correctness check).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchinfo import machine_info, machine_line, setup_torch_distributed

MODELS = {"small": (64, 128, 64, 10), "large": (64, 1024, 1024, 1024, 10)}


def main():
    args = parse_args()
    if args.child:
        child(args)
    else:
        driver(args)


# ---- driver ---------------------------------------------------------------------------------

def driver(args):
    results = []
    for size in args.sizes:
        command = [args.mpiexec, "-n", str(size), sys.executable, "-m", "mpi4py", __file__, "--child",
                   "--steps", str(args.steps), "--rounds", str(args.rounds),
                   "--batch-size", str(args.batch_size), "--models", *args.models,
                   "--device", args.device]
        with tempfile.NamedTemporaryFile(suffix=".json") as output:
            command += ["--child-output", output.name]
            done = subprocess.run(command, timeout=args.timeout, stdout=sys.stderr)
            if done.returncode != 0:
                sys.exit(f"bench_training: {' '.join(command)} exited with {done.returncode}")
            results.append(json.load(open(output.name)))
    info = results[0]["machine"]
    lines = [machine_line(info) + f", torch {info['torch']}" + (
                 f", {info['gpu']}, DDP over {results[-1]['ddp_backend']}" if args.device == "cuda" else ""),
             f"# {info['cores']} cores; sizes above {info['cores']} ranks are oversubscribed. "
             f"batch {args.batch_size} per rank, {args.steps} steps x {args.rounds} rounds, "
             f"torch threads per rank = cores // ranks",
             "", "| ranks | model | parameters | variant | step (ms) | vs peer | hidden | max param diff |",
             "|---:|---|---:|---|---:|---:|---:|---:|"]
    for result in results:
        for model in result["models"]:
            peer_ms = model["step_ms"].get(model["peer"])
            for variant, step_ms in model["step_ms"].items():
                ratio = f"{step_ms / peer_ms:.3f}" if variant == "hororing" and peer_ms else ""
                hidden = model.get("hidden_fraction") if variant == "hororing" else None
                lines.append(f"| {result['size']} | {model['name']} | {model['parameters']:,} | "
                             f"{variant} | {step_ms:.3f} | {ratio} | "
                             f"{'' if hidden is None else f'{hidden:.0%}'} | "
                             f"{_diff(model, variant)} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(table + "\n")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)


def _diff(model, variant):
    if variant != "hororing" or "max_param_diff" not in model:
        return ""
    return f"{model['max_param_diff']:.1e}"


# ---- one MPI job ----------------------------------------------------------------------------

def child(args):
    import numpy as np
    import torch
    from mpi4py import MPI
    from sklearn.datasets import load_digits

    import hororing.torch as hvd
    from hororing.timeline import overlap_report

    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    device = torch.device("cpu")
    if args.device == "cuda":  # ranks share the GPUs round-robin
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    digits = load_digits()
    features = torch.from_numpy((digits.data / 16.0).astype(np.float32))[rank::size].to(device)
    labels = torch.from_numpy(digits.target)[rank::size].to(device)
    batches = [(features[i:i + args.batch_size], labels[i:i + args.batch_size])
               for i in range(0, len(features) - args.batch_size + 1, args.batch_size)]
    ddp_backend = ddp_backend_for(args.device, size, torch)
    ddp = size > 1 and setup_torch_distributed(comm, ddp_backend)
    reports = []
    for name in args.models:
        variants = {}
        if size == 1:
            model = build(name, device)
            variants["torch"] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        model = build(name, device)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            named_parameters=model.named_parameters())
        variants["hororing"] = (model, optimizer)
        if ddp:
            model = torch.nn.parallel.DistributedDataParallel(build(name, device))
            variants["ddp"] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        step_ms = time_variants(variants, batches, args, comm)
        peer = "torch" if size == 1 else "ddp"
        parameters = sum(p.numel() for p in variants["hororing"][0].parameters())
        report = {"name": name, "parameters": parameters,
                  "step_ms": step_ms, "peer": peer}
        if peer in variants:
            # the same steps on the same batches from the same start: the same parameters
            report["max_param_diff"] = comm.allreduce(
                max_difference(variants["hororing"][0], variants[peer][0]), op=MPI.MAX)
        if size > 1:
            report.update(timeline_overlap(variants["hororing"], batches, hvd, overlap_report, comm))
        reports.append(report)
    if rank == 0:
        with open(args.child_output, "w") as handle:
            json.dump({"size": size, "machine": machine(torch, device), "models": reports,
                       "device": str(device), "ddp_backend": ddp_backend}, handle)
    hvd.shutdown()


def max_difference(model, other):
    pairs = zip(model.parameters(), other.parameters())
    return max(float((mine - theirs).detach().abs().max()) for mine, theirs in pairs)


def ddp_backend_for(device, size, torch):
    """gloo on the CPU; NCCL when every rank has a GPU of its own (NCCL refuses two ranks on
    one GPU), else gloo, which also reduces CUDA tensors."""
    if device == "cuda" and torch.cuda.device_count() >= size and torch.distributed.is_nccl_available():
        return "nccl"
    return "gloo"


def build(name, device):
    return build_mlp(MODELS[name], device)


def build_mlp(widths, device="cpu"):
    """An MLP of these layer widths, seeded alike on every rank."""
    import torch
    torch.manual_seed(0)
    layers = []
    for inputs, outputs in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(inputs, outputs), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).to(device)


def train_steps(model, optimizer, batches, steps, start):
    import torch
    loss_fn = torch.nn.CrossEntropyLoss()
    for index in range(start, start + steps):
        inputs, labels = batches[index % len(batches)]
        optimizer.zero_grad()
        loss_fn(model(inputs), labels).backward()
        optimizer.step()


def time_variants(variants, batches, args, comm):
    """Median over rounds of the slowest rank's mean step time, per variant, in ms."""
    from mpi4py import MPI
    import torch
    names = list(variants)
    for name in names:  # warm-up: allocations, DDP's buckets, the engine's response cache
        train_steps(*variants[name], batches, 10, 0)
    times = {name: [] for name in names}
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            comm.Barrier()
            started = time.perf_counter()
            train_steps(*variants[name], batches, args.steps, round_ * args.steps)
            if batches[0][0].is_cuda:  # the last step's kernels may still be queued
                torch.cuda.synchronize()
            elapsed = comm.allreduce(time.perf_counter() - started, op=MPI.MAX)
            times[name].append(elapsed / args.steps * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def timeline_overlap(variant, batches, hvd, overlap_report, comm, steps=20):
    """Run ``steps`` hororing steps under the timeline; report the hidden fraction (rank 0's)."""
    path = comm.bcast(tempfile.mktemp(suffix=".json") if comm.Get_rank() == 0 else None)
    comm.Barrier()
    hvd.start_timeline(path)
    train_steps(*variant, batches, steps, 0)
    hvd.stop_timeline()
    report = None
    if comm.Get_rank() == 0:
        with open(path) as handle:
            overlap = overlap_report(json.load(handle))
        os.unlink(path)
        per_step = overlap["steps"]
        report = {"hidden_fraction": overlap["hidden_fraction"], "timeline_steps": len(per_step),
                  "reduce_ms_per_step": sum(total for _, total in per_step) / len(per_step) / 1e3}
    return comm.bcast(report)


def machine(torch, device):
    info = machine_info()
    info["torch"] = torch.__version__
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: models and batches on the GPUs (local rank modulo GPU count)")
    parser.add_argument("--mpiexec", default="mpiexec")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per MPI job")
    parser.add_argument("--json", help="write all results here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-output", help=argparse.SUPPRESS)
    return parser.parse_args()

if __name__ == "__main__":
    main()
