"""A loop of 256 KiB allreduces (rank 0 prints 'step N' every 20), for fault tests that cut a
link or kill a host under it; it ends by itself after 10 minutes at most."""
import time

import numpy as np

import hororing as hvd

hvd.init()
data = np.ones(64 * 1024, dtype=np.float32)
deadline = time.monotonic() + 600
step = 0
while time.monotonic() < deadline:
    hvd.allreduce_(data, name="grad", op=hvd.Average)
    if step % 20 == 0 and hvd.rank() == 0:
        print(f"step {step}", flush=True)
    step += 1
