#!/usr/bin/env python
"""Training steps with gradient compression: hororing's comm hooks beside DDP's, interleaved.

    mpiexec -n N python scripts/bench_compression.py [--models large train] [--rounds 3]

Run it with one rank per emulated host to measure a slow link (docs/compression.md):

    bash scripts/emulated_hosts.sh up 4 --rate 1gbit --dir D
    mpiexec -f D/hostfile $(cat D/mpi-args) -n 4 python scripts/bench_compression.py
    bash scripts/emulated_hosts.sh down --dir D

Variants, each its own copy of the model from the same weights, timed in turn (the order
rotates between rounds): hororing's DistributedOptimizer with comm_hook none (its own
allreduce), fp16, bf16, powersgd rank 1 and 4; DDP over gloo with its allreduce (no hook),
fp16_compress_hook, bf16_compress_hook, and powerSGD_hook rank 1 and 4 (in one bucket: with
DDP's default 25 MB buckets it hangs over gloo, see ddp_variant); and "alone": each rank
trains its copy without reducing anything, the step's compute by itself under the same
conditions (what no compression can take off the step). PowerSGD starts after 2
plain steps (DDP's least with error feedback); the warm-up steps are not timed.
A variant DDP refuses or that fails is reported with its error and left out.

Each step is forward, backward and an SGD step on this rank's batch; a round's step time is
the slowest rank's, and the table gives the median over every timed step of every round.
CPU ms: the CPU time a rank's process (every thread) used in a step, the mean over ranks (on
emulated hosts sharing a machine's cores, what one rank uses is taken from the others).
Bytes: what this rank's network interface sent per step (/sys/class/net/IF/statistics), the
interface being the emulated host's link (in its namespace); on one host (loopback,
shared by the ranks) the column shows the loopback's total per rank.

With ``--device cuda`` every variant trains on the GPU (rank r on GPU r % count); DDP's
gloo reduces the CUDA gradients through host memory, hororing's by its device transport
(HORORING_DEVICE_RING).

Models: ``large``, an MLP 1024-4096-4096-1024-10 (25.2 M float32 parameters, 101 MB of
gradients) on random data, batch 16; ``train``, examples/train.py's MLP (17 K parameters)
on scikit-learn's digits, batch 32.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchinfo import machine_info, machine_line  # noqa: E402

import hororing.torch as hvd  # noqa: E402
from hororing._mpi import MPI  # noqa: E402

HOROVOD_VARIANTS = ["none", "fp16", "bf16", "powersgd1", "powersgd4"]
DDP_VARIANTS = ["allreduce", "fp16", "bf16", "powersgd1", "powersgd4"]
POWERSGD_START = 2
# hororing's variant -> DDP's matching one
PEERS = {"none": "allreduce", "fp16": "fp16", "bf16": "bf16", "powersgd1": "powersgd1",
         "powersgd4": "powersgd4"}


ALONE = "alone"  # no reduction: the compute floor


def known_variants():
    return [f"hororing {kind}" for kind in HOROVOD_VARIANTS] + \
        [f"ddp {kind}" for kind in DDP_VARIANTS] + [ALONE]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--models", nargs="+", default=["large", "train"],
                        choices=["large", "train"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant a round")
    parser.add_argument("--variants", nargs="+",
                        help="only these (e.g. 'hororing none' 'ddp fp16'; default: all)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the models train (cuda: each rank on GPU local_rank %% "
                             "count; DDP over gloo then reduces CUDA tensors)")
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()
    unknown = sorted(set(args.variants or ()) - set(known_variants()))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(map(repr, unknown))}; the variants are "
                     f"{', '.join(map(repr, known_variants()))}")
    return args


def build(model):
    torch.manual_seed(0)
    if model == "large":
        widths = (1024, 4096, 4096, 1024, 10)
    else:
        widths = (64, 128, 64, 10)
    layers = []
    for index, (inputs, outputs) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(inputs, outputs))
        if index + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def batches(model, rank):
    """An endless stream of this rank's batches."""
    generator = torch.Generator().manual_seed(1000 + rank)
    if model == "large":
        while True:
            yield torch.randn(16, 1024, generator=generator), \
                torch.randint(0, 10, (16,), generator=generator)
    from sklearn.datasets import load_digits

    digits = load_digits()
    features = torch.from_numpy((digits.data / 16.0).astype(np.float32))[rank::hvd.size()]
    labels = torch.from_numpy(digits.target)[rank::hvd.size()]
    while True:
        order = torch.randperm(len(features), generator=generator)
        for start in range(0, len(order) - 31, 32):
            picked = order[start:start + 32]
            yield features[picked], labels[picked]


# ---- the network this rank sends on --------------------------------------------------------

def interface(comm):
    """The link this rank's bytes leave by, and its IPv4 address: where the ranks are on
    different hosts, this host's one interface besides the loopback (an emulated host's
    link), else the loopback."""
    if len(set(comm.allgather(socket.gethostname()))) > 1:
        lines = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True,
                               text=True).stdout.splitlines()
        for fields in (line.split() for line in lines):
            if fields[1] != "lo" and "inet" in fields:
                return fields[1], fields[fields.index("inet") + 1].split("/")[0]
    return "lo", "127.0.0.1"


def sent_bytes(name):
    with open(f"/sys/class/net/{name}/statistics/tx_bytes") as handle:
        return int(handle.read())


def start_gloo(comm, name, address):
    import torch.distributed as dist

    master = comm.bcast(address if comm.rank == 0 else None)
    port = comm.bcast(_free_port(master) if comm.rank == 0 else None)
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=name)
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)


def _free_port(address):
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


# ---- the variants ---------------------------------------------------------------------------

class Variant:
    """One model copy and how its gradients are reduced; ``step(batch)`` trains one step."""

    def __init__(self, label, model, make, device="cpu"):
        self.label = label
        self.model = build(model).to(device)
        self.device = device
        self.error = None
        self.times = []
        self.bytes = []
        self.cpu = []
        try:
            self.forward, self.optimizer = make(self.model)
        except Exception as error:  # a hook DDP refuses on this machine: reported, left out
            self.error = f"{type(error).__name__}: {str(error).splitlines()[0]}"

    def step(self, inputs, labels):
        """One step; on a GPU it returns once the step's kernels have run."""
        self.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.forward(inputs), labels)
        loss.backward()
        self.optimizer.step()
        if self.device == "cuda":
            torch.cuda.synchronize()


def hororing_variant(kind):
    def make(model):
        hook = {"none": None, "fp16": hvd.comm_hooks.fp16, "bf16": hvd.comm_hooks.bf16,
                "powersgd1": hvd.comm_hooks.powersgd(rank=1, start_iter=POWERSGD_START),
                "powersgd4": hvd.comm_hooks.powersgd(rank=4, start_iter=POWERSGD_START)}[kind]
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                             model.named_parameters(), comm_hook=hook)
        return model, optimizer
    return make


def ddp_variant(kind):
    def make(model):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        # powerSGD_hook over gloo waits for its P allreduce inside a callback of the previous
        # allreduce's future; with several buckets in flight that never returns (measured:
        # the large model hangs at the first PowerSGD step with DDP's 25 MB buckets, runs
        # with one bucket): PowerSGD gets one bucket for the whole model
        cap = 1024 if kind.startswith("powersgd") else 25
        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=cap)
        if kind == "fp16":
            wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif kind == "bf16":
            wrapped.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif kind.startswith("powersgd"):
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=int(kind[-1]),
                start_powerSGD_iter=POWERSGD_START, min_compression_rate=2,
                use_error_feedback=True, warm_start=True)
            wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return wrapped, torch.optim.SGD(model.parameters(), lr=0.01)
    return make


def alone_variant(model):
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def say(comm, line):
    """Progress on rank 0's stderr."""
    if comm.rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def agreed(comm, ok):
    """Whether every rank's ``ok`` holds (a variant fails on all ranks or none)."""
    return comm.allreduce(bool(ok), op=MPI.LAND)


def run_model(comm, model, args, link):
    wanted = [(f"hororing {kind}", hororing_variant(kind)) for kind in HOROVOD_VARIANTS] + \
        [(f"ddp {kind}", ddp_variant(kind)) for kind in DDP_VARIANTS] + \
        [(ALONE, alone_variant)]
    variants = [Variant(label, model, make, args.device) for label, make in wanted
                if args.variants is None or label in args.variants]
    say(comm, f"{model}: {len(variants)} variants built")
    for variant in variants:  # refused on one rank is refused everywhere
        if not agreed(comm, variant.error is None) and variant.error is None:
            variant.error = "refused on another rank"
    stream = batches(model, comm.rank)
    data = [tuple(tensor.to(args.device) for tensor in next(stream))
            for _ in range(POWERSGD_START + 1 + args.rounds * args.steps)]
    live = [variant for variant in variants if variant.error is None]
    for variant in list(live):  # warm-up: the plain steps before PowerSGD, then one more
        try:
            for inputs, labels in data[:POWERSGD_START + 1]:
                variant.step(inputs, labels)
            failed = None
        except Exception as error:
            failed = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        if not agreed(comm, failed is None):
            variant.error = failed or "failed on another rank"
            live.remove(variant)
        say(comm, f"{variant.label}: warmed up{'' if variant.error is None else ', failed'}")
    offset = POWERSGD_START + 1
    for round_index in range(args.rounds):
        turn = round_index % len(live)
        for variant in live[turn:] + live[:turn]:
            for inputs, labels in data[offset + round_index * args.steps:
                                       offset + (round_index + 1) * args.steps]:
                comm.Barrier()
                before = sent_bytes(link)
                cpu_before = time.process_time()
                started = time.perf_counter()
                variant.step(inputs, labels)
                elapsed = time.perf_counter() - started
                variant.cpu.append(comm.allreduce(time.process_time() - cpu_before) / comm.size)
                variant.bytes.append(sent_bytes(link) - before)
                variant.times.append(comm.allreduce(elapsed, op=MPI.MAX))
    rows = []
    for variant in variants:
        row = {"variant": variant.label, "error": variant.error}
        if variant.times:
            row["step_ms"] = 1e3 * statistics.median(variant.times)
            row["sent_mb"] = statistics.median(variant.bytes) / 1e6
            row["cpu_ms"] = 1e3 * statistics.median(variant.cpu)
            if link == "lo":  # every rank sends on the one loopback
                row["sent_mb"] /= comm.size
        rows.append(row)
    return rows


def report(model, rows, size, link):
    by_label = {row["variant"]: row for row in rows}
    print(f"\n## {model}: {size} ranks, link {link}")
    print(f"{'variant':>20} {'step ms':>9} {'MB sent':>9} {'/ none':>7} {'/ DDP':>7} "
          f"{'CPU ms':>8}")
    for row in rows:
        if row.get("error"):
            print(f"{row['variant']:>20}  not run: {row['error']}")
            continue
        framework, kind = (row["variant"].split(" ") if row["variant"] != ALONE
                           else ("hororing", None))
        base = by_label.get("hororing none" if framework == "hororing" else "ddp allreduce", {})
        ratio = row["step_ms"] / base["step_ms"] if base.get("step_ms") else float("nan")
        peer = by_label.get(f"ddp {PEERS[kind]}") if kind in PEERS and \
            framework == "hororing" else None
        versus = row["step_ms"] / peer["step_ms"] if peer and peer.get("step_ms") else None
        print(f"{row['variant']:>20} {row['step_ms']:9.1f} {row['sent_mb']:9.2f} "
              f"{ratio:7.2f} {'' if versus is None else f'{versus:7.2f}':>7} "
              f"{row['cpu_ms']:8.1f}")


def hvd_transport():
    """How hororing's device buckets travel in this job (direct, cuda-aware, staged)."""
    from hororing.context import current

    return current().engine.allreduce.device_transport()


def main():
    args = parse_args()
    # the ranks share this machine's cores: one thread each for torch and for numpy's BLAS
    # (hororing's PowerSGD multiplies with it; on emulated hosts every rank is alone on its
    # "node", so hororing's own per-node share would leave it a thread per core)
    torch.set_num_threads(1)
    threadpool_limits(limits=1, user_api="blas")
    hvd.init()
    if args.device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    comm = MPI.COMM_WORLD
    link, address = interface(comm)
    start_gloo(comm, link, address)
    results = {"ranks": comm.size, "link": link, "machine": machine_info(), "models": {},
               "device": args.device}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
        results["device_transport"] = hvd_transport()
    if comm.rank == 0:
        print(machine_line(results["machine"]))
        if args.device == "cuda":
            print(f"models on {results['gpu']}; hororing's device buckets travel "
                  f"{results['device_transport']}")
    for model in args.models:
        rows = run_model(comm, model, args, link)
        results["models"][model] = rows
        if comm.rank == 0:
            report(model, rows, comm.size, link)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    import torch.distributed as dist

    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
