"""A framework-free DistributedOptimizer for models whose parameters are numpy arrays.

The protocol an optimizer must follow (``SGD`` below follows it):

- ``params``: dict, name -> parameter array (updated in place by ``step``);
- ``grads``: dict, name -> gradient array, same keys and shapes, written by the model's
  backward pass;
- ``step()``: apply ``grads`` to ``params``.

The wrapper averages ``grads`` over all ranks before the wrapped ``step()``. Gradients are
reduced in place, fused by the engine; call ``grad_ready(name)`` as soon as a gradient is
computed (back to front) to start its allreduce while the rest of the backward pass runs.
"""

import numpy as np

from . import collectives, ops
from .context import current


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
        compression: None, or "fp16" to send floating gradients as float16.
        backward_passes_per_step: local backward passes summed per allreduce and step.
        op: Average (default) or Sum.

    Every rank must call ``step()`` the same number of times.
    """

    def __init__(self, optimizer, compression=None, backward_passes_per_step=1, op=ops.Average):
        for attribute in ("params", "grads", "step"):
            if not hasattr(optimizer, attribute):
                raise TypeError(f"optimizer must have .params, .grads and .step() (see "
                                f"hororing.optim); {type(optimizer).__name__} lacks .{attribute}")
        if backward_passes_per_step <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
        if compression not in (None, "fp16"):
            raise ValueError(f"compression must be None or 'fp16', got {compression!r}")
        if op not in (ops.Average, ops.Sum):
            raise ValueError(f"op must be Average or Sum, got {ops.op_name(op)}")
        self.optimizer = optimizer
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self._passes = 0
        self._accumulated = None
        self._handles = {}

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
        for name, (handle, wire) in self._handles.items():
            if handle is not None:
                result = collectives.synchronize(handle)
                if wire is not self.optimizer.grads[name]:
                    self.optimizer.grads[name][...] = result
        self._handles.clear()
        self._accumulated = None

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
            self._handles[name] = (None, grad)
            return
        if self.compression == "fp16" and grad.dtype.kind == "f":
            wire = grad.astype(np.float16)
            handle = collectives.compressed_allreduce_async_(wire, name=f"grad.{name}", op=self.op)
        else:
            wire = grad
            handle = collectives.allreduce_async_(wire, name=f"grad.{name}", op=self.op)
        self._handles[name] = (handle, wire)
