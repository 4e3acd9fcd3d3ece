#!/usr/bin/env python
"""DistributedDataParallel over the hororing backend beside DDP over gloo, in one job.

    mpiexec -n 2 python scripts/bench_ddp_backend.py [--models small large mlp25m]
            [--hooks none fp16 powersgd4] [--rounds 4 --steps 3]

Across emulated hosts (docs/torch_distributed.md):

    bash scripts/emulated_hosts.sh up 2 --rate 1gbit --dir D
    mpiexec -f D/hostfile $(cat D/mpi-args) -n 2 python scripts/bench_ddp_backend.py
    bash scripts/emulated_hosts.sh down --dir D

The default group is hororing's (``init_process_group("hororing")`` with nothing but
MASTER_ADDR/MASTER_PORT set, for the gloo group beside it); gloo's is ``new_group(backend=
"gloo")`` over the same ranks. Each variant is DDP over one of the two with one of DDP's own
comm hooks (none: DDP's allreduce; fp16_compress_hook; powerSGD_hook rank 4 from step 2),
or FSDP2 (``--hooks fsdp2``: fully_shard on each Linear and on the model, over the group);
beside them each rank steps the model alone, with no communication at all: the step's
compute, below which no backend's step can go (its time over gloo's DDP step is the lowest
ratio any backend could show). Every variant has its own copy of the model from the same weights, fed the same batches, timed in
turn (the order rotating between rounds), a Barrier before each step; a step's time is the
slowest rank's and the table gives the median. After the last step the two backends' copies
are compared: the largest parameter difference between DDP over hororing and DDP over gloo
with the same hook.

Models: ``small`` and ``large``, bench_training.py's MLPs (64-128-64-10, 17 K parameters;
64-1024-1024-1024-10, 2.2 M), batch 32 of random data; ``mlp25m``, bench_compression.py's
large MLP (1024-4096-4096-1024-10, 25.2 M parameters), batch 16.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compression import _free_port, interface, sent_bytes  # noqa: E402
from benchinfo import machine_info, machine_line  # noqa: E402

import hororing.torch as hvd  # noqa: E402
from hororing._mpi import MPI  # noqa: E402

WIDTHS = {"small": (64, 128, 64, 10), "large": (64, 1024, 1024, 1024, 10),
          "mlp25m": (1024, 4096, 4096, 1024, 10)}
BATCH = {"small": 32, "large": 32, "mlp25m": 16}
POWERSGD_START = 2


def build(model):
    torch.manual_seed(0)
    widths = WIDTHS[model]
    layers = []
    for index, (inputs, outputs) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(inputs, outputs))
        if index + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def batches(model, rank, count):
    generator = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(BATCH[model], WIDTHS[model][0], generator=generator),
             torch.randint(0, 10, (BATCH[model],), generator=generator))
            for _ in range(count)]


class Variant:
    def __init__(self, model, backend, hook, group):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        self.label = f"{backend} {hook}"
        self.backend, self.hook = backend, hook
        self.times, self.bytes = [], []
        if backend == "alone":  # no communication: the step's compute, the floor
            self.net = build(model)
            self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.01)
            return
        if hook == "fsdp2":
            self.net = fsdp2(build(model), group)
            self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.01)
            return
        self.net = torch.nn.parallel.DistributedDataParallel(
            build(model), process_group=group, gradient_as_bucket_view=True,
            # powerSGD_hook over gloo hangs with several buckets in flight (bench_compression.py)
            bucket_cap_mb=1024 if hook.startswith("powersgd") else 25)
        if hook == "fp16":
            self.net.register_comm_hook(group, default_hooks.fp16_compress_hook)
        elif hook.startswith("powersgd"):
            state = powerSGD_hook.PowerSGDState(
                process_group=group, matrix_approximation_rank=int(hook[-1]),
                start_powerSGD_iter=POWERSGD_START, min_compression_rate=2,
                use_error_feedback=True, warm_start=True)
            self.net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.01)

    def parameters(self):
        """The full parameters (FSDP2's sharded ones gathered)."""
        return [getattr(parameter, "full_tensor", lambda: parameter)().detach()
                for parameter in self.net.parameters()]

    def step(self, inputs, labels):
        self.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(self.net(inputs), labels).backward()
        self.optimizer.step()


def fsdp2(net, group):
    """FSDP2 over ``group`` (None: the default group): each Linear sharded, then the whole."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def run_model(comm, model, args, link):
    gloo = dist.new_group(backend="gloo")
    variants = [Variant(model, backend, hook, None if backend == "hororing" else gloo)
                for hook in args.hooks for backend in ("hororing", "gloo")]
    variants.append(Variant(model, "alone", "none", None))
    data = batches(model, comm.rank, POWERSGD_START + 1 + args.rounds * args.steps)
    for variant in variants:
        for inputs, labels in data[:POWERSGD_START + 1]:
            variant.step(inputs, labels)
    offset = POWERSGD_START + 1
    for round_index in range(args.rounds):
        turn = round_index % len(variants)
        for variant in variants[turn:] + variants[:turn]:
            for inputs, labels in data[offset + round_index * args.steps:
                                       offset + (round_index + 1) * args.steps]:
                comm.Barrier()
                before = sent_bytes(link)
                started = time.perf_counter()
                variant.step(inputs, labels)
                elapsed = time.perf_counter() - started
                variant.bytes.append(sent_bytes(link) - before)
                variant.times.append(comm.allreduce(elapsed, op=MPI.MAX))
    rows = []
    by_label = {variant.label: variant for variant in variants}
    for variant in variants:
        row = {"model": model, "variant": variant.label,
               "step_ms": 1e3 * statistics.median(variant.times),
               "sent_mb": statistics.median(variant.bytes) / 1e6 / (comm.size if link == "lo"
                                                                   else 1)}
        if variant.backend == "hororing":
            other = by_label[f"gloo {variant.hook}"]
            row["max_param_diff"] = comm.allreduce(max(
                (mine - theirs).abs().max().item()
                for mine, theirs in zip(variant.parameters(), other.parameters())),
                op=MPI.MAX)
        rows.append(row)
    dist.destroy_process_group(gloo)
    return rows


def report(model, rows, size, link):
    by_label = {row["variant"]: row for row in rows}
    print(f"\n## {model}: {size} ranks, link {link}")
    print(f"{'hook':>10} {'hororing ms':>12} {'gloo ms':>9} {'ratio':>6} {'MB sent':>8} "
          f"{'param diff':>11}")
    for row in rows:
        if not row["variant"].startswith("hororing"):
            continue
        hook = row["variant"].split()[1]
        peer = by_label[f"gloo {hook}"]
        print(f"{hook:>10} {row['step_ms']:12.2f} {peer['step_ms']:9.2f} "
              f"{row['step_ms'] / peer['step_ms']:6.2f} {row['sent_mb']:8.2f} "
              f"{row['max_param_diff']:11.2e}")
    alone, peer = by_label["alone none"], by_label.get("gloo none")
    print(f"each rank alone, no communication: {alone['step_ms']:.2f} ms a step" + (
        f"; the lowest ratio a backend could reach against DDP over gloo: "
        f"{alone['step_ms'] / peer['step_ms']:.2f}" if peer else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["small", "large", "mlp25m"],
                        choices=sorted(WIDTHS))
    parser.add_argument("--hooks", nargs="+", default=["none", "fp16", "powersgd4"],
                        choices=["none", "fp16", "powersgd1", "powersgd4", "fsdp2"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="write the rows here (rank 0)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    link, address = interface(comm)
    master = comm.bcast(address if comm.rank == 0 else None)
    port = comm.bcast(_free_port(master) if comm.rank == 0 else None)
    # a shared store only for the gloo group beside it: the hororing backend needs none
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=link)
    hvd.init()
    dist.init_process_group("hororing")
    if comm.rank == 0:
        print(machine_line(machine_info()))
    rows = []
    with threadpool_limits(1):
        torch.set_num_threads(1)
        for model in args.models:
            mine = run_model(comm, model, args, link)
            rows += mine
            if comm.rank == 0:
                report(model, mine, comm.size, link)
                sys.stdout.flush()
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as handle:
            json.dump({"machine": machine_info(), "ranks": comm.size, "link": link,
                       "rows": rows}, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
