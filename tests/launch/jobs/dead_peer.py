"""Rank 1 ends its process between two allreduces, under a launcher that ends nothing for it
(``mpiexec -disable-auto-cleanup``): the others, waiting on it in the next call's negotiation,
must end the job themselves, naming it (test_jobs.py)."""

import os

import numpy as np

import hororing as hvd

hvd.init()
total = hvd.allreduce(np.arange(7, dtype=np.float32), op=hvd.Sum)
assert np.array_equal(total, hvd.size() * np.arange(7, dtype=np.float32)), total
print(f"rank {hvd.rank()} pid {os.getpid()} summed", flush=True)
if hvd.rank() == 1:
    os._exit(3)
hvd.allreduce(np.ones(1000, dtype=np.float32), op=hvd.Sum)
print(f"rank {hvd.rank()} went on without rank 1", flush=True)
