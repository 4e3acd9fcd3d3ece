"""Every kind of collective once, checked, at any size; prints one line per rank, with the
compiled steps' status (a short job never asks for them) and whether ml_dtypes was imported
before the job's first bfloat16 array (hororing leaves it to that array)."""
import sys

import numpy as np

import hororing as hvd
from hororing.algorithms import compiled

hvd.init()
rank, size = hvd.rank(), hvd.size()
total = size * (size - 1) // 2
assert hvd.allreduce(np.full(1001, float(rank)), op=hvd.Sum)[0] == total
big = hvd.allreduce(np.full(300_001, float(rank), dtype=np.float32), op=hvd.Sum)
assert np.all(big == total)
handles = [hvd.allreduce_async(np.full(i + 1, rank), name=f"a{i}", op=hvd.Sum) for i in range(32)]
assert all(np.all(hvd.synchronize(h) == total) for h in handles)
assert hvd.allgather(np.array([rank])).tolist() == list(range(size))
assert hvd.broadcast(np.array([rank]), size - 1)[0] == size - 1
received, splits = hvd.alltoall(np.arange(size) + 10 * rank)
assert received.tolist() == [10 * peer + rank for peer in range(size)]
assert hvd.reducescatter(np.ones((size + 1, 2)), op=hvd.Sum).sum() == 2 * size * (2 if rank == 0 else 1)
hvd.barrier()
before = "imported" if "ml_dtypes" in sys.modules else "not imported"
# the last rank reduces bfloat16 values of its own (ml_dtypes imported by the script) while
# the others, which never had one, have joined: they add zeros of a dtype only named to them
if rank == size - 1:
    import ml_dtypes
    values = np.arange(1001, dtype=np.float32).astype(ml_dtypes.bfloat16)
    alone = hvd.allreduce(values, name="bfloat16.alone", op=hvd.Sum)
    assert alone.dtype == values.dtype and np.array_equal(alone, values)
assert hvd.join() == size - 1
print(f"smoke ok rank {rank} of {size}, compiled steps: {compiled.status()}, ml_dtypes before "
      f"bfloat16: {before}", flush=True)
