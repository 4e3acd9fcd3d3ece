#!/usr/bin/env python
"""Low-communication training against synchronous training: held-out loss, bytes on the link,
wall-clock, in one job.

    mpiexec -n 2 python scripts/bench_local_sgd.py [--steps 300 --sync-every 50]

Across emulated hosts (one rank per host, docs/local_sgd.md):

    bash scripts/emulated_hosts.sh up 2 --rate 1gbit --dir D
    mpiexec -f D/hostfile $(cat D/mpi-args) -n 2 python scripts/bench_local_sgd.py
    bash scripts/emulated_hosts.sh down --dir D

The tasks (--task): ``mlp``, an MLP student (256-1600-1600-1024-16, 4.6 M parameters) learning a fixed random
teacher network (256-256-16, tanh) from inputs each rank draws for itself (batch --batch per
rank per step), the held-out loss the mean squared error on 2048 inputs no rank trains on;
``lm``, a 2-layer causal transformer (width 128, 0.4 M parameters) predicting the next byte
of the Python standard library's source (windows of 64 bytes at offsets each rank draws for
itself), the held-out loss the cross-entropy on 256 windows of the last tenth of the text.
Every variant starts from the same weights and trains --steps steps with AdamW (lr 1e-3) as
its (inner) optimizer, one variant after the other:

- ``sync``: hvd.DistributedOptimizer (gradients averaged every step);
- ``ddp-gloo``: DistributedDataParallel over torch's gloo backend;
- ``localsgd``: hvd.LocalSGD, parameters averaged every --sync-every steps;
- ``diloco``, ``diloco-fp16``, ``diloco-int8``, ``diloco-frag4``, ``diloco-stream``:
  hvd.DiLoCo with an outer SGD (--outer-lr 0.8, --outer-momentum 0.5, Nesterov) every
  --sync-every steps; 16-bit changes; int8 changes with error feedback; four fragments; four
  fragments, 16-bit, each sync overlapping the next inner step.

LocalSGD and DiLoCo end with ``sync_now()`` after the last step (on the clock and the link's
count): every rank then holds the same model, as after synchronous training; the table says
whether the ranks' parameters agree bit for bit.

Per variant: the held-out loss at every --eval-every steps (mean over the ranks' models), the
bytes this rank's interface sent (the emulated host's link, or the loopback on one host;
summed over the ranks), the wall-clock of the whole run (a barrier before and after). The
table gives each against ``sync``'s; ``--json`` writes the rows and the curves.
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compression import interface, sent_bytes, start_gloo  # noqa: E402
from benchinfo import machine_info, machine_line  # noqa: E402

import hororing.torch as hvd  # noqa: E402
from hororing._mpi import MPI  # noqa: E402

WIDTHS = (256, 1600, 1600, 1024, 16)
VARIANTS = ("sync", "ddp-gloo", "localsgd", "diloco", "diloco-fp16", "diloco-int8",
            "diloco-frag4", "diloco-stream")


def mlp(widths, seed):
    torch.manual_seed(seed)
    layers = []
    for index, (inputs, outputs) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(inputs, outputs))
        if index + 2 < len(widths):
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


TEACHER = mlp((256, 256, 16), seed=123)
for _parameter in TEACHER.parameters():
    _parameter.requires_grad_(False)


def draw_seed(rank, step, seed):
    """A rank's batch of one step is its own (--seed moves every rank's draws)."""
    return 1_000_003 * rank + step + 1_000_000_007 * seed


def batch(rank, step, size, seed=0):
    generator = torch.Generator().manual_seed(draw_seed(rank, step, seed))
    inputs = torch.randn(size, WIDTHS[0], generator=generator)
    return inputs, TEACHER(inputs)


HELD_OUT = batch(rank=10_000, step=0, size=2048)


class CharModel(torch.nn.Module):
    """A small causal transformer over bytes (--task lm): 2 layers, width 128, 4 heads."""

    def __init__(self, width=128, layers=2, context=64, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(256, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(
            context), persistent=False)

    def forward(self, tokens):
        hidden = self.embed(tokens) + self.position[:tokens.shape[1]]
        hidden = self.body(hidden, mask=self.mask[:tokens.shape[1], :tokens.shape[1]],
                           is_causal=True)
        return self.head(hidden)


class Text:
    """The standard library's Python source as bytes: the sorted files of ``os``'s directory,
    the last tenth held out; a rank's batch is windows at offsets drawn for it alone."""

    def __init__(self, context=64):
        directory = os.path.dirname(os.__file__)
        files = sorted(name for name in os.listdir(directory) if name.endswith(".py"))
        data = b"".join(open(os.path.join(directory, name), "rb").read() for name in files)
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        cut = len(tokens) * 9 // 10
        self.train, self.held_out, self.context = tokens[:cut], tokens[cut:], context

    def windows(self, tokens, generator, count):
        starts = torch.randint(0, len(tokens) - self.context - 1, (count,), generator=generator)
        rows = torch.stack([tokens[start:start + self.context + 1] for start in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def batch(self, rank, step, size, seed):
        return self.windows(self.train,
                            torch.Generator().manual_seed(draw_seed(rank, step, seed)), size)


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))


class Task:
    """What is learned: ``mlp`` (the teacher network) or ``lm`` (bytes of Python source)."""

    def __init__(self, name, seed=0):
        self.name, self.seed = name, seed
        if name == "lm":
            self.text = Text()
            self.held = self.text.windows(self.text.held_out, torch.Generator().manual_seed(7),
                                          256)

    def model(self):
        return mlp(WIDTHS, seed=self.seed) if self.name == "mlp" else \
            CharModel(seed=self.seed)

    def batch(self, rank, step, size):
        return batch(rank, step, size, self.seed) if self.name == "mlp" else \
            self.text.batch(rank, step, size, self.seed)

    def loss(self, output, targets):
        return torch.nn.functional.mse_loss(output, targets) if self.name == "mlp" else \
            lm_loss(output, targets)

    def held_out_loss(self, model):
        inputs, targets = HELD_OUT if self.name == "mlp" else self.held
        with torch.no_grad():
            return float(self.loss(model(inputs), targets))


def build(variant, args, task):
    """(the model the rank trains, what steps it, the model to evaluate)."""
    model = task.model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if variant == "sync":
        return model, hvd.DistributedOptimizer(
            inner, named_parameters=model.named_parameters()), model
    if variant == "ddp-gloo":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-3), model
    if variant == "localsgd":
        return model, hvd.LocalSGD(model, inner, sync_every=args.sync_every), model
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                            nesterov=args.outer_momentum > 0)
    options = {"diloco": {}, "diloco-fp16": {"compression": hvd.Compression.fp16},
               "diloco-int8": {"int8": True}, "diloco-frag4": {"fragments": 4},
               "diloco-stream": {"fragments": 4, "overlap": True,
                                 "compression": hvd.Compression.fp16}}[variant]
    return model, hvd.DiLoCo(model, inner, outer, sync_every=args.sync_every, **options), model


def run(variant, args, comm, link, task):
    trained, optimizer, evaluated = build(variant, args, task)
    curve = []
    comm.Barrier()
    sent, start = sent_bytes(link), time.perf_counter()
    finish = getattr(optimizer, "synchronize", None) if variant.startswith("diloco") else None
    for step in range(args.steps):
        inputs, targets = task.batch(comm.rank, step, args.batch)
        optimizer.zero_grad()
        task.loss(trained(inputs), targets).backward()
        optimizer.step()
        if step + 1 == args.steps and hasattr(optimizer, "sync_now"):
            optimizer.sync_now()  # the ranks' consensus is the model trained (on the clock)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:  # off the clock
            if finish is not None:
                finish()
            paused = time.perf_counter()
            before = sent_bytes(link)
            loss = task.held_out_loss(evaluated)
            curve.append((step + 1, sum(comm.allgather(loss)) / comm.size))
            start += time.perf_counter() - paused
            sent += sent_bytes(link) - before
    comm.Barrier()
    seconds = time.perf_counter() - start
    sent = sent_bytes(link) - sent
    digest = hashlib.sha256()
    for parameter in evaluated.parameters():
        digest.update(parameter.detach().numpy().tobytes())
    agree = len(set(comm.allgather(digest.hexdigest()))) == 1
    total = sum(parameter.numel() for parameter in evaluated.parameters())
    shares = [sum(parameter.numel() for parameter in members) / total
              for members in getattr(optimizer, "fragments", [])]
    return {"variant": variant, "seconds": comm.allreduce(seconds, op=MPI.MAX),
            "sent_bytes": comm.allreduce(sent), "final_loss": curve[-1][1], "curve": curve,
            "ranks_agree": agree, "fragment_shares": shares}


def plot(rows, args, size, link):
    try:
        import matplotlib
    except ImportError:
        print("--plot needs matplotlib (pip install -e .[bench]); no plot written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        steps, losses = zip(*row["curve"])
        axes.plot(steps, losses, marker=".", label=f"{row['variant']} ({row['seconds']:.0f} s)")
    axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel("held-out loss")
    axes.set_title(f"{args.task}: {size} ranks over {link}, sync every {args.sync_every}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.plot, dpi=90)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("mlp", "lm"), default="mlp")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--seed", type=int, default=0,
                        help="the models' initial weights and the ranks' batches")
    parser.add_argument("--outer-lr", type=float, default=0.8, help="DiLoCo's outer SGD lr")
    parser.add_argument("--outer-momentum", type=float, default=0.5,
                        help="its (Nesterov) momentum; 0: plain SGD")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None,
                        help="a PNG of the held-out loss curves (needs matplotlib)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    hvd.init()
    link, address = interface(comm)
    if "ddp-gloo" in args.variants:
        start_gloo(comm, link, address)
    torch.set_num_threads(args.threads)
    task = Task(args.task, args.seed)
    rows = []
    with threadpool_limits(args.threads):
        for variant in args.variants:
            rows.append(run(variant, args, comm, link, task))
    if comm.rank != 0:
        return
    info = machine_info()
    print(machine_line(info))
    print(f"task {args.task}, {comm.size} ranks, link {link}, {args.steps} steps, batch {args.batch} per rank, "
          f"sync every {args.sync_every}, DiLoCo's outer lr {args.outer_lr} momentum "
          f"{args.outer_momentum}, seed {args.seed}")
    base = next((row for row in rows if row["variant"] == "sync"), rows[0])
    print(f"{'variant':14} {'held-out loss':>13} {'x sync':>7} {'MB sent':>9} {'sync/this':>9} "
          f"{'seconds':>8} {'sync/this':>9} {'ranks agree':>11}")
    for row in rows:
        ratio = (f"{base['sent_bytes'] / row['sent_bytes']:9.1f}" if row["sent_bytes"] and
                 base["sent_bytes"] else f"{'-':>9}")  # one host: hororing's bytes are not on lo
        print(f"{row['variant']:14} {row['final_loss']:13.3e} "
              f"{row['final_loss'] / base['final_loss']:7.3f} {row['sent_bytes'] / 1e6:9.2f} "
              f"{ratio} {row['seconds']:8.2f} {base['seconds'] / row['seconds']:9.2f} "
              f"{'yes' if row['ranks_agree'] else 'NO':>11}")
    for row in rows:
        if len(row["fragment_shares"]) > 1:  # what each of its syncs carries
            print(f"{row['variant']}: each fragment's share of the parameters " +
                  " ".join(f"{share:.3f}" for share in row["fragment_shares"]))
    if args.json:  # before the plot: a missing matplotlib costs no measurement
        with open(args.json, "w") as handle:
            json.dump({"machine": info, "task": args.task, "ranks": comm.size, "link": link, "rows": rows,
                       "steps": args.steps, "sync_every": args.sync_every, "seed": args.seed,
                       "batch": args.batch}, handle)
    if args.plot:
        plot(rows, args, comm.size, link)


if __name__ == "__main__":
    main()
