"""Asynchronous PS: exact arithmetic checks (numpy), run as workers + dedicated servers.

1. Every worker starts from worker 0's values, whatever it passed in, even where it makes its
   optimizer after the others have started pushing (the last worker arrives late).
2. With one worker, async SGD with momentum equals SGD with momentum computed locally, and
   every update is fresh (staleness 0).
3. With several workers, plain SGD on a constant gradient ends at init - lr * (all updates)
   * g, exactly, whatever order the servers saw the pushes in.
"""
import sys
import time

import numpy as np

import hororing as hvd

hvd.init()
rank, workers = hvd.rank(), hvd.size()
lr, steps = 0.5, 8
weights = np.full((3, 5), 100.0 + rank)   # only worker 0's values count
bias = np.arange(7.0) + rank
momentum = 0.9 if workers == 1 else 0.0
if workers > 1 and rank == workers - 1:
    time.sleep(0.5)  # the others would have pushed every step by now, were they not held
try:
    optimizer = hvd.AsyncPSOptimizer([("w", weights), ("b", bias)], lr=lr, momentum=momentum)
except ValueError as error:
    # one write per rank, so the lines of the ranks cannot interleave in mpiexec's stream
    sys.stdout.write(f"REFUSED on rank {rank}: {error}\n")
    sys.stdout.flush()
    sys.exit(3)
np.testing.assert_array_equal(weights, 100.0)
np.testing.assert_array_equal(bias, np.arange(7.0))

if workers == 1:
    expected_w, expected_b = weights.copy(), bias.copy()
    velocity_w, velocity_b = np.zeros_like(weights), np.zeros_like(bias)
    for step in range(steps):
        grad_w, grad_b = weights * 0.01 + step, np.sin(bias + step)
        # the same update computed here, then done by the servers
        velocity_w = momentum * velocity_w + (expected_w * 0.01 + step)
        velocity_b = momentum * velocity_b + np.sin(expected_b + step)
        expected_w, expected_b = expected_w - lr * velocity_w, expected_b - lr * velocity_b
        optimizer.step({"w": grad_w, "b": grad_b})
        np.testing.assert_allclose(weights, expected_w, rtol=1e-13)
        np.testing.assert_allclose(bias, expected_b, rtol=1e-13)
    assert optimizer.staleness() == {"updates": steps, "mean": 0.0, "max": 0}
else:
    for _ in range(steps):
        optimizer.step([np.ones((3, 5)), np.ones(7)])
    hvd.barrier()                                               # every worker has pushed
    optimizer.step([np.zeros((3, 5)), np.zeros(7)])             # pull the final values
    total = workers * steps
    np.testing.assert_array_equal(weights, 100.0 - lr * total)
    np.testing.assert_array_equal(bias, np.arange(7.0) - lr * total)
    stale = optimizer.staleness()
    assert stale["updates"] == steps + 1 and 0 <= stale["max"] <= total, stale
print(f"ASYNC OK {rank} staleness {optimizer.staleness()}", flush=True)
hvd.shutdown()
