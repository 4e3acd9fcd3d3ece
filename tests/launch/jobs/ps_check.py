"""PS mode end to end (configured by HORORING_MODE / HORORING_PS_* in the environment).

Every worker checks its allreduce results against a reference it computes itself from every
worker's regenerated inputs; with replicas_to_aggregate r below the worker count, a result
must be the reduction of some r workers' inputs. Prints "PS CHECK OK" on each worker.
"""
import itertools
import os

import numpy as np
from mpi4py import MPI

import hororing as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
world = MPI.COMM_WORLD.Get_size()
servers = os.environ.get("HORORING_PS_SERVERS", "1")
expected_size = world if servers == "colocated" else world - int(servers)
assert size == expected_size, (size, expected_size)
replicas = int(os.environ.get("HORORING_PS_REPLICAS_TO_AGGREGATE", "0")) or size
subsets = list(itertools.combinations(range(size), replicas))


def rank_input(worker, count, dtype, seed):
    values = np.random.default_rng([seed, worker, count]).integers(-50, 50, count)
    return values.astype(dtype)


def check(result, count, dtype, seed, op):
    inputs = [rank_input(worker, count, dtype, seed) for worker in range(size)]
    for subset in subsets:
        stack = np.stack([inputs[worker] for worker in subset]) if count else np.zeros((1, 0))
        if op == "sum":
            expected = stack.sum(axis=0)
        elif op == "max":
            expected = stack.max(axis=0)
        else:
            expected = stack.sum(axis=0) / len(subset)
        if np.allclose(result, expected, rtol=1e-5, atol=1e-5):
            return
    raise AssertionError(f"allreduce {op} of {count} {dtype} (seed {seed}) matches no set of "
                         f"{replicas} workers' inputs: {result[:5]}")


seed = 0
ops = {"average": hvd.Average, "sum": hvd.Sum, "max": hvd.Max}
for step in range(3):
    for count in (0, 1, 2, 7, 13, 100, 4097, 300001):
        for dtype in ("float32", "float64", "int32"):
            for op_name, op in ops.items():
                if op_name == "average" and dtype == "int32":
                    continue
                seed += 1
                result = hvd.allreduce(rank_input(rank, count, dtype, seed), op=op,
                                       name=f"t.{count}.{dtype}.{op_name}")
                check(result, count, dtype, seed, op_name)
                digests = hvd.allgather_object(result.tobytes())
                assert all(digest == digests[0] for digest in digests), "workers differ"
    # a fused group: many tensors in one bucket, placed tensor by tensor
    counts = [3, 1000, 17, 65536, 5, 250000]
    seed += 1
    tensors = [rank_input(rank, count, "float32", seed + index) for index, count in enumerate(counts)]
    results = hvd.grouped_allreduce(tensors, name="group", op=hvd.Sum)
    for index, (count, result) in enumerate(zip(counts, results)):
        check(result, count, "float32", seed + index, "sum")
    seed += len(counts)

# the rest of the API keeps working on the workers
gathered = hvd.allgather(np.full((rank + 1, 2), rank))
assert gathered.shape == (size * (size + 1) // 2, 2)
assert hvd.broadcast(np.array([rank * 10.0]), root_rank=size - 1)[0] == (size - 1) * 10.0
stats = hvd.ps_stats()
assert sum(stats["held_bytes"]) > 0 and stats["contributors"] == replicas
print(f"worker {rank} of {size}: PS CHECK OK {stats}", flush=True)
hvd.shutdown()
