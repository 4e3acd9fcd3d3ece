"""The last rank is late with one tensor (or never sends it, with argv[1] == 'never').

With argv[1] == 'cached', every rank first reduces the tensor once, so the late round is
announced by cache bit, not by name.
"""
import sys
import time

import numpy as np

import hororing as hvd

hvd.init()
mode = sys.argv[1:]
if mode == ["cached"]:
    hvd.allreduce(np.ones(2), name="late.tensor", op=hvd.Sum)
late = hvd.rank() == hvd.size() - 1
if late:
    if mode == ["never"]:
        time.sleep(60)
    time.sleep(3.5)
print(f"rank {hvd.rank()} result {hvd.allreduce(np.ones(2), name='late.tensor', op=hvd.Sum)[0]}",
      flush=True)
