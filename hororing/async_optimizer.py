"""``AsyncPSOptimizer``: asynchronous parameter-server training on numpy parameters.

Needs PS mode with dedicated servers (``HORORING_MODE=ps``, ``HORORING_PS_SERVERS=k >= 1``).
The servers hold the parameters and apply each worker's gradient on arrival with SGD
(``lr``, optional ``momentum``, fixed when the optimizer is made); ``step()`` pushes this
worker's gradients and writes the servers' latest parameters into the arrays. Every worker
starts from worker 0's values. ``staleness()`` reports how many other updates reached the
servers between this worker's pull and its push (0 means the update was fresh).
"""

import numpy as np

from .context import current


class AsyncPSOptimizer:
    """Asynchronous SGD through the parameter servers.

    Args:
        named_params: (name, numpy array) pairs or a dict; float32 or float64, one dtype.
        lr: the servers' learning rate.
        momentum: the servers' momentum (0: plain SGD).

    Example:
        >>> optimizer = hvd.AsyncPSOptimizer(model.named_params(), lr=0.05, momentum=0.9)
        >>> optimizer.step(grads)  # grads: name -> array, or a list in the same order
    """

    def __init__(self, named_params, lr, momentum=0.0):
        pairs = list(named_params.items() if isinstance(named_params, dict) else named_params)
        self.names = [name for name, _ in pairs]
        self.arrays = [array for _, array in pairs]
        if not self.arrays:
            raise ValueError("AsyncPSOptimizer needs at least one parameter")
        dtypes = {array.dtype for array in self.arrays}
        if len(dtypes) != 1 or next(iter(dtypes)).name not in ("float32", "float64"):
            raise TypeError(f"AsyncPSOptimizer parameters must all be float32 or all float64, got "
                            f"{sorted(dtype.name for dtype in dtypes)}")
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"AsyncPSOptimizer needs lr > 0 and 0 <= momentum < 1, got lr={lr}, "
                             f"momentum={momentum}")
        self.client = _client()
        self.flat = np.concatenate([array.reshape(-1) for array in self.arrays])
        self.client.register(self.flat, float(lr), float(momentum))
        self._unflatten()

    def step(self, gradients):
        """Push ``gradients`` (name -> array, or a list in parameter order); pull fresh values."""
        if isinstance(gradients, dict):
            missing = [name for name in self.names if name not in gradients]
            if missing:
                raise ValueError(f"step() got no gradient for {missing}")
            gradients = [gradients[name] for name in self.names]
        if len(gradients) != len(self.arrays):
            raise ValueError(f"step() needs {len(self.arrays)} gradients, got {len(gradients)}")
        flat = np.concatenate([np.asarray(gradient, dtype=self.flat.dtype).reshape(-1)
                               for gradient in gradients])
        if flat.size != self.flat.size:
            raise ValueError(f"step() gradients hold {flat.size} values; the parameters hold "
                             f"{self.flat.size}")
        self.client.push(flat, self.flat)
        self._unflatten()

    def staleness(self):
        """{'updates', 'mean', 'max'}: the staleness of this worker's updates, in server steps."""
        values = self.client.staleness
        return {"updates": len(values), "mean": float(np.mean(values)) if values else 0.0,
                "max": int(max(values)) if values else 0}

    def _unflatten(self):
        offset = 0
        for array in self.arrays:
            array[...] = self.flat[offset:offset + array.size].reshape(array.shape)
            offset += array.size


def _client():
    context = current()
    if context.reducer is None:
        raise ValueError("asynchronous PS needs dedicated parameter servers: run with "
                         "HORORING_MODE=ps and HORORING_PS_SERVERS=k (k >= 1), or "
                         "hvd.init(mode='ps', num_servers=k)")
    return context.reducer.async_client(context.rank)
