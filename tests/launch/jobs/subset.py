"""init(comm=[...]) with a subset of ranks; the others stay out."""
import numpy as np
from mpi4py import MPI

import hororing as hvd

world = MPI.COMM_WORLD
members = [0, 2]
if world.Get_rank() in members:
    hvd.init(comm=members)
    result = hvd.allreduce(np.array([world.Get_rank()]), op=hvd.Sum)
    print(f"world {world.Get_rank()} rank {hvd.rank()} size {hvd.size()} sum {result[0]}", flush=True)
else:
    try:
        hvd.init(comm=members)
    except ValueError as error:
        print(f"world {world.Get_rank()} refused: {error}", flush=True)
