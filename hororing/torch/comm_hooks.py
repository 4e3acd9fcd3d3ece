"""Gradient communication hooks for ``hvd.DistributedOptimizer`` (``comm_hook=``, or
``optimizer.register_comm_hook(state, hook)``), as DDP's ``register_comm_hook``.

The hooks of ``hororing.comm_hooks``, handed torch buckets: ``allreduce`` (what the optimizer
does without a hook), ``fp16`` and ``bf16`` (16 bits on the wire, each hop's sum in float32)
and ``powersgd(rank=, start_iter=, min_compression_rate=, use_error_feedback=, warm_start=)``
(float32 and float64 CPU gradients). A hook of your own is ``hook(state, bucket)`` returning
something with ``wait()`` (a ``torch.futures.Future`` or ``hororing.comm_hooks.Pending``)
that gives the reduced flat tensor; ``bucket.buffer()`` is the flat gradient tensor,
``bucket.parameters()`` its parameters, ``bucket.name`` the same on every rank.

Example:
    >>> optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters(),
    ...                                      comm_hook=hvd.comm_hooks.powersgd(rank=4))
"""

from ..comm_hooks import (Binding, GradBucket, Pending, Reduction, allreduce, bf16, fp16,
                          powersgd)
from . import mpi_ops
from .compression import Compression

__all__ = ["GradBucket", "Pending", "Reduction", "allreduce", "bf16", "fp16", "powersgd"]

# how the hooks start and finish a torch bucket's allreduce
TORCH = Binding(Compression, lambda payload, compressor, name, reduction:
                mpi_ops.compressed_allreduce_async_(
                    payload, compressor, name, reduction.op, reduction.prescale,
                    reduction.postscale, reduction.process_set),
                mpi_ops.synchronize)


def bucket_of(index, name, flat, array, parameters, reduction, last):
    """The ``GradBucket`` a hook gets for a torch bucket (``array``: ``flat`` as the engine
    takes it)."""
    return GradBucket(index, name, flat, array, [tuple(parameter.shape) for parameter
                                                  in parameters], parameters, reduction,
                      TORCH, last)
