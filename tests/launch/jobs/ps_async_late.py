"""Asynchronous PS where worker 1 makes its optimizer late: worker 0 waits at registration
(the servers answer once every worker has registered) and its stall warning says so."""
import time

import numpy as np

import hororing as hvd

hvd.init()
if hvd.rank() == 1:
    time.sleep(4)  # past the stall check's 1 s, several times
values = np.full(4, 10.0 + hvd.rank())
optimizer = hvd.AsyncPSOptimizer([("w", values)], lr=0.5)
np.testing.assert_array_equal(values, 10.0)  # worker 0's, on both workers
print(f"REGISTERED {hvd.rank()}", flush=True)
hvd.shutdown()
