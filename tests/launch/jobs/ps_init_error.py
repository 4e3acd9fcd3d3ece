"""init() with PS settings from the environment; every rank reports the ValueError it got."""
from mpi4py import MPI

import hororing as hvd

try:
    hvd.init()
except ValueError as error:
    print(f"world rank {MPI.COMM_WORLD.Get_rank()} ValueError: {error}", flush=True)
else:
    print(f"world rank {MPI.COMM_WORLD.Get_rank()} initialized", flush=True)
