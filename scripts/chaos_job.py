#!/usr/bin/env python
"""The job bench_chaos.py runs under hororun and kills: an elastic torch job that logs each
step and each phase of its start, and writes its final parameters.

    hororun --elastic-dir D ... python scripts/chaos_job.py --dir WORK --ranks 3 --steps 600
        [--step-ms 50] [--commit-every 10] [--scenario random]

An MLP trains with DistributedOptimizer under ``hvd.elastic.run``, committing every
--commit-every steps. Each step's compute is emulated: --step-ms at --ranks, scaled by --ranks /
size (the same global batch, split among fewer ranks, takes longer), beside one real forward,
backward and gradient allreduce; under the ``collective`` scenario each step is a 16 MiB
allreduce instead. In WORK: ``pids/PID`` (launch, rank, size, local rank) for the driver to
pick victims from, ``progress`` (rank 0 appends launch, size, step, time a line per step),
``phases/PID`` (the times of this process's start, imports, init, model and state made, entry
to the training function) and, at the end, ``result.json``. A ``commit`` victim is told by
SIGUSR2 and dies inside its next commit's write.
"""

import argparse
import json
import os
import pathlib
import signal
import time

GLOBAL_BATCH = 48


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--dir", required=True, help="the driver's work directory")
    parser.add_argument("--ranks", type=int, required=True, help="the starting size")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--scenario", default="random")
    return parser.parse_args()


class Fuse:
    """Part of the state: once armed (SIGUSR2), the commit writer pickling it dies there."""

    armed = False

    def __deepcopy__(self, memo):  # the commit's save copies it; only the write pickles it
        return self

    def __reduce__(self):
        if Fuse.armed:
            os.kill(os.getpid(), signal.SIGKILL)
        return (Fuse, ())


def started_at():
    """This process's start, wall-clock (from /proc: to a clock tick)."""
    ticks = int(pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def job(args):
    began = started_at()
    import torch

    import hororing.torch as hvd

    imported = time.time()
    hvd.init()
    work = pathlib.Path(args.dir)
    initialized = time.time()
    launch = int(os.environ.get("HORORING_ELASTIC_LAUNCH", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02,
                                                         momentum=0.9),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0, fuse=Fuse())
    signal.signal(signal.SIGUSR2, lambda *_: setattr(Fuse, "armed", True))
    heavy = torch.zeros(4 << 20) if args.scenario == "collective" else None
    teacher = torch.nn.Linear(64, 8)
    torch.nn.init.normal_(teacher.weight, generator=torch.Generator().manual_seed(1))
    pid_file = work / "pids" / str(os.getpid())

    def announce():  # the driver picks its victims from these: pid -> (launch, rank, size)
        pid_file.write_text(f"{launch} {hvd.rank()} {hvd.size()} {hvd.local_rank()}\n")
    state.register_reset_callbacks([announce])
    log = open(work / "progress", "a")  # rank 0 appends a line per step, whoever it is now
    built = time.time()
    (work / "phases").mkdir(exist_ok=True)

    @hvd.elastic.run
    def train(state):
        announce()  # once training (a launch started ahead waits until it takes over)
        if not (work / "phases" / str(os.getpid())).exists():  # restored and synced
            (work / "phases" / str(os.getpid())).write_text(
                f"{launch} {began} {imported} {initialized} {built} {time.time()}\n")
        while state.step < args.steps:
            generator = torch.Generator().manual_seed(state.step)
            x = torch.randn(GLOBAL_BATCH, 64, generator=generator)
            y = teacher(x).detach()
            mine = slice(hvd.rank(), GLOBAL_BATCH, hvd.size())
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            optimizer.step()
            if heavy is not None:
                hvd.allreduce_(heavy, name="chaos.heavy")
            else:
                time.sleep(args.step_ms / 1e3 * args.ranks / hvd.size())
            state.step += 1
            if hvd.rank() == 0:
                log.write(f"{launch} {hvd.size()} {state.step} {time.time():.4f}\n")
                log.flush()
            if state.step % args.commit_every == 0 or state.step == args.steps:
                state.commit()
        return hvd.size()

    size = train(state)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    equal = all(torch.equal(gathered[0], row) for row in gathered)
    if hvd.rank() == 0:
        (work / "result.json").write_text(json.dumps({
            "step": state.step, "size": size, "launch": launch, "equal": equal,
            "params": flat.tolist()}))


if __name__ == "__main__":
    # run as the module ``chaos_job``, not ``__main__``: the commits pickle Fuse by its module,
    # and the driver, whose own ``__main__`` is bench_chaos.py, reads them back to check them
    import chaos_job
    chaos_job.job(parse())
