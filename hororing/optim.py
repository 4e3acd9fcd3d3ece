"""A framework-free DistributedOptimizer for models whose parameters are numpy arrays.

The protocol an optimizer must follow (``SGD`` below follows it):

- ``params``: dict, name -> parameter array (updated in place by ``step``);
- ``grads``: dict, name -> gradient array, same keys and shapes, written by the model's
  backward pass;
- ``step()``: apply ``grads`` to ``params``.

The wrapper averages ``grads`` over all ranks before the wrapped ``step()``. Gradients are
reduced in place, fused by the engine; call ``grad_ready(name)`` as soon as a gradient is
computed (back to front) to start its allreduce while the rest of the backward pass runs.

Gradients live in their buckets: after the first step, each numpy entry of ``grads`` is
replaced by a view into a flat array per dtype, laid out in the order the engine runs the
gradients' allreduces in a cycle (``Engine.reduction_order``: once negotiated, names keep one
order), so gradients that become ready together are back to back and the engine
reduces them where they lie (no copy into a fusion buffer, none back). Write gradients
through the dict (``grads[name][...] = g``), as the protocol says: an array taken from it
before the first step is no longer the one reduced. An entry replaced by a new array is still
reduced, through the fusion buffer.
"""

import numpy as np

from . import collectives, ops
from .compression import Compression
from .context import current
from .engine.buckets import fill_buckets


class SGD:
    """Plain SGD with optional momentum over a dict of numpy parameters.

    Example:
        >>> optimizer = SGD({"w": w, "b": b}, lr=0.1, momentum=0.9)
    """

    def __init__(self, params, lr, momentum=0.0):
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.params = params
        self.grads = {name: np.zeros_like(value) for name, value in params.items()}
        self.lr = lr
        self.momentum = momentum
        self._velocity = {name: np.zeros_like(value) for name, value in params.items()}

    def step(self):
        for name, param in self.params.items():
            velocity = self._velocity[name]
            velocity *= self.momentum
            velocity += self.grads[name]
            param -= self.lr * velocity


class DistributedOptimizer:
    """Average an optimizer's gradients over all ranks before each step.

    Args:
        optimizer: an object following the protocol in this module's docstring.
        compression: a compressor (``hvd.Compression.none``, ``.fp16``, ``.bf16`` or a
            ``hororing.compression.Compressor`` of your own); None and "fp16" are accepted as
            ``Compression.none`` and ``Compression.fp16``.
        backward_passes_per_step: local backward passes summed per allreduce and step.
        op: Average (default), Sum or Adasum.

    Every rank must call ``step()`` the same number of times.
    """

    def __init__(self, optimizer, compression=None, backward_passes_per_step=1, op=ops.Average):
        for attribute in ("params", "grads", "step"):
            if not hasattr(optimizer, attribute):
                raise TypeError(f"optimizer must have .params, .grads and .step() (see "
                                f"hororing.optim); {type(optimizer).__name__} lacks .{attribute}")
        if backward_passes_per_step <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
        compression = _compressor(compression)
        if op not in (ops.Average, ops.Sum, ops.Adasum):
            raise ValueError(f"op must be Average, Sum or Adasum, got {ops.op_name(op)}")
        self.optimizer = optimizer
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self._passes = 0
        self._accumulated = None
        self._handles = {}
        self._bucketed_for = None  # the fusion threshold the buckets were laid out for

    @property
    def params(self):
        return self.optimizer.params

    @property
    def grads(self):
        return self.optimizer.grads

    def grad_ready(self, name):
        """Start the allreduce of ``grads[name]`` now (only on the step's last pass)."""
        if self._passes + 1 == self.backward_passes_per_step and name not in self._handles:
            self._start(name)

    def synchronize(self):
        """Finish every gradient's allreduce; ``grads`` then hold the averages."""
        for name in self.optimizer.grads:
            if name not in self._handles:
                self._start(name)
        for name, (handle, payload, ctx) in self._handles.items():
            if handle is not None:
                result = self.compression.decompress(collectives.synchronize(handle), ctx)
                if result is not self.optimizer.grads[name]:
                    self.optimizer.grads[name][...] = result
        self._handles.clear()
        self._accumulated = None
        engine = current().engine
        if current().size > 1 and self._bucketed_for != engine.fusion_threshold:
            # after the first step, and again whenever the autotuner moves the threshold
            self._bucketed_for = engine.fusion_threshold
            order = engine.reduction_order([f"grad.{name}" for name in self.optimizer.grads])
            _into_buckets(self.optimizer.grads, [name[len("grad."):] for name in order],
                          self._bucketed_for)

    def step(self):
        """Count a backward pass; on the last of a step, average gradients and step.

        Returns:
            True when the wrapped optimizer stepped.
        """
        self._passes += 1
        if self._passes < self.backward_passes_per_step:
            if self._accumulated is None:
                self._accumulated = {name: grad.copy() for name, grad in self.optimizer.grads.items()}
            else:
                for name, grad in self.optimizer.grads.items():
                    self._accumulated[name] += grad
            return False
        self._passes = 0
        self.synchronize()
        self.optimizer.step()
        return True

    def _start(self, name):
        grad = self.optimizer.grads[name]
        if self._accumulated is not None:  # the step's earlier backward passes
            grad += self._accumulated[name]
        if current().size == 1:
            self._handles[name] = (None, grad, None)
            return
        payload, ctx = self.compression.compress(grad)
        handle = collectives.compressed_allreduce_async_(payload, self.compression,
                                                         name=f"grad.{name}", op=self.op)
        self._handles[name] = (handle, payload, ctx)


def _into_buckets(grads, order, bucket_bytes):
    """Replace the numpy C-contiguous entries of ``grads`` by views into flat arrays, one
    per fused bucket of the names in ``order`` (``buckets.fill_buckets``, at most
    ``bucket_bytes``); the values are kept."""
    laid_out = [name for name in order
                if type(grads[name]) is np.ndarray and grads[name].flags.c_contiguous]
    for bucket in fill_buckets(laid_out, lambda name: grads[name].dtype,
                               lambda name: grads[name].nbytes, bucket_bytes):
        flat = np.empty(sum(grads[name].size for name in bucket), dtype=grads[bucket[0]].dtype)
        offset = 0
        for name in bucket:
            view = flat[offset:offset + grads[name].size].reshape(grads[name].shape)
            view[...] = grads[name]
            grads[name] = view
            offset += view.size


def _compressor(compression):
    """The compressor ``compression`` names (None and "fp16" as Horovod's numpy users wrote
    them), or a ValueError that lists what is accepted."""
    if compression is None:
        return Compression.none
    if compression == "fp16":
        return Compression.fp16
    if hasattr(compression, "compress") and hasattr(compression, "decompress"):
        return compression
    raise ValueError(f"compression must be hvd.Compression.none, .fp16 or .bf16 (or None, "
                     f"'fp16', or an object with compress() and decompress()), got "
                     f"{compression!r}")
