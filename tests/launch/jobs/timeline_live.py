"""The timeline is readable while the job runs: rank 0 reads it between collectives."""
import json
import os
import time

import numpy as np

import hororing as hvd

hvd.init()
path = os.environ["HOROVOD_TIMELINE"]
for step in range(3):
    hvd.allreduce(np.arange(3, dtype=np.float32), name="test_allreduce")
    time.sleep(0.1)  # Horovod's own test waits this long, then reads the file
    if hvd.rank() == 0:
        text = open(path, encoding="utf-8").read()
        for wanted in ("allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", '"ALLREDUCE"',
                       "CYCLE_START"):
            assert wanted in text, f"step {step}: {wanted} not in the live timeline"
        # an unterminated JSON array, as the Trace Event Format allows: whole events only
        events = json.loads(text.rstrip().rstrip(",") + "]")
        spans = [event for event in events if event.get("name") == "ALLREDUCE"]
        assert len(spans) == step + 1, (step, len(spans))
    hvd.barrier()
print(f"live timeline ok rank {hvd.rank()}")
hvd.shutdown()
