"""Sharded optimizer state (ZeRO stage 1) on the ring's two halves.

A ring allreduce is a reduce-scatter followed by an allgather. Between the two halves each
rank holds the averaged gradient of 1/n of the parameters: it steps the optimizer on that
slice only, and the allgather then spreads the updated parameters instead of the gradients.
The bytes on the wire are an allreduce's; the optimizer's state (Adam: two values per
parameter) and its compute are divided by n.

Each parameter group's parameters that need gradients are, per dtype, one flat vector,
split as ``reducescatter`` splits (the first ``numel % n`` ranks one element more). The
wrapped optimizer is rebuilt over this rank's slices (leaf tensors viewing the slice, the
group's hyperparameters kept), so ``optimizer.state`` holds this rank's slices only. That is
exact for optimizers whose step is elementwise per parameter; the others are refused.
"""

import inspect

import torch

from .. import ops, transport
from ..context import current
from ..process_sets import global_process_set, group_of
from ..zero import Halves, Layout
from . import mpi_ops
from .bridge import zeros
from .compression import Compression
from .functions import refuse_uninitialized
from .wrapping import WrappingOptimizer

# whose step treats each element on its own (a slice steps as the whole tensor would)
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta",
    "ASGD", "Rprop") if hasattr(torch.optim, name))


def check_elementwise(optimizer_class):
    """Refuse an optimizer class whose step needs whole tensors (norms, factored moments,
    a line search): stepped on slices it would compute something else."""
    if not issubclass(optimizer_class, ELEMENTWISE):
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE)
        raise ValueError(
            f"a sharded optimizer steps each rank's slice of the parameters, which is exact only "
            f"for optimizers whose step is elementwise ({names}); {optimizer_class.__name__} is "
            f"not one of them. Use DistributedOptimizer without sharded=True for it.")


class _Slice:
    """One group's parameters of one dtype, as one flat vector: this rank's slice of it."""

    def __init__(self, parameters, rank, size):
        self.parameters = parameters
        self.numel = sum(parameter.numel() for parameter in parameters)
        self.layout = Layout(self.numel, parameters[0].element_size(), rank, size)
        self.start, self.stop = self.layout.start, self.layout.stop
        # The parameters move into one flat vector (each parameter's data a view into it):
        # the wrapped optimizer steps leaf tensors over this rank's slice of that vector, so
        # the step updates the model in place, and the allgather fills the rest in place.
        # The gradients live in another flat vector (each .grad a view into it, as DDP's
        # gradient_as_bucket_view), which the step scatter-reduces in place.
        dtype = parameters[0].dtype
        self.values = zeros(self.numel, dtype)
        self.gradients = zeros(self.numel, dtype)
        self.views = {}
        offset = 0
        with torch.no_grad():
            for parameter in parameters:
                count = parameter.numel()
                data = self.values[offset:offset + count].view_as(parameter)
                data.copy_(parameter.detach())
                parameter.data = data
                self.views[parameter] = self.gradients[offset:offset + count].view_as(parameter)
                offset += count
        # the slice in parts of at most _PART elements, each its own leaf for the optimizer:
        # torch's CPU optimizers step tensor by tensor with temporaries of the tensor's size,
        # so one leaf over the whole slice would raise the step's peak memory by the slice
        cuts = list(range(self.start, self.stop, _PART)) + [self.stop]
        self.part_bounds = list(zip(cuts[:-1], cuts[1:])) or [(self.start, self.stop)]
        self.parts = [torch.nn.Parameter(self.values[low:high])
                      for low, high in self.part_bounds]

    def into_view(self, parameter):
        """Point ``parameter.grad`` at its view, copying a gradient autograd made anew
        (after ``zero_grad(set_to_none=True)``) into it; later passes accumulate there."""
        grad, view = parameter.grad, self.views[parameter]
        if grad is not None and grad.layout == torch.strided and \
                grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            parameter.grad = view

    def flat_gradient(self):
        """Every parameter's gradient, flat and in order (zeros where there is none: every
        rank must contribute, as DistributedOptimizer does for an unused parameter)."""
        for parameter, view in self.views.items():
            grad = parameter.grad
            if grad is None:
                view.zero_()
            elif grad.is_sparse:
                raise ValueError("a sharded optimizer takes dense gradients; this parameter's "
                                 "is sparse (use DistributedOptimizer without sharded=True)")
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
        return self.gradients

    def split(self, flat):
        """``flat`` (this group's full vector) as one tensor per parameter, shaped like it."""
        offset, parts = 0, []
        for parameter in self.parameters:
            count = parameter.numel()
            parts.append(flat[offset:offset + count].view_as(parameter).clone())
            offset += count
        return parts


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# 16-bit gradients are summed in float32 on the ring, as the engine sums them, and rounded back
_CARRIED = (torch.float16, torch.bfloat16)
_COMPRESSIONS = (Compression.none, Compression.fp16, Compression.bf16)
# The elements of one leaf the wrapped optimizer steps (see _Slice): 4 Mi (16 MiB of float32),
# the size of a large layer, so a step's temporaries stay a layer's size.
_PART = 1 << 22


def _sliced(key, value):
    """State kept per element (sliced with the parameters), not a per-tensor scalar such as
    Adam's ``step``."""
    return torch.is_tensor(value) and key != "step"


class ShardedOptimizer(WrappingOptimizer):
    """``DistributedOptimizer(optimizer, sharded=True)``: see the module's docstring.

    ``param_groups`` are the rebuilt optimizer's (a group's ``params`` are this rank's
    slices, its hyperparameters the original group's: LR schedulers work on them). Between
    backward and ``step()`` each ``.grad`` is a view into its group's flat gradient vector
    (clip or read it there, e.g. with ``clip_grad_norm_``); ``step()`` reduces that vector in
    place and leaves every ``.grad`` None. Each parameter's data is a view into its group's flat
    parameter vector from construction on (the step updates it in place).
    ``state`` holds this rank's slices; ``state_dict()`` gathers the full state in the
    wrapped optimizer's own format, and ``load_state_dict`` takes one (saved sharded or not).
    """

    shards_state = True  # each rank's state is a slice (broadcast_optimizer_state asks)

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step=1, op=ops.Average, gradient_predivide_factor=1.0,
                 process_set=global_process_set):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        check_elementwise(type(optimizer))
        compression = compression or Compression.none
        if compression not in _COMPRESSIONS:
            raise ValueError(f"sharded=True compresses gradients with hvd.Compression.none, "
                             f".fp16 or .bf16 (elementwise casts: each rank decompresses its "
                             f"own slice); got {compression!r}")
        if op not in (ops.Average, ops.Sum):
            raise ValueError(f"sharded=True reduces gradients with Average or Sum, got "
                             f"op={op}")
        if gradient_predivide_factor != 1.0 and op != ops.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        # checked only: backward passes accumulate in the gradient vector, and step()
        # reduces whatever has accumulated
        if backward_passes_per_step <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got "
                             f"{backward_passes_per_step}")
        originals = [parameter for group in optimizer.param_groups for parameter in
                     group["params"]]
        names = dict((parameter, name) for name, parameter in (named_parameters or ()))
        refuse_uninitialized([(names.get(parameter, f"parameter {index}"), parameter)
                              for index, parameter in enumerate(originals)],
                             "DistributedOptimizer(sharded=True)")
        for parameter in originals:
            if parameter.device.type != "cpu" or parameter.layout != torch.strided:
                raise ValueError("sharded=True takes dense CPU parameters for now; found one on "
                                 f"{parameter.device} ({parameter.layout})")
            if parameter.requires_grad and parameter.dtype not in _DTYPES:
                raise ValueError(f"sharded=True takes floating point parameters (float16, "
                                 f"bfloat16, float32, float64); found {parameter.dtype}")
        if process_set is not None and not process_set.included():
            raise ValueError("sharded=True on a rank outside the optimizer's process_set: every "
                             "rank that steps it must be in the set")
        self.process_set = process_set
        self._group = group_of(process_set)
        self._op = op
        self._compression = compression
        self._prescale = 1.0 / gradient_predivide_factor
        self._postscale = gradient_predivide_factor
        self._original = optimizer
        self._originals = originals
        rank, size = self._group.rank, self._group.size
        # the step's two halves (zero.py), on a communicator of their own
        self._halves = Halves(self._group, current().config.subchunk_bytes(across_nodes=False))
        self._slices = []  # per group: [_Slice per dtype]
        groups = []
        for group in optimizer.param_groups:
            trained = [parameter for parameter in group["params"] if parameter.requires_grad]
            by_dtype = {}
            for parameter in trained:
                by_dtype.setdefault(parameter.dtype, []).append(parameter)
            slices = [_Slice(members, rank, size) for members in by_dtype.values()]
            self._slices.append(slices)
            hyper = {key: value for key, value in group.items() if key != "params"}
            groups.append({**hyper, "params": [part for piece in slices
                                               for part in piece.parts]})
        # the same class and defaults over this rank's slices: its state exists for them only
        self._check_same_layout()
        self._hooks = [parameter.register_post_accumulate_grad_hook(piece.into_view)
                       for slices in self._slices for piece in slices
                       for parameter in piece.parameters]
        accepted = inspect.signature(type(optimizer)).parameters
        self._wrap(type(optimizer)(groups, **{
            key: value for key, value in optimizer.defaults.items() if key in accepted}))
        if optimizer.state:  # e.g. restored from a checkpoint before wrapping: keep a slice
            self.load_state_dict(optimizer.state_dict())

    def __repr__(self):
        return f"DistributedOptimizer({self._original!r}, sharded=True)"

    def _label(self, group_index, piece, what):
        return f"sharded.{group_index}.{str(piece.values.dtype).split('.')[-1]}.{what}"

    def _check_same_layout(self):
        """Every rank must shard the same parameters: compared before any data moves."""
        self._halves.check_same([[(str(piece.values.dtype), piece.numel) for piece in slices]
                                 for slices in self._slices],
                                "parameters (per group: dtype, elements)")

    def step(self, closure=None):
        """Reduce-scatter the gradients, step this rank's slices, allgather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = []
        with transport.activity("sharded optimizer step"):
            for slices in self._slices:
                for piece in slices:
                    flat = piece.flat_gradient()
                    self._reduce(flat, piece.layout)
                    for part, (low, high) in zip(piece.parts, piece.part_bounds):
                        part.grad = flat[low:high]
                    stepped.append(piece)
            self._optimizer.step()
            for piece in stepped:  # each rank's updated slice, into every rank's vector
                self._halves.gather(piece.values.view(torch.uint8).numpy(), piece.layout)
                for part in piece.parts:
                    part.grad = None
                for parameter in piece.parameters:  # their views are partial sums now
                    parameter.grad = None
        return loss

    def _reduce(self, flat, layout):
        """Scatter-reduce the flat gradient vector; this rank's slice of it ends reduced.

        A float16 or bfloat16 vector is summed as float32 and its slice rounded back.
        Compressed, the payload ``compression.compress`` makes of the vector travels instead
        (bfloat16, which numpy lacks, carried as float32), as the unsharded optimizer sends
        it: a 16-bit wire sum is divided by the ranks before it (it could overflow where the
        average would not); this rank's slice is then decompressed into the vector. Alone,
        nothing is sent and nothing is compressed, as with the unsharded optimizer.
        """
        compressing = self._compression is not Compression.none and self._halves.size > 1
        payload, ctx = self._compression.compress(flat) if compressing else (flat, None)
        wire = self._compression.wire if compressing else ""
        carried = payload.float() if payload.dtype in _CARRIED and not wire else payload
        mine = self._halves.reduce(carried.numpy(), layout, self._op, self._prescale,
                                   self._postscale, wire=wire,
                                   dtype="float16" if payload.dtype == torch.float16 else None)
        if carried is not flat:  # this rank's slice back into the vector, in its dtype
            reduced = torch.from_numpy(mine).to(payload.dtype)
            flat[layout.start:layout.stop] = self._compression.decompress(reduced, ctx)

    def zero_grad(self, set_to_none=True):
        """Clear the model's gradients (and the slices' reduced ones)."""
        for parameter in self._originals:
            if parameter.grad is None:
                continue
            if set_to_none:
                parameter.grad = None
            else:
                parameter.grad.detach_()
                parameter.grad.zero_()
        self._optimizer.zero_grad(set_to_none=True)

    def synchronize(self):
        """Nothing to wait for: the gradients are reduced inside ``step()``."""

    def skip_synchronize(self):
        raise RuntimeError("sharded=True reduces the gradients inside step(), so there is no "
                           "separate synchronize() to skip")

    def add_param_group(self, param_group):
        raise NotImplementedError("add_param_group on a sharded optimizer: pass every group "
                                  "to the optimizer before wrapping it")

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self):
        """The full state, as the wrapped optimizer's own ``state_dict()`` gives it (every
        rank gathers every slice: collective, every rank must call it)."""
        return self.gather_state_dict()

    def gather_state_dict(self):
        """``state_dict()`` of ``DistributedOptimizer(sharded=True)``, on every rank."""
        inner = self._optimizer.state_dict()
        full_state = {}
        index_of = {parameter: index for index, parameter in enumerate(self._originals)}
        position = 0  # the inner optimizer's parameter index, as state_dict numbers them
        for group_index, slices in enumerate(self._slices):
            for piece in slices:
                states = [inner["state"].get(position + index, {})
                          for index in range(len(piece.parts))]
                position += len(piece.parts)
                gathered = self._gather_state(group_index, piece, states)
                for offset, parameter in enumerate(piece.parameters):
                    full_state[index_of[parameter]] = {
                        key: (value[offset] if isinstance(value, list) else value)
                        for key, value in gathered.items()}
        groups = []
        for group, original in zip(inner["param_groups"], self._original.param_groups):
            groups.append({**{key: value for key, value in group.items() if key != "params"},
                           "params": [index_of[parameter] for parameter in original["params"]]})
        return {"state": full_state, "param_groups": groups}

    def _gather_state(self, group_index, piece, states):
        """key -> per-parameter full tensors (list) for sliced state, the value itself for
        scalars (the same on every rank). ``states``: the state of each of the slice's
        parts, in order."""
        gathered = {}
        for key in sorted(states[0]):
            value = states[0][key]
            if _sliced(key, value) and value.dim() == 1:
                mine = torch.cat([state[key].detach() for state in states])
                full = mpi_ops.allgather(mine, name=self._label(
                    group_index, piece, f"state.{key}"), process_set=self.process_set)
                gathered[key] = piece.split(full)
            else:
                gathered[key] = value.clone() if torch.is_tensor(value) else value
        return gathered

    def load_state_dict(self, state_dict):
        """Take a full state (from ``state_dict()`` here or of the unsharded optimizer) and
        keep this rank's slices of it."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self._slices):
            raise ValueError(f"the state has {len(groups)} parameter groups, this optimizer "
                             f"{len(self._slices)}")
        # both number the parameters by their position over the groups, frozen ones included
        index_of = {parameter: index for index, parameter in enumerate(self._originals)}
        state = state_dict["state"]
        inner_state, position = {}, 0
        for group_index, slices in enumerate(self._slices):
            for piece in slices:
                per_parameter = []
                for parameter in piece.parameters:
                    per_parameter.append(state.get(index_of[parameter]) or {})
                keys = set().union(*per_parameter) if per_parameter else set()
                entries = [{} for _ in piece.parts]
                for key in keys:
                    values = [saved.get(key) for saved in per_parameter]
                    if all(_sliced(key, value) and value.shape == parameter.shape
                           for value, parameter in zip(values, piece.parameters)):
                        flat = torch.cat([value.reshape(-1) for value in values])
                        for entry, (low, high) in zip(entries, piece.part_bounds):
                            entry[key] = flat[low:high].clone()
                    else:  # a per-tensor value (Adam's step, which it counts up in place)
                        for entry in entries:
                            entry[key] = values[0].clone() if torch.is_tensor(values[0]) \
                                else values[0]
                for entry in entries:
                    if entry:
                        inner_state[position] = entry
                    position += 1
        inner_groups = []
        for group, slices, inner in zip(groups, self._slices,
                                        self._optimizer.state_dict()["param_groups"]):
            inner_groups.append({**{key: value for key, value in group.items()
                                    if key != "params"}, "params": inner["params"]})
        self._optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})


class ZeroRedundancyOptimizer(ShardedOptimizer):
    """``torch.distributed.optim.ZeroRedundancyOptimizer`` over hororing's ranks.

    Args:
        params: the parameters (or parameter groups) to optimize.
        optimizer_class: an elementwise torch.optim class (SGD, Adam, AdamW, ...).
        process_group: not used (the ranks of ``process_set`` take part; every rank by default).
        parameters_as_bucket_view, overlap_with_ddp: accepted for compatibility, not used.
        **defaults: the optimizer's arguments (lr=...).

    Gradients are averaged across ranks inside ``step()`` (a DDP user's gradients arrive
    averaged already: pass ``op=hvd.Sum`` in ``defaults`` is not possible, so use it without DDP,
    as the optimizer that averages them).
    """

    def __init__(self, params, optimizer_class, process_group=None,
                 parameters_as_bucket_view=False, overlap_with_ddp=False,
                 process_set=global_process_set, **defaults):
        check_elementwise(optimizer_class)
        super().__init__(optimizer_class(params, **defaults), process_set=process_set)
        self._consolidated = None

    def consolidate_state_dict(self, to=0):
        """Gather the full state onto rank ``to`` (collective: every rank calls it)."""
        full = self.gather_state_dict()
        self._consolidated = full if self._group.rank == to else None
        self._consolidated_to = to

    def state_dict(self):
        """The state gathered by ``consolidate_state_dict`` (on that rank only)."""
        if self._consolidated is None:
            raise RuntimeError("Optimizer state has not been consolidated on this rank. Please "
                               "call `consolidate_state_dict(to=<rank>)` on all ranks first, "
                               "then state_dict() on that rank")
        return self._consolidated
