"""PS mode: worker 1 dies after two steps; the servers must not keep the job alive."""
import numpy as np

import hororing as hvd

hvd.init(mode="ps", num_servers=1)
for step in range(2):
    hvd.allreduce(np.ones(1000), name="grad")
if hvd.rank() == 1:
    raise KeyError("missing batch 17")
hvd.allreduce(np.ones(1000), name="grad")
