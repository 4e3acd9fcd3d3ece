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

``DistributedOptimizer(optimizer, sharded=True)`` shards the optimizer's state instead
(``ShardedOptimizer``, ZeRO stage 1): each rank steps its slice of the parameters only.
"""

import itertools

import numpy as np

from . import collectives, ops
from .comm_hooks import Binding, Reduction
from .compression import Compression
from .context import current
from .engine import Meta, assign
from .reducer import Reducer, check_passes
from .zero import Buckets, ParameterGather

_INSTANCES = itertools.count()
# how the comm hooks start and finish a numpy bucket's allreduce
NUMPY = Binding(Compression, lambda payload, compressor, name, reduction:
                collectives.compressed_allreduce_async_(
                    payload, compressor, name, reduction.op, reduction.prescale,
                    reduction.postscale, reduction.process_set),
                collectives.synchronize)


class SGD:
    """Plain SGD with optional momentum (Nesterov's with ``nesterov=True``, as torch's SGD
    computes it) over a dict of numpy parameters.

    Example:
        >>> optimizer = SGD({"w": w, "b": b}, lr=0.1, momentum=0.9)
    """

    def __init__(self, params, lr, momentum=0.0, nesterov=False):
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs a momentum > 0")
        self.params = params
        self.grads = {name: np.zeros_like(value) for name, value in params.items()}
        self.lr = lr
        self.momentum = momentum
        self.nesterov = bool(nesterov)
        # what a sharded copy is built with
        self.defaults = {"lr": lr, "momentum": momentum, "nesterov": self.nesterov}
        self._velocity = {name: np.zeros_like(value) for name, value in params.items()}

    def step(self):
        """Step every entry of ``params`` (and only those: DiLoCo steps one fragment's
        entries by narrowing ``params`` and ``grads`` to them)."""
        for name, param in self.params.items():
            velocity, grad = self._velocity[name], self.grads[name]
            velocity *= self.momentum
            velocity += grad
            param -= self.lr * (grad + self.momentum * velocity if self.nesterov else velocity)


class DistributedOptimizer:
    """Average an optimizer's gradients over all ranks before each step.

    Args:
        optimizer: an object following the protocol in this module's docstring.
        compression: a compressor (``hvd.Compression.none``, ``.fp16``, ``.bf16`` or a
            ``hororing.compression.Compressor`` of your own); None and "fp16" are accepted as
            ``Compression.none`` and ``Compression.fp16``.
        backward_passes_per_step: local backward passes summed per allreduce and step.
        op: Average (default), Sum or Adasum.
        sharded: shard the optimizer's state over the ranks (``ShardedOptimizer``).
        comm_hook: reduce the gradients bucket by bucket with ``comm_hook(None, bucket)``
            (``hororing.comm_hooks``: allreduce, fp16, bf16, powersgd(...)); see also
            ``register_comm_hook``.

    Every rank must call ``step()`` the same number of times.
    """

    def __new__(cls, optimizer, compression=None, backward_passes_per_step=1, op=ops.Average,
                sharded=False, comm_hook=None):
        if sharded:
            if comm_hook is not None:
                raise ValueError("sharded=True reduce-scatters its gradients and takes no "
                                 "comm_hook (a hook returns whole reduced buckets; PowerSGD's "
                                 "low-rank factors cannot be reduce-scattered)")
            return ShardedOptimizer(optimizer, compression, backward_passes_per_step, op)
        return super().__new__(cls)

    def __init__(self, optimizer, compression=None, backward_passes_per_step=1, op=ops.Average,
                 sharded=False, comm_hook=None):
        check_protocol(optimizer)
        backward_passes_per_step = check_passes(backward_passes_per_step)
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
        # the buckets' layout, names and route version (hororing/reducer.py); the passes are
        # counted per step here, each step's earlier gradients summed into _accumulated
        self._reducer = Reducer({name: f"grad.{name}" for name in optimizer.grads},
                                backward_passes_per_step)
        self._buckets = []  # the reducer's Buckets a hook reduces
        if comm_hook is not None:
            self.register_comm_hook(None, comm_hook)

    def register_comm_hook(self, state, hook):
        """Reduce the gradients bucket by bucket with ``hook(state, bucket)`` from the next
        step on (``hororing.comm_hooks``): every rank registers the same hook."""
        self._reducer.register_hook(state, hook, self.op, self.compression is Compression.none)

    def state_dict(self):
        """The comm hook's state (PowerSGD's), to restore with ``load_state_dict``."""
        return self._reducer.hook_state()

    def load_state_dict(self, state):
        self._reducer.load_hook_state(state)

    @property
    def params(self):
        return self.optimizer.params

    @property
    def grads(self):
        return self.optimizer.grads

    def grad_ready(self, name):
        """Start the allreduce of ``grads[name]`` now (only on the step's last pass; with a
        comm hook the buckets start in ``step()``)."""
        if self._passes + 1 == self.backward_passes_per_step and name not in self._handles \
                and self._reducer.hook is None:
            self._start(name)

    def synchronize(self):
        """Finish every gradient's allreduce; ``grads`` then hold the averages."""
        if self._reducer.hook is not None and current().size > 1:
            self._reduce_buckets()
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
        reducer = self._reducer
        if current().size > 1 and reducer.hook is None and reducer.relayout_due():
            # after the first step, and again whenever the route changes (the autotuner)
            reducer.laid_out()
            _into_buckets(self.optimizer.grads, reducer.order(list(self.optimizer.grads)),
                          reducer.fusion_threshold())

    def _reduce_buckets(self):
        """Hand every bucket to the comm hook, wait for all, write the results back."""
        grads = self.optimizer.grads
        reducer = self._reducer
        if reducer.relayout_due() or any(grads[name].base is not bucket.flat
                                         for bucket in self._buckets for name in bucket.members):
            # the first step, a new route, or a gradient replaced by a new array
            reducer.laid_out()
            self._buckets = reducer.take_buckets(
                _into_buckets(grads, list(grads), reducer.bucket_bytes(hooked=True)),
                whole=lambda names: True)
        reduction = Reduction(self.op)
        pending = []
        for bucket in self._buckets:
            names, flat = list(bucket.members), bucket.flat
            pending.append((flat, reducer.dispatch(bucket, flat, flat, names,
                                                   [grads[name].shape for name in names],
                                                   reduction, NUMPY)))
        for flat, result in pending:
            reduced = result.wait()
            if reduced is not flat:
                flat[...] = reduced
        for bucket in self._buckets:  # reduced: nothing left for the per-gradient path
            for name in bucket.members:
                self._handles[name] = (None, None, None)

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


class ShardedOptimizer:
    """``DistributedOptimizer(optimizer, sharded=True)``: each rank keeps optimizer state for
    its slice of the parameters only (ZeRO stage 1, ``zero.py``).

    The parameters of each dtype are one flat vector split over the ranks; the wrapped
    optimizer is rebuilt, as ``type(optimizer)(slice_params, **optimizer.defaults)``, over
    this rank's slice of each (one entry per dtype, named ``"shard.<dtype>"``), so its state
    exists for that slice only. ``grads`` are views into one flat gradient vector per dtype:
    write them through the dict (``grads[name][...] = g``), as the protocol says. ``step()``
    reduce-scatters the gradients through the engine (as the torch sharded optimizer does),
    steps the slice, allgathers the updated slices and writes
    them into ``params`` (the caller's arrays, in place). After a step, ``grads`` outside this
    rank's slice hold partial sums.

    The wrapped optimizer must have ``defaults`` (its constructor's keyword arguments, as
    ``SGD`` here) and a step that treats each element on its own (SGD, momentum, Adam...):
    stepped on a slice, any other would compute something else.
    """

    def __init__(self, optimizer, compression=None, backward_passes_per_step=1,
                 op=ops.Average):
        for attribute in ("params", "grads", "step", "defaults"):
            if not hasattr(optimizer, attribute):
                raise TypeError(f"sharded=True rebuilds the optimizer over this rank's slice: it "
                                f"needs .params, .grads, .step() and .defaults (its constructor's "
                                f"keyword arguments); {type(optimizer).__name__} lacks "
                                f".{attribute}")
        if _compressor(compression) is not Compression.none:
            raise ValueError("sharded=True does not compress gradients; pass compression=None")
        if op not in (ops.Average, ops.Sum):
            raise ValueError(f"sharded=True reduces gradients with Average or Sum, got "
                             f"{ops.op_name(op)}")
        self.optimizer_class = type(optimizer)
        self.backward_passes_per_step = check_passes(backward_passes_per_step)
        self.op = op
        self._params = optimizer.params
        group = current().group
        by_dtype = {}
        for name, param in self._params.items():
            if type(param) is not np.ndarray or param.dtype not in (np.float32, np.float64):
                raise ValueError(f"sharded=True takes float32 and float64 numpy parameters; "
                                 f"'{name}' is {getattr(param, 'dtype', type(param).__name__)}")
            if not param.flags.c_contiguous:
                raise ValueError(f"sharded=True updates parameters in place and needs them "
                                 f"C-contiguous; '{name}' is not (np.ascontiguousarray it first)")
            by_dtype.setdefault(param.dtype, []).append(name)
        self._prefix = f"sharded.numpy{next(_INSTANCES)}"  # constructed in one order everywhere
        self._vectors = []  # (dtype, names, Buckets (one bucket), values, gradients)
        self._grads = {}
        shard_params = {}
        for dtype, names in by_dtype.items():
            numel = sum(self._params[name].size for name in names)
            buckets = Buckets(numel, dtype.itemsize, group.rank, group.size)
            values = np.empty(numel, dtype=dtype)
            gradients = np.zeros(numel, dtype=dtype)
            offset = 0
            for name in names:
                size = self._params[name].size
                values[offset:offset + size] = self._params[name].reshape(-1)
                self._grads[name] = gradients[offset:offset + size].reshape(
                    self._params[name].shape)
                offset += size
            self._vectors.append((dtype, names, buckets, values, gradients))
            start, stop = buckets.owned[0]
            shard_params[f"shard.{dtype.name}"] = values[start:stop]
        self._gather = ParameterGather(group)
        self._gather.check_same([(dtype.name, values.size) for dtype, _, _, values, _
                                 in self._vectors], "parameters (dtype, elements)")
        self.optimizer = self.optimizer_class(shard_params, **optimizer.defaults)
        for (dtype, _, buckets, _, gradients) in self._vectors:
            start, stop = buckets.owned[0]
            self.optimizer.grads[f"shard.{dtype.name}"] = gradients[start:stop]
        self._passes = 0
        self._accumulated = None

    @property
    def params(self):
        """The caller's parameter arrays (updated in place by ``step``)."""
        return self._params

    @property
    def grads(self):
        """name -> this step's gradient, a view into its dtype's flat gradient vector."""
        return self._grads

    def grad_ready(self, name):
        """Accepted for DistributedOptimizer's protocol: the gradients are reduced together
        inside ``step()``."""

    def step(self):
        """Count a backward pass; on the step's last, reduce-scatter the gradients (through
        the engine, in place: this rank's chunk of each vector is then its reduced gradient),
        step this rank's chunks and allgather the parameters. Returns True when it stepped."""
        self._passes += 1
        if self._passes < self.backward_passes_per_step:
            if self._accumulated is None:
                self._accumulated = [gradients.copy() for *_, gradients in self._vectors]
            else:
                for total, (*_, gradients) in zip(self._accumulated, self._vectors):
                    total += gradients
            return False
        self._passes = 0
        handles = []
        for index, (dtype, names, buckets, values, gradients) in enumerate(self._vectors):
            if self._accumulated is not None:
                gradients += self._accumulated[index]
            # this rank's chunk starts from the parameters as they are now (the caller may
            # have assigned them, e.g. from a checkpoint)
            _pack_slice(self._params, names, values, buckets.owned[0])
            handles.append(collectives.reducescatter_async_(
                gradients, f"{self._prefix}.{dtype.name}", self.op))
        for handle in handles:
            collectives.synchronize(handle)  # a view of this rank's chunk, where it lies
        self._accumulated = None
        self.optimizer.step()
        for dtype, names, buckets, values, _ in self._vectors:
            self._gather.gather(values.view(np.uint8), buckets)
            offset = 0
            for name in names:
                param = self._params[name]
                param.reshape(-1)[...] = values[offset:offset + param.size]
                offset += param.size
        return True


def check_protocol(optimizer, what="optimizer"):
    """``optimizer`` must follow this module's protocol."""
    for attribute in ("params", "grads", "step"):
        if not hasattr(optimizer, attribute):
            raise TypeError(f"{what} must have .params, .grads and .step() (see "
                            f"hororing.optim); {type(optimizer).__name__} lacks .{attribute}")


def _pack_slice(params, names, values, owned):
    """Copy the parameters' elements in this rank's ``owned`` (start, stop) range into the
    flat ``values``."""
    start, stop = owned
    offset = 0
    for name in names:
        flat = params[name].reshape(-1)
        low, high = max(offset, start), min(offset + flat.size, stop)
        if low < high:
            values[low:high] = flat[low - offset:high - offset]
        offset += flat.size


def _into_buckets(grads, order, bucket_bytes):
    """Replace the numpy C-contiguous entries of ``grads`` by views into flat arrays, one
    per fused bucket of the names in ``order`` (``engine.assign``, at most
    ``bucket_bytes``); the values are kept. Returns the buckets, [(names, flat array)]."""
    laid_out = [name for name in order
                if type(grads[name]) is np.ndarray and grads[name].flags.c_contiguous]
    metas = [Meta("allreduce", dtype=grads[name].dtype.name, shape=grads[name].shape)
             for name in laid_out]
    buckets = []
    for indices in assign(metas, bucket_bytes):
        bucket = [laid_out[index] for index in indices]
        flat = np.empty(sum(grads[name].size for name in bucket), dtype=grads[bucket[0]].dtype)
        offset = 0
        for name in bucket:
            view = flat[offset:offset + grads[name].size].reshape(grads[name].shape)
            view[...] = grads[name]
            grads[name] = view
            offset += view.size
        buckets.append((bucket, flat))
    return buckets


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
