"""Rank 1 raises before its allreduce; the others must fail naming rank 1, not hang."""
import sys

import numpy as np

import hororing as hvd

hvd.init()
if hvd.rank() == 1:
    raise KeyError("missing batch 17")
try:
    hvd.allreduce(np.ones(4), name="grad")
except hvd.HorovodInternalError as error:
    print(f"rank {hvd.rank()} got: {error}", flush=True)
    sys.exit(3)
