"""The last rank is late with one tensor (or never sends it, with argv[1] == 'never')."""
import sys
import time

import numpy as np

import hororing as hvd

hvd.init()
late = hvd.rank() == hvd.size() - 1
if late:
    if sys.argv[1:] == ["never"]:
        time.sleep(60)
    time.sleep(3.5)
print(f"rank {hvd.rank()} result {hvd.allreduce(np.ones(2), name='late.tensor', op=hvd.Sum)[0]}",
      flush=True)
