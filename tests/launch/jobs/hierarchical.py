"""Allreduce across MPICH's simulated nodes: the hierarchical path, checked against numpy."""
import os

import numpy as np

import hororing as hvd
from hororing.context import current

hvd.init()
rank, size = hvd.rank(), hvd.size()
hierarchical = current().engine.allreduce.hierarchical_stats()
# on by default across nodes (several nodes, some with several ranks); off when set to 0
chosen = os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE") != "0"
if not chosen:
    assert hierarchical is None
    print(f"rank {rank} hierarchical off", flush=True)
else:
    assert hierarchical is not None and hierarchical["nodes"] > 1, "no nodes detected"
    for count in (10, 70_001, 300_001):  # latency path, ring or hierarchical by threshold
        mine = np.random.default_rng(rank).normal(size=count)
        total = hvd.allreduce(mine, op=hvd.Sum, name=f"sum.{count}")
        expected = sum(np.random.default_rng(peer).normal(size=count) for peer in range(size))
        np.testing.assert_allclose(total, expected, rtol=1e-9, atol=1e-9)
        assert len(set(hvd.allgather_object(total.tobytes()))) == 1, "ranks differ"
    averaged = hvd.allreduce(np.full(100_003, rank, dtype=np.int64), name="int.average")
    assert (averaged == sum(range(size)) // size).all()
    hierarchical = current().engine.allreduce.hierarchical_stats()
    print(f"rank {rank} nodes {hierarchical['nodes']} local size {hierarchical['local_size']} "
          f"parts {hierarchical['parts']} cross-node bytes {hierarchical['cross_bytes_sent']}",
          flush=True)
