#!/usr/bin/env python
"""The host allreduce algorithms run directly, the ring with compiled and with Python steps,
beside MPI_Allreduce, in one run.

Run under MPI, e.g.  mpiexec -n 8 python scripts/bench_ring_steps.py --sizes 4KiB,64KiB,1MiB

For each size the variants take turns call by call (the order rotating), a Barrier before
each call; the time is the slowest rank's median. Variants: ``ring`` (compiled steps,
algorithms/compiled/), ``ring-python``, ``rabenseifner``, ``recursive_doubling``, ``small``
(below 256 KiB: the gathered path), ``mpi``. The cost model's prediction for each algorithm
(cost.COMPILED_RING for the compiled ring, cost.HOST for the others; one node's shared
memory; the ranks per core as its contention, where above 1) is printed beside it. Every result is checked against the expected sum.
"""

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from benchinfo import parse_size
from hororing import cores
from hororing.algorithms import compiled, cost
from hororing.algorithms.halving import Rabenseifner, RecursiveDoubling
from hororing.algorithms.ring import Ring
from hororing.algorithms.small import GatherReduce

SMALL_UP_TO = 256 * 1024
SUBCHUNK = 1 << 20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4KiB,64KiB,256KiB,1MiB,4MiB,16MiB")
    parser.add_argument("--calls", type=int, default=60, help="timed calls per size and variant")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    size, rank = comm.Get_size(), comm.Get_rank()
    compiled.configure("wait")
    compiled_ring = Ring(comm, SUBCHUNK)
    python_ring = Ring(comm, SUBCHUNK)
    variants = {
        "ring": (compiled_ring, "ring", True),
        "ring-python": (python_ring, "ring", False),
        "rabenseifner": (Rabenseifner(comm, subchunk_bytes=SUBCHUNK), "rabenseifner", False),
        "recursive_doubling": (RecursiveDoubling(comm, subchunk_bytes=SUBCHUNK),
                               "recursive_doubling", False),
        "small": (GatherReduce(comm), "small", False),
    }
    shm = cost.PRESETS["shm"]
    # ranks per core on the busiest node, as the library prices it (engine/executor.py)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    contention = max(1.0, comm.allreduce(node.Get_size() / cores.on_node(node), op=MPI.MAX))
    node.Free()
    if rank == 0:
        print(f"# {size} ranks, float32 Sum, median us of the slowest rank (model's us, "
              f"contention {contention:g})")
        print(f"{'bytes':>9} " + " ".join(f"{name:>22}" for name in list(variants) + ["mpi"]))
    for nbytes in (parse_size(text) for text in args.sizes.split(",")):
        count = nbytes // 4
        buffers = {name: np.empty(count, np.float32) for name in list(variants) + ["mpi"]}
        names = [name for name in list(variants) + ["mpi"]
                 if name != "small" or nbytes <= SMALL_UP_TO]
        times = {name: [] for name in names}
        for index in range(args.warmup + args.calls):
            order = names[index % len(names):] + names[:index % len(names)]
            for name in order:
                buffer = buffers[name]
                buffer[...] = rank + 1
                if name in ("ring", "ring-python"):
                    compiled.configure("wait" if name == "ring" else "off")
                comm.Barrier()
                started = time.perf_counter()
                if name == "mpi":
                    comm.Allreduce(MPI.IN_PLACE, buffer, MPI.SUM)
                else:
                    variants[name][0].allreduce(buffer, "sum")
                if index >= args.warmup:
                    times[name].append(time.perf_counter() - started)
        expected = size * (size + 1) / 2
        wrong = comm.allreduce(sum(int(np.count_nonzero(buffers[name] != expected))
                                   for name in names))
        if wrong:
            raise SystemExit(f"{wrong} wrong elements at {nbytes} bytes")
        cells = []
        for name in list(variants) + ["mpi"]:
            if name not in times:
                cells.append(f"{'-':>22}")
                continue
            median = comm.allreduce(statistics.median(times[name]), op=MPI.MAX) * 1e6
            if name == "mpi":
                cells.append(f"{median:>22.0f}")
                continue
            _, kind, native = variants[name]
            host = cost.COMPILED_RING if native else cost.HOST
            model = cost.predict(kind, size, nbytes, host, shm, shm, per_node=size,
                                 contention=contention) * 1e6
            cells.append(f"{median:>13.0f} ({model:>6.0f})")
        if rank == 0:
            print(f"{nbytes:>9} " + " ".join(cells), flush=True)
    compiled.configure("wait")
    if rank == 0:
        print(f"# compiled steps: {compiled.status()}; the ring ran compiled: "
              f"{compiled_ring._native is not None}, Python: {python_ring._native is None}")
    comm.Free()


if __name__ == "__main__":
    main()
