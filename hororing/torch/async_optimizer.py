"""``AsyncPSOptimizer`` for torch models: asynchronous SGD through the parameter servers."""

import numpy as np
import torch

from ..async_optimizer import AsyncPSOptimizer as _NumpyAsync


class AsyncPSOptimizer(torch.optim.Optimizer):
    """Asynchronous parameter-server SGD (PS mode with dedicated servers only).

    The servers hold the parameters and apply each worker's gradient on arrival; ``step()``
    pushes this worker's gradients and loads the servers' latest values into the model. The
    learning rate and momentum are the servers' and are fixed when the optimizer is made.
    A parameter without a gradient pushes zeros.

    Example:
        >>> optimizer = hvd.AsyncPSOptimizer(model.named_parameters(), lr=0.05, momentum=0.9)
        >>> loss.backward(); optimizer.step(); optimizer.zero_grad()
        >>> optimizer.staleness()  # {'updates': ..., 'mean': ..., 'max': ...}
    """

    def __init__(self, named_parameters, lr, momentum=0.0):
        pairs = list(named_parameters)
        if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        self._named = [(name, p) for name, p in pairs if p.requires_grad]
        super().__init__([p for _, p in self._named], {"lr": lr, "momentum": momentum})
        self._host = [(name, p.detach().cpu().numpy().astype(np.float32, copy=True))
                      for name, p in self._named]
        self._client = _NumpyAsync(self._host, lr=lr, momentum=momentum)
        self._load()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        gradients = [np.zeros(p.shape, np.float32) if p.grad is None else
                     p.grad.detach().cpu().numpy() for _, p in self._named]
        self._client.step(gradients)
        self._load()
        return loss

    def staleness(self):
        """{'updates', 'mean', 'max'}: staleness of this worker's updates, in server steps."""
        return self._client.staleness()

    @torch.no_grad()
    def _load(self):
        for (_, parameter), (_, values) in zip(self._named, self._host):
            parameter.copy_(torch.from_numpy(values))
