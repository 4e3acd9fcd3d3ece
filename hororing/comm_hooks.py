"""Gradient communication hooks: how a bucket of gradients is reduced, as DDP's comm hooks.

The optimizers cut the gradients into buckets (``engine.assign``: flat vectors of at most
the fusion threshold). With a hook, each bucket, once all its gradients are in, is handed
to ``hook(state, bucket)`` as a ``GradBucket``: its flat gradient vector (``buffer()``, the
framework's tensor; ``array()``, the same memory as the engine takes it), its parameters, a
name that is the same on every rank and every step, and how the optimizer reduces
(``reduction``: op, scale factors, process set). The hook returns something with
``wait()`` that gives the reduced flat vector (a ``Pending``; a ``torch.futures.Future``
works too); ``step()`` waits for every bucket's and writes the result into the gradients.

Built-in hooks, for the numpy optimizer (``hororing.optim``) and the torch one
(``hororing.torch.comm_hooks``, ``hvd.comm_hooks``):

- ``allreduce``: what the optimizer does without a hook;
- ``fp16``, ``bf16``: the bucket travels in 16 bits, each hop's sum computed in float32
  (``Compression.fp16``/``.bf16`` on the whole bucket);
- ``powersgd(rank=...)``: PowerSGD (Vogels et al., 2019; ``powersgd/``).

Every hook must be called by every rank for the same buckets in any order (the engine
matches them by name), as the optimizers do.
"""

import math
from typing import NamedTuple

from .powersgd import PowerSGD


class Reduction(NamedTuple):
    """How the optimizer reduces its gradients: the op (Average or Sum), the factors
    before and after the sum, and the process set (None: every rank)."""

    op: int
    prescale: float = 1.0
    postscale: float = 1.0
    process_set: object = None


class Binding(NamedTuple):
    """A framework's side of the hooks: its compressors and how it starts and finishes an
    in-place allreduce of one of its flat tensors."""

    compression: object  # a namespace with none, fp16, bf16 (the binding's compressors)
    start: object        # start(tensor, compressor, name, reduction) -> handle
    synchronize: object  # synchronize(handle) -> the reduced tensor


class GradBucket:
    """One bucket of gradients, as a hook sees it (DDP's ``GradBucket`` methods)."""

    def __init__(self, index, name, tensor, array, shapes, parameters, reduction, binding,
                 last=False):
        self.name = name
        self.reduction = reduction
        self.binding = binding
        self._index, self._tensor, self._array = index, tensor, array
        self._shapes, self._parameters, self._last = list(shapes), list(parameters), last

    def index(self):
        """The bucket's position in the optimizer's layout."""
        return self._index

    def buffer(self):
        """The flat gradient vector, as the framework's tensor."""
        return self._tensor

    def array(self):
        """The flat gradient vector as the engine takes it (a numpy array over the same
        memory, for CPU gradients)."""
        return self._array

    def gradients(self):
        """Views of ``array()``, one per parameter, shaped like it."""
        views, offset = [], 0
        for shape in self._shapes:
            count = math.prod(shape)
            views.append(self._array[offset:offset + count].reshape(shape))
            offset += count
        return views

    def parameters(self):
        """The bucket's parameters (tensors, or names for the numpy optimizer), in order."""
        return self._parameters

    def is_last(self):
        """The last bucket of the optimizer's layout."""
        return self._last


class Pending:
    """A hook's reduction in flight: ``wait()`` returns the reduced flat vector."""

    def __init__(self, wait):
        self._wait = wait
        self._result = None
        self._done = False

    def wait(self):
        if not self._done:
            self._result, self._done = self._wait(), True
        return self._result


def compressed(kind):
    """A hook that sends each bucket as compressor ``kind`` (a name of the binding's
    ``Compression``: "none", "fp16", "bf16") makes it. A cast bucket is cast into a 16-bit
    payload kept for it from step to step and cast back into the bucket itself: one pass
    each way, nothing allocated per step (where the binding's tensors allow it)."""
    payloads = {}  # bucket name -> its payload, reused while the bucket keeps its shape

    def hook(state, bucket):
        binding, flat = bucket.binding, bucket.buffer()
        compressor = getattr(binding.compression, kind)
        payload = _payload(compressor, flat, payloads, bucket.name)
        if payload is None:
            payload, ctx = compressor.compress(flat)
            handle = binding.start(payload, compressor, bucket.name, bucket.reduction)
            return Pending(lambda: compressor.decompress(binding.synchronize(handle), ctx))
        compressor.compress_into(flat, payload)
        handle = binding.start(payload, compressor, bucket.name, bucket.reduction)

        def finish():
            compressor.decompress_into(binding.synchronize(handle), flat)
            return flat
        return Pending(finish)
    hook.__name__ = hook.__qualname__ = {"none": "allreduce"}.get(kind, kind)
    hook.__doc__ = f"Reduce each bucket as Compression.{kind} sends a tensor."
    return hook


def _payload(compressor, flat, payloads, name):
    """The kept payload of bucket ``name`` for ``compressor`` (None: no in-place cast:
    not a cast kind, not a floating bucket, already the target dtype, or tensors that
    cannot be written)."""
    payload_for = getattr(compressor, "payload_for", None)
    if payload_for is None or not compressor.floating(flat) or compressor.is_target(flat):
        return None
    payload = payloads.get(name)  # always the compressor's target dtype
    if payload is None or payload.shape != flat.shape or \
            getattr(payload, "device", None) != getattr(flat, "device", None):
        payload = payloads[name] = payload_for(flat)
    return payload


allreduce = compressed("none")  # the built-ins; compressed(kind) makes a hook of one's own
fp16 = compressed("fp16")
bf16 = compressed("bf16")


def powersgd(rank=1, start_iter=1000, min_compression_rate=2.0, use_error_feedback=True,
             warm_start=True, seed=0):
    """A PowerSGD hook (``powersgd.PowerSGD``) with DDP's ``PowerSGDState`` defaults; its
    state (error feedback, the Q matrices, the step count) is saved with the optimizer's."""
    return PowerSGD(rank, start_iter, min_compression_rate, use_error_feedback, warm_start,
                    seed)


def check_hook(hook, op, compression_is_none):
    """Refuse a hook the optimizer cannot use, naming why."""
    if not callable(hook):
        raise TypeError(f"comm_hook must be callable as hook(state, bucket), got "
                        f"{type(hook).__name__}")
    if getattr(hook, "__module__", "").startswith("torch.distributed.algorithms"):
        raise TypeError(
            f"{hook.__name__} is one of DDP's hooks: it takes torch's GradBucket and runs "
            f"torch.distributed collectives, which a DistributedOptimizer's buckets do not "
            f"offer. Use hororing's own (hvd.comm_hooks.allreduce, fp16, bf16, "
            f"powersgd(rank=...)), or run DDP's hooks with DDP over the hororing backend: "
            f"dist.init_process_group(\"hororing\"); "
            f"DistributedDataParallel(model).register_comm_hook(state, hook)")
    if not compression_is_none:
        raise ValueError("pass either compression= or comm_hook=, not both: a hook decides "
                         "how a bucket travels (comm_hooks.fp16 and .bf16 are the "
                         "compressions as hooks)")
    from . import ops

    if op not in (ops.Average, ops.Sum):
        raise ValueError(f"a comm_hook reduces whole buckets with Average or Sum, got "
                         f"op={ops.op_name(op)} (Adasum combines each tensor on its own: "
                         f"use it without a hook)")
