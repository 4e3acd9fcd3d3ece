"""The last rank freezes (SIGSTOP) in the middle of a loop of large allreduces: its peers wait
inside a collective, where no rank is missing from the negotiation, as when a link or a host
fails. The stall watchdog must name the collective and the ranks and hosts waited on."""
import os
import signal
import threading

import numpy as np

import hororing as hvd

hvd.init()
if hvd.rank() == hvd.size() - 1:
    threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGSTOP)).start()
data = np.ones(4 * 1024 * 1024, dtype=np.float32)  # 16 MiB: the ring
for step in range(100000):
    hvd.allreduce_(data, name="big.tensor", op=hvd.Average)
