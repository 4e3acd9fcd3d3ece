"""The ``hororing`` process group: torch.distributed's collectives run by hororing's engine.

One ``ProcessGroupHororing`` per torch group: the default group is hororing's global process
set, a subgroup a process set made by its members alone. Every call is named from the group's
own count (``naming.py``), so the engine's negotiation pairs the calls and catches mismatched
kinds, shapes and dtypes before data moves, as it does for hvd.* calls. Each call returns at
once with a Work whose future completes when hororing's handles do.
"""

import torch
import torch.distributed as dist

from ... import ops
from ...process_sets import global_process_set, group_of, members_process_set
from ...running import current
from ... import door, faults
from .. import async_ops
from ..bridge import TorchHandle, as_numpy, to_torch
from ..compression import Compression
from .naming import CallNames
from .peer import PointToPoint
from .work import DoneWork, HandlesWork

NAME = "hororing"
_SIXTEEN_BITS = {torch.float16: Compression.fp16, torch.bfloat16: Compression.bf16}

_RED = dist.ReduceOp.RedOpType
_OPS = {_RED.SUM: ops.Sum, _RED.AVG: ops.Average, _RED.PRODUCT: ops.Product,
        _RED.MIN: ops.Min, _RED.MAX: ops.Max, _RED.PREMUL_SUM: ops.Sum}


def reduction(reduce_op):
    """hororing's op and prescale factor for a torch ``ReduceOp`` (PREMUL_SUM: Sum of the
    tensors multiplied by its factor)."""
    kind = getattr(reduce_op, "op", reduce_op)
    op = _OPS.get(kind)
    if op is None:
        raise ValueError(f"the hororing backend reduces with SUM, AVG, PRODUCT, MIN, MAX and "
                         f"PREMUL_SUM; {kind} (a bitwise op) is not one of them: reduce integer "
                         f"masks with MAX (or) or MIN (and) instead")
    factor = 1.0
    if kind == _RED.PREMUL_SUM:
        factor = getattr(reduce_op, "factor", 1.0)
        factor = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    return op, factor


class ProcessGroupHororing(PointToPoint, dist.ProcessGroup):
    """A torch.distributed process group over a hororing process set.

    Args:
        rank, size: this process's rank in the group and the group's size.
        process_set: the hororing process set of the group's processes.
        job_ranks: each group rank's rank in hororing's job (``hvd.rank()`` numbering).
        name: the group's name, the prefix of every collective's name.
    """

    def __init__(self, rank, size, process_set, job_ranks, name):
        super().__init__(rank, size)
        self._set = process_set
        self._job_ranks = list(job_ranks)
        self._name = name
        self._names = CallNames(name)  # what each call is named (naming.py)
        # the group's own duplicate communicator for sends and receives (they never match the
        # engine's messages), made now: every member is here, and MPI_Comm_dup needs them all
        self._p2p = faults.track(group_of(process_set).comm.Dup())

    def getBackendName(self):
        return NAME

    # torch names each group after making it (DeviceMesh and FSDP2 look groups up by name)
    def setGroupName(self, name):
        self._group_name = name

    def getGroupName(self):
        return getattr(self, "_group_name", self._name)

    def setGroupDesc(self, description):
        self._group_desc = description

    def getGroupDesc(self):
        return getattr(self, "_group_desc", "")

    def __repr__(self):
        return f"<ProcessGroupHororing {self._name!r} rank {self.rank()} of {self.size()}>"

    # ---- naming and finishing -------------------------------------------------------------

    @property
    def names_repeat(self):
        """False: every call gets a name of its own that the engine's response cache never
        keeps (``CallNames.repeat``)."""
        return self._names.repeat

    @names_repeat.setter
    def names_repeat(self, repeat):
        self._names.repeat = repeat

    def _work(self, handles, finish):
        return HandlesWork(handles, finish, on_error=self._names.forget)

    def _job_rank(self, group_rank, what):
        if not 0 <= group_rank < len(self._job_ranks):
            raise ValueError(f"{what} {group_rank} is not a rank of this group (size "
                             f"{len(self._job_ranks)})")
        return self._job_ranks[group_rank]

    # ---- allreduce -------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        op, factor = reduction(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        blocking = not _opt(opts, "asyncOp", True) and len(tensors) == 1
        handles = [self._names.start("allreduce", tensor, lambda name: self._allreduce(
            tensor, name, op, factor, blocking)) for tensor in tensors]
        return self._work(handles, lambda results: tensors)

    def _allreduce(self, tensor, name, op, factor, blocking):
        """One tensor's in-place allreduce; a 16-bit float tensor's Sum or Average travels
        in 16 bits, as torch's backends send it (DDP's fp16_compress_hook halves the bytes)."""
        wire = _SIXTEEN_BITS.get(tensor.dtype)
        if wire is not None and op in (ops.Sum, ops.Average):
            return async_ops.compressed_allreduce_async_(tensor, wire, name, op, factor, 1.0,
                                                         self._set)
        return async_ops.start_allreduce(tensor, None, name, op, factor, 1.0, self._set,
                                         inplace=True, blocking=blocking)

    def allreduce_coalesced(self, tensors, opts=None):
        op, factor = reduction(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        if not tensors:
            return DoneWork(tensors)
        handle = self._names.start(f"allreduce_coalesced{len(tensors)}", tensors[0],
                             lambda name: async_ops.grouped_allreduce_async_(
                                 list(tensors), None, name, op, factor, 1.0, self._set))
        return self._work([handle], lambda results: tensors)

    def reduce(self, tensors, opts=None):
        """The reduction on every rank (an allreduce), kept by the root only: the others'
        tensors are left as they were."""
        root = self._job_rank(opts.rootRank, "rootRank")
        op, factor = reduction(opts.reduceOp)
        mine = current().rank == root
        work = [tensor if mine else tensor.clone() for tensor in tensors]
        handles = [self._names.start("reduce", tensor, lambda name: async_ops.start_allreduce(
            tensor, None, name, op, factor, 1.0, self._set, inplace=True)) for tensor in work]
        return self._work(handles, lambda results: tensors)

    # ---- broadcast -------------------------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        root = self._job_rank(_opt(opts, "rootRank", 0), "rootRank")
        handles = [self._names.start("broadcast", tensor, lambda name: async_ops.broadcast_async_(
            tensor, root, name, self._set)) for tensor in tensors]
        return self._work(handles, lambda results: tensors)

    # ---- allgather and gather --------------------------------------------------------------

    def allgather(self, output_lists, input_tensors, opts=None):
        handles, finishes = [], []
        for outputs, tensor in zip(output_lists, input_tensors):
            handles.append(self._gather_flat(tensor, "allgather"))
            finishes.append(outputs)
        return self._work(handles, lambda results: _split_into(results, finishes)
                           or output_lists)

    def _allgather_base(self, output, tensor, opts=None):
        if output.numel() != tensor.numel() * self.size():
            raise ValueError(f"all_gather_into_tensor: the output has {output.numel()} elements; "
                             f"it needs the input's {tensor.numel()} times the group's size "
                             f"{self.size()}")
        handle = self._gather_flat(tensor, "allgather_into_tensor", into=output)
        return self._work([handle], lambda results: _copy_flat(results[0], output))

    def allgather_into_tensor_coalesced(self, outputs, tensors, opts=None):
        handles = [self._gather_flat(tensor, "allgather_into_tensor", into=output)
                   for tensor, output in zip(tensors, outputs)]

        return self._work(handles, _copy_each(outputs))

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        handles = [self._gather_flat(tensor, "allgather_coalesced") for tensor in input_tensors]
        # output_lists[r][i]: rank r's i-th tensor
        per_tensor = [[outputs[index] for outputs in output_lists]
                      for index in range(len(input_tensors))]
        return self._work(handles, lambda results: _split_into(results, per_tensor)
                           or output_lists)

    def gather(self, output_lists, input_tensors, opts=None):
        root = self._job_rank(opts.rootRank, "rootRank")
        mine = current().rank == root
        handles = [self._gather_flat(tensor, "gather") for tensor in input_tensors]

        def finish(results):
            if mine:
                _split_into(results, output_lists)
            return output_lists
        return self._work(handles, finish)

    def _gather_flat(self, tensor, kind, into=None):
        """Every member's ``tensor``, flat, in rank order; ``into``: a tensor the engine
        gathers straight into where it can (a contiguous CPU tensor of the same dtype, not
        bfloat16), with no copy after."""
        flat = tensor.detach().reshape(-1)
        if (into is None or into.device.type != "cpu" or not into.is_contiguous()
                or into.dtype != flat.dtype or flat.dtype == torch.bfloat16
                or flat.device.type != "cpu"):
            return self._names.start(kind, flat, lambda name: async_ops.allgather_async(
                flat, name, self._set), rows_vary=True)
        target = into.detach().view(-1)

        def start(name):
            inner = door.start("allgather", as_numpy(flat), name, self._set,
                               into=target.numpy())
            return TorchHandle(inner, lambda result: target if result.ctypes.data ==
                               target.data_ptr() else to_torch(result, flat))
        return self._names.start(kind, flat, start, rows_vary=True)

    # ---- reduce_scatter --------------------------------------------------------------------

    def _reduce_scatter_base(self, output, tensor, opts=None):
        if tensor.numel() != output.numel() * self.size():
            raise ValueError(f"reduce_scatter_tensor: the input has {tensor.numel()} elements; "
                             f"it needs the output's {output.numel()} times the group's size "
                             f"{self.size()}")
        op, factor = reduction(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        handle = self._scatter_rows(tensor.detach().reshape(self.size(), -1), op, factor,
                                    "reduce_scatter_tensor")
        return self._work([handle], lambda results: _copy_flat(results[0], output))

    def reduce_scatter_tensor_coalesced(self, outputs, tensors, opts=None):
        op, factor = reduction(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        handles = []
        for output, tensor in zip(outputs, tensors):
            if tensor.numel() != output.numel() * self.size():
                raise ValueError(f"reduce_scatter_tensor_coalesced: an input of "
                                 f"{tensor.numel()} elements for an output of {output.numel()}"
                                 f" (needs {self.size()} times as many)")
            handles.append(self._scatter_rows(tensor.detach().reshape(self.size(), -1), op,
                                              factor, "reduce_scatter_tensor"))

        return self._work(handles, _copy_each(outputs))

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op, factor = reduction(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        handles = []
        for output, inputs in zip(outputs, input_lists):
            if len(inputs) != self.size():
                raise ValueError(f"reduce_scatter takes one input per rank of the group "
                                 f"({self.size()}), got {len(inputs)}")
            if any(part.numel() != output.numel() for part in inputs):
                raise ValueError(f"reduce_scatter: every input must have the output's "
                                 f"{output.numel()} elements, got "
                                 f"{[part.numel() for part in inputs]}")
            rows = torch.stack([part.detach().reshape(-1) for part in inputs])
            handles.append(self._scatter_rows(rows, op, factor, "reduce_scatter"))

        return self._work(handles, _copy_each(outputs))

    def _scatter_rows(self, rows, op, factor, kind):
        """Row r of ``rows`` (one per rank) reduced over the group, to rank r: hororing's
        reducescatter for Sum and Average; for the other ops the whole is allreduced and
        this rank keeps its row."""
        if op in (ops.Sum, ops.Average):
            rows = rows.contiguous()
            return self._names.start(kind, rows, lambda name: async_ops.reducescatter_async(
                rows, name, op, self._set, factor, 1.0))
        mine = self.rank()
        rows = rows.contiguous()
        handle = self._names.start(kind, rows, lambda name: async_ops.start_allreduce(
            rows, None, name, op, factor, 1.0, self._set, inplace=False))
        inner_finish = handle.finish
        handle.finish = lambda result: inner_finish(result)[mine]
        return handle

    # ---- scatter and all-to-all ------------------------------------------------------------

    def scatter(self, outputs, input_lists, opts=None):
        self._job_rank(opts.rootRank, "rootRank")
        root_index = opts.rootRank
        handles = []
        for index, output in enumerate(outputs):
            if self.rank() == root_index:
                parts = input_lists[index]
                if len(parts) != self.size():
                    raise ValueError(f"scatter takes one input per rank of the group "
                                     f"({self.size()}), got {len(parts)}")
                flat = torch.cat([part.detach().reshape(-1) for part in parts])
                splits = [part.numel() for part in parts]
            else:
                flat = output.new_empty(0)
                splits = [0] * self.size()
            handles.append(self._names.start(
                "scatter", output, lambda name: async_ops.alltoall_async(
                    flat, splits, name, self._set), rows_vary=True))

        def finish(results):
            for (received, _splits), output in zip(results, outputs):
                _copy_flat(received, output)
            return outputs
        return self._work(handles, finish)

    def alltoall_base(self, output, tensor, output_splits, input_splits, opts=None):
        if tensor.dim() == 0:
            raise ValueError("all_to_all_single needs tensors with at least one dimension")
        rows = list(input_splits) if input_splits else None
        if rows is None and tensor.shape[0] % self.size():
            raise ValueError(f"all_to_all_single without input_split_sizes splits the first "
                             f"dimension evenly: {tensor.shape[0]} rows do not split among "
                             f"{self.size()} ranks; pass input_split_sizes")
        contiguous = tensor.detach().contiguous()
        handle = self._names.start(
            "all_to_all_single", contiguous, lambda name: async_ops.alltoall_async(
                contiguous, rows, name, self._set), rows_vary=True)

        def finish(results):
            received, splits = results[0]
            if output_splits and list(output_splits) != splits.tolist():
                raise ValueError(f"all_to_all_single: output_split_sizes {list(output_splits)} "
                                 f"differ from what the ranks sent ({splits.tolist()})")
            if received.numel() != output.numel():
                raise ValueError(f"all_to_all_single: {received.numel()} elements arrived for "
                                 f"an output of {output.numel()}")
            _copy_flat(received, output)
            return [output]
        return self._work([handle], finish)

    def alltoall(self, outputs, inputs, opts=None):
        if len(inputs) != self.size() or len(outputs) != self.size():
            raise ValueError(f"all_to_all takes one input and one output per rank of the group "
                             f"({self.size()}), got {len(inputs)} and {len(outputs)}")
        flat = torch.cat([part.detach().reshape(-1) for part in inputs])
        splits = [part.numel() for part in inputs]
        handle = self._names.start("all_to_all", flat, lambda name: async_ops.alltoall_async(
            flat, splits, name, self._set), rows_vary=True)

        def finish(results):
            received, got = results[0]
            expected = [output.numel() for output in outputs]
            if got.tolist() != expected:
                raise ValueError(f"all_to_all: the ranks sent {got.tolist()} elements for "
                                 f"outputs of {expected}")
            for part, output in zip(torch.split(received, expected), outputs):
                _copy_flat(part, output)
            return outputs
        return self._work([handle], finish)

    # torch.distributed's own names for the single-tensor forms (its Python calls these)
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # ---- barrier ---------------------------------------------------------------------------

    def barrier(self, opts=None):
        handle = door.start("barrier", process_set=self._set)
        return self._work([_Raw(handle)], lambda results: [])


class _Raw:
    """A bare engine handle (a barrier's) in the shape of a TorchHandle."""

    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner

    def finish(self, result):
        return result


def _opt(opts, name, default):
    return default if opts is None else getattr(opts, name, default)


def _copy_flat(result, output):
    if result.data_ptr() == output.data_ptr():  # gathered into the output itself
        return output
    output.view(-1).copy_(result.reshape(-1)) if output.is_contiguous() else \
        output.copy_(result.reshape(output.shape))
    return output


def _copy_each(outputs):
    """A finish laying each result into its output tensor, in order."""
    def finish(results):
        for result, output in zip(results, outputs):
            _copy_flat(result, output)
        return outputs
    return finish


def _split_into(results, output_lists):
    """Each gathered (flat, every rank's piece in rank order) result into its list of output
    tensors, one per rank."""
    for result, outputs in zip(results, output_lists):
        sizes = [output.numel() for output in outputs]
        if sum(sizes) != result.numel():
            raise ValueError(f"all_gather: the ranks sent {result.numel()} elements in all for "
                             f"outputs of {sizes}")
        for part, output in zip(torch.split(result, sizes), outputs):
            _copy_flat(part, output)
    return None


def make(options, backend_options=None):
    """torch.distributed's creator for the ``hororing`` backend (``extended_api``): the
    default group over every rank of hororing's job, a subgroup over its members' process
    set."""
    from ... import context
    context.init()
    job = current()
    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    name = str(options.group_id)
    if not options.global_ranks_in_group:  # the default group: the whole job, same numbering
        if options.group_size != job.size or options.group_rank != job.rank:
            raise ValueError(
                f"the hororing backend runs over MPI's processes: this one is rank {job.rank} of "
                f"{job.size}, but torch.distributed was told rank {options.group_rank} of "
                f"{options.group_size}. Start it under mpirun/hororun/srun and leave rank and "
                f"world_size out of init_process_group (or pass hvd.rank(), hvd.size())")
        process_set = global_process_set
    elif ranks == list(range(job.size)):
        process_set = global_process_set
    else:
        process_set = members_process_set(ranks)
    return ProcessGroupHororing(options.group_rank, options.group_size, process_set, ranks,
                                name)
