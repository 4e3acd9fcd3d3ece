#!/usr/bin/env python
"""What one blocking allreduce costs against MPI_Allreduce, and how many Python calls it makes.

Run under MPI, e.g.  mpiexec -n 2 python scripts/bench_call_cost.py --sizes 4KiB,64KiB,1MiB

For each size, ``hvd.allreduce_`` (Sum, float32, numpy; with ``--api numpy-out``, the
out-of-place ``hvd.allreduce``; with ``--api torch``, the torch binding's ``hvd.allreduce``
of a tensor that needs no gradient, also out of place; ``--api torch-inplace``, its
``hvd.allreduce_``), each call named (``--unnamed``:
without a name, as most training scripts call it) and ``MPI_Allreduce`` on a
buffer of the same size take turns, a Barrier before every call; the time is the slowest rank's median.
``--op average``: hororing's Average (the verbs' default op), against MPI_Allreduce's sum
divided by the size in numpy, as an MPI program averages. ``--mpi-out-of-place``: MPI's side
reduces into a second buffer, as the out-of-place APIs do (by default it reduces in place).
``--tensors K``: K tensors of the size take turns, a call on each in turn (each its own
buffer and name on both sides), as a loop that reduces a loss and its metrics calls;
``--shrink D``: tensor k of them holds the size's values divided by D**k (at least one: a
loss and its metrics are seldom one size), the times the median over all of them.
``--cpu``: also the CPU time one call of each side takes on every rank, summed over the
ranks (the mean over calls of each process's CPU clock, every thread of it: the engine's
thread, and a wait that spins or yields, count), and that sum over the side's time (the
slowest rank's median) as the cores it kept busy: where it reaches the machine's cores,
the calls are bound by the CPU work they do, not by waiting.
Then the Python function calls one steady-state call makes in the calling thread (median
over calls, a wait for the peers counted as one; the engine's background thread is not
counted). With PYTHONPATH pointing at
another checkout of hororing the same script measures that one, so two versions can be
run one after the other, alternated, on the same machine.
"""

import argparse
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import hororing as hvd
from benchinfo import parse_size

COMM = MPI.COMM_WORLD


def main():
    args = parse_args()
    hvd.init()
    rows = []
    for nbytes in args.sizes:
        count = nbytes // 4
        op = hvd.Average if args.op == "average" else hvd.Sum
        make = {"numpy": numpy_call, "numpy-out": numpy_out_call, "torch": torch_call,
                "torch-inplace": torch_inplace_call}[args.api]
        # --tensors K: K buffers (and names) on each side, one call on each in turn
        counts = [max(1, count // args.shrink ** k) for k in range(args.tensors)]
        ours = [np.ones(each, np.float32) for each in counts]
        theirs = [np.ones(each, np.float32) for each in counts]
        libraries = [make(buffer, None if args.unnamed else f"cost.{args.api}.{nbytes}.{k}",
                          op) for k, buffer in enumerate(ours)]
        divisor = np.float32(COMM.Get_size())

        def mpi_on(buffer):
            # MPI's input out of place (never changed)
            source = np.ones_like(buffer) if args.mpi_out_of_place else MPI.IN_PLACE

            def mpi():
                COMM.Allreduce(source, buffer, MPI.SUM)
                if op == hvd.Average:
                    np.divide(buffer, divisor, out=buffer)
            return mpi
        mpis = [mpi_on(buffer) for buffer in theirs]
        times = {"hororing": [], "mpi": []}
        cpu = {"hororing": [], "mpi": []}  # --cpu: each call's process CPU time
        for index in range(args.warmup + args.calls):
            k = index % args.tensors
            order = (("hororing", libraries[k], ours[k]), ("mpi", mpis[k], theirs[k]))
            for name, run, buffer in (order if index % 2 else order[::-1]):
                buffer[...] = 1.0
                COMM.Barrier()
                started_cpu = time.process_time() if args.cpu else 0.0
                started = time.perf_counter()
                run()
                if index >= args.warmup:
                    times[name].append(time.perf_counter() - started)
                    if args.cpu:
                        cpu[name].append(time.process_time() - started_cpu)
        expected = 1.0 if op == hvd.Average else float(COMM.Get_size())
        results = ours if args.api in ("numpy", "torch-inplace") else \
            [np.asarray(library.result) for library in libraries]
        wrong = sum(int(np.count_nonzero(result != expected)) for result in results + theirs)
        median = {name: COMM.allreduce(statistics.median(values), op=MPI.MAX)
                  for name, values in times.items()}
        cpu_sum = {name: COMM.allreduce(statistics.mean(values), op=MPI.SUM)
                   for name, values in cpu.items() if values}
        calls = python_calls(libraries, ours)
        rows.append((nbytes, median["hororing"], median["mpi"], calls,
                     COMM.allreduce(wrong), cpu_sum))
    if hvd.rank() == 0:
        unnamed = ", unnamed calls" if args.unnamed else ""
        placement = "out of place" if args.mpi_out_of_place else "in place"
        turns = f", {args.tensors} tensors in turn" if args.tensors > 1 else ""
        if args.tensors > 1 and args.shrink > 1:
            turns += f", each 1/{args.shrink} of the one before (bytes: the first's)"
        print(f"# {COMM.Get_size()} ranks, the {args.api} API, {args.op}{unnamed}{turns}, MPI "
              f"{placement}; hororing from "
              f"{hvd.__file__}")
        cpu_heads = f" {'hororing CPU us':>16} {'cores':>6} {'MPI CPU us':>11} {'cores':>6}" \
            if args.cpu else ""
        print(f"{'bytes':>9} {'hororing us':>12} {'MPI us':>8} {'MPI/hororing':>13} "
              f"{'Python calls':>13}" + cpu_heads)
        for nbytes, ours_s, mpi_s, calls, wrong, cpu_sum in rows:
            cpu_cells = ""
            if cpu_sum:  # CPU of every rank, and the cores it kept busy over the wall time
                cpu_cells = (f" {cpu_sum['hororing'] * 1e6:>16.1f} "
                             f"{cpu_sum['hororing'] / ours_s:>6.2f} "
                             f"{cpu_sum['mpi'] * 1e6:>11.1f} {cpu_sum['mpi'] / mpi_s:>6.2f}")
            print(f"{nbytes:>9} {ours_s * 1e6:>12.1f} {mpi_s * 1e6:>8.1f} {mpi_s / ours_s:>13.2f} "
                  f"{calls:>13.0f}" + cpu_cells + (f"  WRONG {wrong}" if wrong else ""))
    hvd.shutdown()
    return 1 if any(row[4] for row in rows) else 0


def numpy_call(ours, name, op):
    def library():
        hvd.allreduce_(ours, op=op, name=name)
    return library


def numpy_out_call(ours, name, op):
    """The out-of-place allreduce of ``ours``; the last result is kept for the check."""
    def library():
        library.result = hvd.allreduce(ours, op=op, name=name)
    library.result = None
    return library


def torch_call(ours, name, op):
    """The torch binding's blocking allreduce of a tensor over ``ours`` (the input, reset to
    ones before each call); the last result is kept for the check."""
    import torch

    import hororing.torch as hvd_torch
    tensor = torch.from_numpy(ours)

    def library():
        library.result = hvd_torch.allreduce(tensor, op=op, name=name)
    library.result = None
    return library


def torch_inplace_call(ours, name, op):
    """The torch binding's in-place blocking allreduce of a tensor over ``ours``."""
    import torch

    import hororing.torch as hvd_torch
    tensor = torch.from_numpy(ours)

    def library():
        hvd_torch.allreduce_(tensor, op=op, name=name)
    return library


def python_calls(calls, buffers, repeats=40):
    """The median count of Python function calls one of ``calls`` (each on its buffer, in
    turn) makes in this thread, counted by ``calls_made``."""
    counts = []
    for index in range(repeats):
        call, buffer = calls[index % len(calls)], buffers[index % len(calls)]
        buffer[...] = 1.0
        counts.append(calls_made(call) - 1)  # the call() wrapper itself
    return statistics.median(counts)


def calls_made(call):
    """The Python function calls ``call()`` makes in this thread, itself included, a wait
    for the peers counted as one call however long it lasts: what the wait calls depends on
    when the peers arrive (the wake-up it sends after its spin phase, its registration with
    the stall watchdog once it sleeps), which depends on the machine's load, not on the path.
    tests/mpi/test_call_budget.py counts with it too."""
    from hororing import transport
    waiting_code = getattr(getattr(transport, "wait_until", None), "__code__", None)
    count = 0
    waiting = 0  # depth of wait frames being run

    def profile(frame, event, arg):
        nonlocal count, waiting
        if event == "call":
            if not waiting:
                count += 1
            if frame.f_code is waiting_code:
                waiting += 1
        elif event == "return" and frame.f_code is waiting_code:
            waiting -= 1
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda text: [parse_size(part) for part in text.split(",")],
                        default=[4096, 65536, 1 << 20])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per size and side")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--api", choices=["numpy", "numpy-out", "torch", "torch-inplace"],
                        default="numpy")
    parser.add_argument("--mpi-out-of-place", action="store_true",
                        help="MPI's side reduces into a second buffer, not in place")
    parser.add_argument("--op", choices=["sum", "average"], default="sum")
    parser.add_argument("--tensors", type=int, default=1,
                        help="calls on this many tensors in turn, each its own buffer and "
                             "name (a loss and its metrics), on both sides")
    parser.add_argument("--shrink", type=int, default=1,
                        help="with --tensors: each tensor holds 1/SHRINK of the values of the "
                             "one before it (at least one)")
    parser.add_argument("--cpu", action="store_true",
                        help="also each side's CPU time a call, summed over the ranks, and the "
                             "cores it kept busy")
    parser.add_argument("--unnamed", action="store_true",
                        help="calls without a name (each size's loop then shares one name)")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
