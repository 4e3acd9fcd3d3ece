"""Async allreduces with HOROVOD_TIMELINE set; rank 0 writes the trace."""
import numpy as np

import hororing as hvd

hvd.init()
handles = [hvd.allreduce_async(np.ones(1000), name=f"layer{i}.weight") for i in range(8)]
for handle in handles:
    hvd.synchronize(handle)
hvd.allgather(np.ones((1, 2)), name="gathered")
hvd.shutdown()
