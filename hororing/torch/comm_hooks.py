"""Gradient communication hooks for ``hvd.DistributedOptimizer`` (``comm_hook=``, or
``optimizer.register_comm_hook(state, hook)``), as DDP's ``register_comm_hook``.

The hooks of ``hororing.comm_hooks``, handed torch buckets: ``allreduce`` (what the optimizer
does without a hook), ``fp16`` and ``bf16`` (16 bits on the wire, each hop's sum in float32)
and ``powersgd(rank=, start_iter=, min_compression_rate=, use_error_feedback=, warm_start=)``
(float32 and float64 gradients, CPU or CUDA). A hook of your own is ``hook(state, bucket)``
returning something with ``wait()`` (a ``torch.futures.Future`` or
``hororing.comm_hooks.Pending``) that gives the reduced flat tensor; ``bucket.buffer()`` is the flat gradient tensor,
``bucket.parameters()`` its parameters, ``bucket.name`` the same on every rank.

Example:
    >>> optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters(),
    ...                                      comm_hook=hvd.comm_hooks.powersgd(rank=4))
"""

import numpy as np

from ..comm_hooks import (Binding, GradBucket, Pending, Reduction, allreduce, bf16,
                          compressed, fp16, powersgd)
from . import mpi_ops, powersgd_arrays  # noqa: F401 (registers torch's PowerSGD arrays)
from .bridge import from_numpy
from .compression import Compression

__all__ = ["GradBucket", "Pending", "Reduction", "allreduce", "bf16", "compressed", "fp16",
           "powersgd"]

# how the hooks start and finish a torch bucket's allreduce
TORCH = Binding(Compression, lambda payload, compressor, name, reduction:
                mpi_ops.compressed_allreduce_async_(
                    payload, compressor, name, reduction.op, reduction.prescale,
                    reduction.postscale, reduction.process_set),
                mpi_ops.synchronize)


def sharded_compression(hook, compression):
    """The compression a sharded optimizer's reduce-scatter takes for ``hook``, or a
    ValueError naming why the hook makes no sense there."""
    if compression is not Compression.none:
        raise ValueError("pass either compression= or comm_hook=, not both")
    chosen = {allreduce: Compression.none, fp16: Compression.fp16,
              bf16: Compression.bf16}.get(hook)
    if chosen is None:
        raise ValueError(f"sharded=True reduce-scatters each gradient bucket, so that each "
                         f"rank keeps its slice; it takes comm_hooks.allreduce, .fp16 or .bf16 "
                         f"(or compression=), not {hook!r}: PowerSGD's low-rank factors (and "
                         f"any hook that returns whole reduced buckets) have no slice to keep")
    return chosen


def write_back(reduced, flat):
    """Put a hook's reduced vector (a tensor or a numpy array) into the bucket's ``flat``
    tensor, unless it is already there."""
    if isinstance(reduced, np.ndarray):
        if reduced.ctypes.data == flat.data_ptr() and flat.device.type == "cpu":
            return
        reduced = from_numpy(np.ascontiguousarray(reduced))
    if reduced.data_ptr() != flat.data_ptr():
        flat.copy_(reduced.reshape(flat.shape))
