#!/usr/bin/env python
"""The Python function calls of one DistributedOptimizer training step, and its time.

Run under MPI, e.g.  mpiexec -n 2 python scripts/bench_optimizer_calls.py

One step is ``zero_grad()``, forward, backward and ``step()`` on an MLP 64-1024-1024-1024-10
(2.2 M parameters, as bench_training.py's ``large``), each rank on its own batch, for the
torch optimizer (plain and ``sharded=1``/``2``) and the numpy one (``hororing.optim`` over the
same layer sizes, gradients written by hand). The calls are counted in the calling thread
(autograd runs a CPU backward's hooks there; the engine's background thread is not
counted), the median over steps, all of them and those in the optimizer wing alone (outside
the engine, the algorithms and transport, where the count depends on how long the peers
take); the time is the slowest rank's median step. With
PYTHONPATH pointing at another checkout the same script measures that one, so two versions
can be run one after the other on the same machine. Every variant's parameters are checked
equal on every rank at the end.
"""

import argparse
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import benchinfo  # noqa: F401  (the steady state: the compiled steps load at the first ring)

LAYERS = (64, 1024, 1024, 1024, 10)


def main():
    args = parse_args()
    import torch

    import hororing.torch as hvd
    from hororing import optim
    hvd.init()
    torch.manual_seed(0)
    rows = []
    for variant in args.variants:
        if variant == "numpy":
            step, check = numpy_variant(optim, hvd.rank())
        else:
            step, check = torch_variant(torch, hvd, variant)
        for _ in range(args.warmup):
            step()
        calls, own, times = [], [], []
        for _ in range(args.steps):
            MPI.COMM_WORLD.Barrier()
            started = time.perf_counter()
            total, wing = counted(step)
            times.append(time.perf_counter() - started)
            calls.append(total)
            own.append(wing)
        seconds = MPI.COMM_WORLD.allreduce(statistics.median(times), op=MPI.MAX)
        rows.append((variant, statistics.median(calls), statistics.median(own), seconds,
                     check()))
    if hvd.rank() == 0:
        print(f"# {MPI.COMM_WORLD.Get_size()} ranks; hororing from {hvd.__file__}")
        print(f"{'variant':>10} {'Python calls/step':>18} {'in the wing':>12} "
              f"{'ms/step (counted)':>18} {'equal':>6}")
        for variant, calls, wing, seconds, equal in rows:
            print(f"{variant:>10} {calls:>18.0f} {wing:>12.0f} {seconds * 1e3:>18.1f} "
                  f"{str(equal):>6}")
    return 0 if all(row[4] for row in rows) else 1


# where a step waits for its peers: how often it polls there depends on their timing
_WAITING = ("/hororing/engine/", "/hororing/algorithms/", "/hororing/transport.py")


def counted(step):
    """(every Python call ``step()`` makes in this thread, those outside the engine, the
    algorithms and transport: the optimizer wing's own, which no waiting changes)."""
    total = own = 0

    def profile(frame, event, arg):
        nonlocal total, own
        if event == "call":
            total += 1
            path = frame.f_code.co_filename
            own += "/hororing/" in path and not any(part in path for part in _WAITING)
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return total, own


def torch_variant(torch, hvd, variant):
    layers = []
    for inputs, outputs in zip(LAYERS, LAYERS[1:]):
        layers += [torch.nn.Linear(inputs, outputs), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sharded = {"plain": False, "sharded1": 1, "sharded2": 2}[variant]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         model.named_parameters(), sharded=sharded)
    generator = torch.Generator().manual_seed(hvd.rank())
    inputs, labels = torch.randn(32, 64, generator=generator), torch.randint(10, (32,),
                                                                             generator=generator)

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    def check():
        flat = torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])
        return equal_everywhere(flat.numpy())
    return step, check


def numpy_variant(optim, rank):
    rng = np.random.default_rng(0)
    params = {}
    for index, (inputs, outputs) in enumerate(zip(LAYERS, LAYERS[1:])):
        params[f"w{index}"] = rng.standard_normal((inputs, outputs)).astype(np.float32) * 0.01
        params[f"b{index}"] = np.zeros(outputs, np.float32)
    optimizer = optim.DistributedOptimizer(optim.SGD(params, lr=0.01))
    grads = np.random.default_rng(rank + 1)
    fresh = {name: grads.standard_normal(value.shape).astype(np.float32)
             for name, value in params.items()}

    def step():
        for name in reversed(list(params)):  # back to front, as a backward pass
            optimizer.grads[name][...] = fresh[name]
            optimizer.grad_ready(name)
        optimizer.step()

    def check():
        return equal_everywhere(np.concatenate([value.reshape(-1) for value in params.values()]))
    return step, check


def equal_everywhere(flat):
    mine = np.ascontiguousarray(flat, dtype=np.float64)
    first = mine.copy()
    MPI.COMM_WORLD.Bcast(first, root=0)
    return bool(MPI.COMM_WORLD.allreduce(int(np.array_equal(mine, first)), op=MPI.MIN))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["plain", "sharded1", "sharded2", "numpy"],
                        choices=["plain", "sharded1", "sharded2", "numpy"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
