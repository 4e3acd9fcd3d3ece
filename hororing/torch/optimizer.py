"""DistributedOptimizer: averages gradients across ranks while backward() runs.

Gradients live in their buckets (as DDP's ``gradient_as_bucket_view``; ``layout.py``): the
dense CPU and CUDA gradients of each dtype and device are views into flat tensors, laid out
in reverse parameter order (the order backward produces them). A hook on every parameter
notes its gradient; once a bucket's gradients are all in, the bucket starts as one
asynchronous, in-place allreduce of its flat tensor (or goes to the comm hook), so
communication overlaps the rest of the backward pass, and the engine reduces the gradients
where they lie, with no copy into a fusion buffer and none back. Such buckets hold at most
the hook bucket size (16 MiB by default), as DDP's 25 MB. Where the gradients of a bucket are
not reduced alike (a compressor's payloads, Adasum, Min/Max/Product) each starts as it comes,
the buckets hold up to the fusion threshold, and after the first step they are laid out again
in the order the engine runs them (``Engine.reduction_order``), so gradients fused together
lie back to back. ``step()`` waits for the allreduces and then steps the wrapped optimizer.

The wrapper is a ``torch.optim.Optimizer`` that shares the wrapped optimizer's
``param_groups`` and ``state``, so LR schedulers and checkpoints see one optimizer; no class
is built at run time. Autograd accumulates into a view in place; a gradient that arrives as a
new tensor (after ``zero_grad(set_to_none=True)``, the default) is copied into its view once
and ``.grad`` is pointed at the view again.
"""

import contextlib
import warnings

import torch

from .. import ops
from ..process_sets import global_process_set, group_of
from ..reducer import Reducer
from . import comm_hooks, joined, mpi_ops
from .amp import scaled_step
from .bridge import as_numpy
from .compression import Compression
from .functions import refuse_uninitialized
from .layout import (bucket_views, dense_local, generated_names, laid_out_again, move_gradients,
                     parameter_names)
from .sharded import ShardedOptimizer
from .wrapping import WrappingOptimizer


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=ops.Average,
                         gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, sharded=False, comm_hook=None):
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    Args:
        optimizer: any torch.optim.Optimizer.
        named_parameters: (name, parameter) pairs, e.g. ``model.named_parameters()``; names
            must be unique and cover every parameter. Without them, names are generated from
            the parameter's position, which matches across ranks for the same model.
        compression: Compression.none, Compression.fp16 or Compression.bf16.
        backward_passes_per_step: backward passes accumulated locally per allreduce.
        op: Average (default), Sum or Adasum (each gradient combined by the Adasum tree).
        gradient_predivide_factor: divide by this before the sum and by size/this after.
        groups: accepted for Horovod compatibility; hororing fuses ready gradients anyway.
        sparse_as_dense: reduce sparse gradients as dense tensors (the optimizer still gets
            a sparse gradient back, as in Horovod). By default a sparse
            gradient's indices and values are allgathered and summed as a sparse tensor
            (divided by size for Average), which moves only the rows that changed.
        process_set: average over this ``hvd.ProcessSet`` only; on ranks outside it the
            optimizer steps with local gradients.
        sharded: True (or 1): keep the optimizer's state sharded across the ranks (ZeRO
            stage 1, ``hororing/torch/sharded.py``): each rank steps its 1/n of the
            parameters between the reduce-scatter of the gradients (started per bucket
            during backward) and the allgather of the parameters. 2: the gradients too
            (ZeRO stage 2): a bucket's gradient memory is let go once it is reduced, and
            each rank keeps its 1/n of the reduced gradients. Elementwise optimizers only
            (SGD, Adam, AdamW, RMSprop, Adagrad, ...).
        comm_hook: reduce the dense gradients bucket by bucket with ``comm_hook(None,
            bucket)`` (``hvd.comm_hooks``: allreduce, fp16, bf16, powersgd(rank=...)), as
            DDP's ``register_comm_hook``; also ``optimizer.register_comm_hook(state, hook)``.
            With ``sharded``, fp16 and bf16 compress the reduce-scatter (as ``compression=``);
            other hooks are refused there.

    Returns:
        a torch.optim.Optimizer.

    Example:
        >>> optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters())
    """
    if sharded:
        if comm_hook is not None:
            compression = comm_hooks.sharded_compression(comm_hook, compression)
        return ShardedOptimizer(optimizer, named_parameters, compression,
                                backward_passes_per_step, op, gradient_predivide_factor,
                                process_set, stage=sharded)
    return _DistributedOptimizer(optimizer, named_parameters, compression, backward_passes_per_step,
                                 op, gradient_predivide_factor, groups, sparse_as_dense,
                                 process_set, comm_hook)


class _DistributedOptimizer(WrappingOptimizer):
    """The wrapper (see ``DistributedOptimizer``)."""

    def __init__(self, optimizer, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense=False,
                 process_set=global_process_set, comm_hook=None):
        # Optimizer.__init__ is not called: the wrapped optimizer's groups and state are used
        # as they are, shared, not rebuilt.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if gradient_predivide_factor != 1.0 and op != ops.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if groups is not None and not isinstance(groups, (int, list)):
            raise ValueError(f"groups must be an int or a list of lists of parameters, got "
                             f"{type(groups).__name__}")
        self._wrap(optimizer)
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._prescale = 1.0 / gradient_predivide_factor
        self._postscale = gradient_predivide_factor
        self._names = parameter_names(optimizer, named_parameters)
        # the buckets, their names and the passes counted: hororing/reducer.py
        self._reducer = Reducer(self._names, backward_passes_per_step, process_set)
        refuse_uninitialized([(name, parameter) for parameter, name in self._names.items()],
                             "DistributedOptimizer")
        self.process_set = process_set
        # None on ranks outside the process set: they step on their own gradients
        included = process_set is None or process_set.included()
        self._group = group_of(process_set) if included else None
        self._handles = {}        # parameter -> (handle, compression ctx, payload, was sparse)
        self._should_synchronize = True
        self._synchronized = False
        self._local = False  # inside no_sync()
        self._hooks = []
        self._views = {}  # parameter -> its gradient's view into a flat bucket
        # a whole bucket is one allreduce of its flat tensor, where every member would be
        # reduced alike (no compressor's payloads, no per-tensor Adasum)
        self._flat_reduce = compression is Compression.none and op in (ops.Average, ops.Sum)
        if comm_hook is not None:  # every bucket then starts whole and goes through it
            self._reducer.register_hook(None, comm_hook, op, compression is Compression.none)
        joined.track(self)
        if self._reduces():
            self._set_buckets(*bucket_views(dense_local(self.param_groups)[::-1],
                                              self._bucket_bytes()))
            self._register_hooks()

    def _bucket_bytes(self):
        """The most bytes one of this optimizer's buckets holds: smaller where buckets start
        whole (a comm hook's, or one allreduce of each flat bucket), so that the first ones
        travel while backward goes on."""
        return self._reducer.bucket_bytes(self._reducer.hook is not None or self._flat_reduce)

    def _starts_whole(self, bucket):
        """Whether a gradient bucket starts whole, once all its gradients are in, as DDP's
        do: with a comm hook; where the bucket is reduced as one flat tensor (no compressor,
        Sum or Average); and every CUDA bucket, where a device allreduce costs launches and
        waits for the GPU. Started one gradient at a time instead, the gradients of a small
        model reach the engine in two or three cycles, a cycle time apart (measured: a 17 k
        parameter model's step 1.8 ms against 1.2 across 2 emulated 1 Gbit/s hosts)."""
        return (self._reducer.hook is not None or self._flat_reduce
                or bucket[0].device.type == "cuda")

    def register_comm_hook(self, state, hook):
        """Reduce the dense gradients bucket by bucket with ``hook(state, bucket)`` from the
        next backward pass on, as DDP's ``register_comm_hook`` (``hvd.comm_hooks``). Every
        rank registers the same hook, between steps."""
        if self._handles:
            raise RuntimeError("register_comm_hook was called while gradients are being "
                               "reduced; call it before backward() or after step()")
        self._reducer.register_hook(state, hook, self._op, self._compression is Compression.none)
        if self._reduces():  # every bucket now starts whole
            self._set_buckets(*bucket_views(dense_local(self.param_groups)[::-1],
                                              self._bucket_bytes()))

    @property
    def _parameter_names(self):
        """parameter -> the name its gradient is reduced under (Horovod's attribute)."""
        return self._names

    def _reduces(self):
        return self._group is not None and self._group.size > 1

    def joined_parameters(self):
        """(parameter, name) pairs that hvd.join() makes equal on every rank (joined.py)."""
        return list(self._names.items()) if self._reduces() else []

    # ---- what torch.optim.Optimizer users call ----------------------------------------------

    # torch.amp's GradScaler hands itself to step(): unscaling waits for the averages (amp.py)
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        """Wait for the gradients' allreduces (unless skipped), then step. Under
        ``scaler.step(optimizer)``, the averages are unscaled and checked (amp.py)."""
        if grad_scaler is not None:
            synchronized = self._synchronized and not self._handles
            self._synchronized = False
            return scaled_step(self, grad_scaler, closure, self.synchronize,
                               self._should_synchronize and not synchronized, synchronized,
                               self._optimizer.step)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            if not self._synchronized or self._handles:  # the gradients are reduced already
                self.synchronize()
        self._synchronized = False
        return self._optimizer.step(closure)

    def _forget_step(self):
        """A collective of this step failed (a rank died; elastic): drop the reductions in
        flight and the passes counted, so that the step can be taken again once the state is
        restored."""
        self._handles.clear()
        self._reducer.forget_step()
        self._synchronized = False

    def _rejoin(self):
        """The job was made anew (the survivors of a failure): use its process set."""
        if self._group is not None:
            self._group = group_of(self.process_set)

    def zero_grad(self, set_to_none=True):
        """Clear gradients; refuses while their allreduces are still running."""
        if self._handles:
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                "a race condition; call optimizer.step() (or synchronize()) first.")
        return self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """The wrapped optimizer's, with the comm hook's state (PowerSGD's) under
        ``"comm_hook"``."""
        state = self._optimizer.state_dict()
        state.update(self._reducer.hook_state())
        return state

    def load_state_dict(self, state_dict):
        if "comm_hook" in state_dict:
            state_dict = dict(state_dict)
            self._reducer.load_hook_state({"comm_hook": state_dict.pop("comm_hook")})
        return self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self._optimizer.add_param_group(param_group)
        self._names.update(generated_names(self._optimizer, skip=self._names))
        if self._reduces():
            self._set_buckets(*bucket_views(dense_local([self.param_groups[-1]])[::-1],
                                              self._bucket_bytes()),
                              update=True)
            for parameter in param_group["params"]:
                self._hook(parameter)

    def __repr__(self):
        return f"DistributedOptimizer({self._optimizer!r})"

    # ---- Horovod's extras ---------------------------------------------------------------

    def synchronize(self):
        """Finish every gradient's allreduce and write the averages into ``.grad``."""
        if not self._reduces():
            self._synchronized = True
            return
        with self._reducer.batch():
            buckets = {}
            for parameter in self._names:
                if parameter.requires_grad and parameter not in self._handles:
                    # no gradient here (unused branch, too few passes), or a CUDA bucket
                    # held for such a gradient: still take part
                    if parameter.grad is None:
                        view = self._views.get(parameter)
                        parameter.grad = torch.zeros_like(parameter) if view is None \
                            else view.zero_()
                    bucket = self._reducer.bucket_of(parameter)
                    if bucket is None:
                        self._start(parameter)
                    else:
                        buckets[bucket] = None
            for bucket in buckets:
                self._start_bucket(bucket)
        self._reducer.step_done()
        for parameter, (handle, ctx, payload, was_sparse) in self._handles.items():
            if handle is None:  # a member of a bucket reduced whole: its first member's handle
                continue
            if payload is _HOOKED:  # a comm hook's: the reduced flat vector, into the bucket
                comm_hooks.write_back(handle.wait(), ctx)
                continue
            if payload is _SPARSE:  # sparse_allreduce_async: the summed sparse gradient
                parameter.grad = mpi_ops.synchronize(handle)
                continue
            mpi_ops.synchronize(handle)
            if payload is not parameter.grad:
                parameter.grad.copy_(self._compression.decompress(payload, ctx))
            if was_sparse:  # sparse_as_dense: the optimizer gets a sparse gradient back
                parameter.grad = parameter.grad.to_sparse()
        self._handles.clear()
        self._synchronized = True
        if self._views and self._reducer.relayout_due():
            self._lay_out_again()

    def _lay_out_again(self):
        """New buckets in the order the engine runs the gradients' allreduces, each gradient
        moved into its new view (``layout.laid_out_again``)."""
        for views, buckets in laid_out_again(self._reducer, list(self._views),
                                             self._bucket_bytes):
            move_gradients(views)
            self._set_buckets(views, buckets, update=True)

    def _set_buckets(self, views, buckets, update=False):
        """Take the gradient ``views`` and their ``buckets`` (``layout.bucket_views``)."""
        if not update:
            self._views = {}
        self._views.update(views)
        self._reducer.take_buckets(buckets, self._starts_whole, self._bucket_bytes(), update)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate their gradients on this rank and reduce nothing,
        as DDP's ``no_sync()``: the first backward pass after it reduces the sum."""
        self._local = True
        try:
            yield
        finally:
            self._local = False

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use around step() after an explicit synchronize() (e.g. for gradient clipping)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    # ---- hooks --------------------------------------------------------------------------

    def _register_hooks(self):
        for group in self.param_groups:
            for parameter in group["params"]:
                self._hook(parameter)

    def _hook(self, parameter):
        if parameter.requires_grad:
            self._hooks.append(parameter.register_post_accumulate_grad_hook(self._on_gradient))

    def _on_gradient(self, parameter):
        view = self._views.get(parameter)
        grad = parameter.grad
        if view is not None and grad.layout == torch.strided and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)  # a new gradient tensor: into the bucket, and point .grad there
            parameter.grad = view
        if self._local:  # inside no_sync(): the gradient accumulates here, nothing starts
            return
        if self._group.size == 1:  # the survivors of a failure are this rank alone
            return
        ready = self._reducer.ready(parameter, parameter in self._handles)
        if ready is parameter:
            self._start(parameter)
        elif ready is not None:
            # a CUDA bucket starts whole, as DDP's do: one allreduce of the flat bucket where
            # it lies, instead of one per batch of early gradients (each device allreduce pays
            # a launch and an event wait per step, docs/gpu.md)
            self._start_bucket(ready)

    def _start_bucket(self, bucket):
        """Start every member of a whole bucket: one in-place allreduce of its flat tensor
        where the members' gradients are its views and reduced alike, else one per member,
        announced together."""
        if self._reducer.hook is not None:
            self._hand_to_hook(bucket)
            return
        members = bucket.members
        if self._flat_reduce and all(self._in_view(member) for member in members):
            handle = mpi_ops.compressed_allreduce_async_(
                bucket.flat, self._compression, name=bucket.name, op=self._op,
                prescale_factor=self._prescale, postscale_factor=self._postscale,
                process_set=self.process_set)
            self._handles[members[0]] = (handle, None, members[0].grad, False)
            for member in members[1:]:
                self._handles[member] = (None, None, member.grad, False)
            return
        with self._reducer.batch():
            for member in members:
                if member.grad is not None or member.requires_grad:
                    self._start(member)  # a member frozen since the layout has nothing

    def _hand_to_hook(self, bucket):
        """Give a whole bucket to the comm hook (its gradients moved into their views)."""
        members, flat = bucket.members, bucket.flat
        for member in members:
            if not self._in_view(member):
                grad = member.grad
                view = self._views[member]
                view.copy_(grad.to_dense() if grad.is_sparse else grad)
                member.grad = view
        array = as_numpy(flat, bfloat16=True) if flat.device.type == "cpu" else flat
        reduction = comm_hooks.Reduction(self._op, self._prescale, self._postscale,
                                         self.process_set)
        result = self._reducer.dispatch(bucket, flat, array, list(members),
                                        [tuple(member.shape) for member in members],
                                        reduction, comm_hooks.TORCH)
        self._handles[members[0]] = (result, flat, _HOOKED, False)
        for member in members[1:]:
            self._handles[member] = (None, None, member.grad, False)

    def _in_view(self, parameter):
        """The parameter's gradient is its view into its bucket (so the flat tensor holds it)."""
        grad = parameter.grad
        return (grad is not None and grad.layout == torch.strided
                and grad.data_ptr() == self._views[parameter].data_ptr())

    def _start(self, parameter):
        grad = parameter.grad
        if grad.is_sparse and not self._sparse_as_dense:
            if self._op not in (ops.Average, ops.Sum):
                raise ValueError(f"sparse gradients are reduced with Sum or Average, got "
                                 f"op={self._op}; pass sparse_as_dense=True for other ops")
            handle = mpi_ops.sparse_allreduce_async(
                grad, self._names[parameter], self._op, self.process_set,
                prescale_factor=self._prescale, postscale_factor=self._postscale)
            self._handles[parameter] = (handle, None, _SPARSE, True)
            return
        was_sparse = grad.is_sparse
        if was_sparse:
            grad = parameter.grad = grad.to_dense()
        payload, ctx = self._compression.compress(grad)
        handle = mpi_ops.compressed_allreduce_async_(
            payload, self._compression, name=self._names[parameter], op=self._op,
            prescale_factor=self._prescale, postscale_factor=self._postscale,
            process_set=self.process_set)
        self._handles[parameter] = (handle, ctx, payload, was_sparse)



_SPARSE = object()  # the payload of a gradient reduced as a sparse tensor (_handles)
_HOOKED = object()  # the payload of a bucket a comm hook reduces (_handles)
