#!/usr/bin/env python
"""What elastic training costs: a commit of a torch model, and the time from a kill to training.

    python scripts/bench_elastic.py [--ranks 2] [--params 10000000] [--commits 10]

Two parts, each a real job under mpiexec (the driver runs them):

commit    ``TorchState(model, optimizer).commit()`` on a model of --params float32 parameters
          with SGD momentum (so the optimizer holds as much again), median of --commits:
          in memory only (plain mpiexec, as Horovod commits), and written to disk (under
          hororun's elastic mode, local rank 0 writes; tmpfs or disk as /tmp is here). The
          save (a deep copy of the state dicts) and the write are timed apart too.
recovery  a job under ``hororun --min-np`` that commits every step and has one rank SIGKILL
          itself; the seconds from the kill to the end of the first step after the relaunch,
          split into: mpiexec noticing and ending the job, the relaunch up to the ranks'
          ``hvd.init()`` (Python, torch and MPI start), resuming from the commit, and the first
          step. Median of --kills runs.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve()


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--commits", type=int, default=10)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--role", choices=["driver", "commit", "recovery"], default="driver")
    parser.add_argument("--marks", help=argparse.SUPPRESS)
    return parser.parse_args()


def model_of(params):
    import torch

    width = 1000
    layers = max(1, params // (width * width))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def commit_job(args):
    import torch

    import hororing.torch as hvd
    from hororing.elastic import job

    hvd.init()
    model = model_of(args.params)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(4, 1000)).sum().backward()
    optimizer.step()  # the momentum buffers exist
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    times = {"commit": [], "save": [], "write": []}
    for _ in range(args.commits):
        hvd.barrier()
        start = time.perf_counter()
        state.commit()
        times["commit"].append(time.perf_counter() - start)
        start = time.perf_counter()
        state.save()
        times["save"].append(time.perf_counter() - start)
        start = time.perf_counter()
        state._persist()
        times["write"].append(time.perf_counter() - start)
    if hvd.rank() == 0:
        count = sum(p.numel() for p in model.parameters())
        print(json.dumps({"params": count, "disk": job.supervised(),
                          **{key: statistics.median(value) * 1e3
                             for key, value in times.items()}}), flush=True)


def recovery_job(args):
    start = time.time()
    import signal

    import torch

    import hororing.torch as hvd

    launch = int(os.environ["HORORING_ELASTIC_LAUNCH"])
    marks = pathlib.Path(args.marks)
    hvd.init()
    if launch == 1 and hvd.rank() == 0:
        (marks / "started").write_text(str(start))
        (marks / "initialized").write_text(str(time.time()))
    model = model_of(args.params)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    data = torch.randn(8, 1000)

    @hvd.elastic.run
    def train(state):
        if launch == 1 and hvd.rank() == 0:
            (marks / "resumed").write_text(str(time.time()))
        first = True
        while state.step < 6:
            optimizer.zero_grad()
            model(data).sum().backward()
            optimizer.step()
            if launch == 0 and state.step == 3 and hvd.rank() == hvd.size() - 1:
                (marks / "killed").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            state.step += 1
            state.commit()
            if first and launch == 1 and hvd.rank() == 0:
                (marks / "stepped").write_text(str(time.time()))
            first = False

    train(state)


def driver(args):
    sys.path.insert(0, str(HERE.parent))
    from benchinfo import machine_info

    bin_dir = pathlib.Path(sys.executable).parent
    mpiexec = str(bin_dir / "mpiexec")
    info = machine_info()
    print(f"# {time.strftime('%Y-%m-%d')} {info['host']}: {info['cpu']}, {info['cores']} cores, "
          f"{info['mpi']}; {args.ranks} ranks")
    rows = []
    base = [sys.executable, str(HERE), "--params", str(args.params), "--commits",
            str(args.commits)]
    rows.append(_json(subprocess.run([mpiexec, "-n", str(args.ranks), *base, "--role", "commit"],
                                     capture_output=True, text=True, timeout=600)))
    with tempfile.TemporaryDirectory() as elastic_dir:
        rows.append(_json(subprocess.run(
            [sys.executable, "-m", "hororing.launcher", "-np", str(args.ranks), "--min-np",
             str(args.ranks), "--elastic-dir", elastic_dir, *base, "--role", "commit"],
            capture_output=True, text=True, timeout=600)))
    print(f"commit of {rows[0]['params'] / 1e6:.1f} M parameters + SGD momentum "
          f"(medians of {args.commits}):")
    print(f"{'where':<12}{'commit ms':>12}{'save ms':>10}{'write ms':>10}")
    for row in rows:
        where = "disk" if row["disk"] else "memory"
        write = f"{row['write']:10.1f}" if row["disk"] else f"{'-':>10}"
        print(f"{where:<12}{row['commit']:12.1f}{row['save']:10.1f}{write}")

    spans = []
    for _ in range(args.kills):
        with tempfile.TemporaryDirectory() as marks:
            finished = subprocess.run(
                [sys.executable, "-m", "hororing.launcher", "-np", str(args.ranks), "--min-np",
                 str(args.ranks), sys.executable, str(HERE), "--params", str(args.params),
                 "--role", "recovery", "--marks", marks], capture_output=True, text=True,
                timeout=600)
            if finished.returncode != 0:
                sys.exit(f"recovery job failed:\n{finished.stderr[-3000:]}")
            mark = {name: float((pathlib.Path(marks) / name).read_text())
                    for name in ("killed", "started", "initialized", "resumed", "stepped")}
            spans.append(mark)
    def median(first, last):
        return statistics.median(span[last] - span[first] for span in spans)
    print(f"\nfrom a SIGKILL to training again ({args.ranks} ranks, medians of {args.kills}):")
    for label, first, last in [("job ended and relaunched, up to the ranks' start", "killed",
                                "started"),
                               ("Python, torch, hororing imported; hvd.init()", "started",
                                "initialized"),
                               ("model built; resumed from the commit", "initialized",
                                "resumed"),
                               ("first step and commit", "resumed", "stepped"),
                               ("total", "killed", "stepped")]:
        print(f"  {label:<52}{median(first, last):8.2f} s")


def _json(finished):
    if finished.returncode != 0:
        sys.exit(f"job failed:\n{finished.stderr[-3000:]}")
    return next(json.loads(line) for line in finished.stdout.splitlines()
                if line.startswith("{"))


if __name__ == "__main__":
    arguments = parse()
    {"driver": driver, "commit": commit_job, "recovery": recovery_job}[arguments.role](arguments)
