"""Sharded optimizer state (ZeRO stages 1 and 2) on the ring's two halves.

A ring allreduce is a reduce-scatter followed by an allgather. Between the two halves each
rank holds the averaged gradient of 1/n of the parameters: it steps the optimizer on that
slice only, and the allgather then spreads the updated parameters instead of the gradients.
The bytes on the wire are an allreduce's; the optimizer's state (Adam: two values per
parameter) and its compute are divided by n.

Each parameter group's parameters that need gradients are, per dtype, one flat vector, cut
into buckets of whole parameters (at most ``_BUCKET_BYTES``, a larger parameter alone); each
bucket is split as ``reducescatter`` splits (the first ``numel % n`` ranks one element more),
and a rank's slice is its chunk of every bucket. A bucket's reduce-scatter starts in the
engine (``reducescatter_async_``, in the bucket's own gradient vector, named) as soon as
backward has accumulated the last of its parameters' gradients, so it overlaps the rest of
backward; ``step()`` waits for them, steps, and allgathers the parameters bucket by bucket.
Stage 2 (``sharded=2``) lets a bucket's gradient vector go once its reduction is collected
(reused by the next bucket), so between steps a rank holds its 1/n of the gradients.

Where the vectors, buckets and stage 2's pool live is ``shard_layout.py``; this module is
the optimizer over them. The wrapped optimizer is rebuilt over this rank's chunks (leaf
tensors viewing them, the group's hyperparameters kept), so ``optimizer.state`` holds this
rank's chunks only. That is exact for optimizers whose step is elementwise per parameter;
the others are refused.
"""

import collections
import contextlib
import functools
import inspect
import itertools
import math

import torch

from .. import collectives, ops, transport
from ..process_sets import global_process_set, group_of
from ..reducer import Reducer
from ..zero import ParameterGather
from . import mpi_ops, shard_state
from .amp import all_finite
from .bridge import as_numpy, from_numpy
from .compression import Compression
from .functions import refuse_uninitialized
from .shard_layout import GroupVector
from .wrapping import WrappingOptimizer

# whose step treats each element on its own (a slice steps as the whole tensor would)
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta",
    "ASGD", "Rprop") if hasattr(torch.optim, name))


def check_elementwise(optimizer_class):
    """Refuse an optimizer class whose step needs whole tensors (norms, factored moments,
    a line search): stepped on chunks it would compute something else."""
    if not issubclass(optimizer_class, ELEMENTWISE):
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE)
        raise ValueError(
            f"a sharded optimizer steps each rank's slice of the parameters, which is exact only "
            f"for optimizers whose step is elementwise ({names}); {optimizer_class.__name__} is "
            f"not one of them. Use DistributedOptimizer without sharded=True for it.")


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_COMPRESSIONS = (Compression.none, Compression.fp16, Compression.bf16)
# The most gradient bytes reduce-scattered together: a bucket's reduce-scatter starts once
# its last parameter's gradient is ready, so smaller buckets start sooner during backward and
# larger ones pay the fixed cost of a collective less often (torch DDP's default is 25 MiB).
_BUCKET_BYTES = 16 << 20
_INSTANCES = itertools.count()
# Stage 2 keeps this many bucket-sized gradient vectors between steps (per group vector),
# reused by the next step's first buckets; more are made while more buckets are in flight at once.
_KEEP = 2
# The elements of one leaf the wrapped optimizer steps (shard_layout.GroupVector): 4 Mi
# (16 MiB of float32),
# the size of a large layer, so a step's temporaries stay a layer's size.
_LEAF_ELEMENTS = 1 << 22


class ShardedOptimizer(WrappingOptimizer):
    """``DistributedOptimizer(optimizer, sharded=True)``: see the module's docstring.

    ``param_groups`` are the rebuilt optimizer's (a group's ``params`` are this rank's
    chunks, its hyperparameters the original group's: LR schedulers work on them). During
    backward each ``.grad`` is a view into its bucket's gradient vector, and once the
    bucket's last gradient is in, the bucket is reduced and the model's ``.grad`` are set to
    None: the gradient then exists only as each rank's reduced slice. Clip it with
    ``clip_grad_norm_`` (after backward, before ``step()``), not through the model's
    ``.grad``. Each parameter's data is a view into its group's flat parameter vector from
    construction on (the step updates it in place).
    ``state`` holds this rank's chunks; ``state_dict()`` gathers the full state in the
    wrapped optimizer's own format, and ``load_state_dict`` takes one (saved sharded or not).
    """

    shards_state = True  # each rank's state is a slice (broadcast_optimizer_state asks)

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step=1, op=ops.Average, gradient_predivide_factor=1.0,
                 process_set=global_process_set, stage=1):
        if isinstance(stage, float) or stage not in (1, 2):  # True is 1
            raise ValueError(f"sharded= takes True or 1 (optimizer state sharded) or 2 (the "
                             f"gradients too, once reduced), got {stage!r}")
        stage = int(stage)
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
        originals = [parameter for group in optimizer.param_groups for parameter in
                     group["params"]]
        given = dict((parameter, name) for name, parameter in (named_parameters or ()))
        names = {parameter: given.get(parameter, f"parameter {index}")
                 for index, parameter in enumerate(originals)}
        refuse_uninitialized([(name, parameter) for parameter, name in names.items()],
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
        self.stage = stage
        # the passes counted and each bucket's readiness (hororing/reducer.py)
        self._reducer = Reducer(names, backward_passes_per_step, process_set)
        self._synchronized = False  # this step's reduce-scatters are done
        self._in_flight = collections.deque()  # (group vector, bucket) launched, not collected
        self._reducing = False  # a reduce-scatter was launched since the last synchronize
        rank, size = self._group.rank, self._group.size
        # the allgather of the parameters (zero.py), on a communicator of its own; the
        # reduce-scatters go through the engine (named, so ranks may launch them in any order)
        self._gather = ParameterGather(self._group)
        self._prefix = f"sharded{next(_INSTANCES)}"  # constructed in one order on every rank
        self._vectors = []  # per group: [shard_layout.GroupVector per dtype]
        groups = []
        for group in optimizer.param_groups:
            trained = [parameter for parameter in group["params"] if parameter.requires_grad]
            by_dtype = {}
            for parameter in trained:
                by_dtype.setdefault(parameter.dtype, []).append(parameter)
            vectors = [GroupVector(members, rank, size, _BUCKET_BYTES, stage, _LEAF_ELEMENTS)
                      for members in by_dtype.values()]
            self._vectors.append(vectors)
            hyper = {key: value for key, value in group.items() if key != "params"}
            groups.append({**hyper, "params": [leaf for vector in vectors
                                               for leaf in vector.leaves]})
        self._reducer.take_buckets([(bucket.parameters, bucket) for vectors in self._vectors
                                    for vector in vectors for bucket in vector.buckets],
                                   whole=lambda parameters: True)
        # the same class and defaults over this rank's chunks: its state exists for them only
        self._check_same_layout()
        self._hooks = [parameter.register_post_accumulate_grad_hook(
            functools.partial(self._accumulated, group_index, vector))
            for group_index, vectors in enumerate(self._vectors) for vector in vectors
            for parameter in vector.parameters]
        accepted = inspect.signature(type(optimizer)).parameters
        self._wrap(type(optimizer)(groups, **{
            key: value for key, value in optimizer.defaults.items() if key in accepted}))
        if optimizer.state:  # e.g. restored from a checkpoint before wrapping: keep a slice
            self.load_state_dict(optimizer.state_dict())

    def __repr__(self):
        return f"DistributedOptimizer({self._original!r}, sharded={self.stage})"

    def _label(self, group_index, vector, what):
        return f"{self._prefix}.{group_index}.{str(vector.dtype).split('.')[-1]}.{what}"

    def _check_same_layout(self):
        """Every rank must shard the same parameters: compared before any data moves."""
        self._gather.check_same([[(str(vector.dtype), vector.numel,
                                   vector.buckets_layout.ranges)
                                  for vector in vectors] for vectors in self._vectors],
                                "parameters (per group: dtype, elements, buckets)")

    # ---- the first half: reduce-scatters launched as gradients become ready -----------------

    def _accumulated(self, group_index, vector, parameter):
        """After a parameter's gradient is accumulated (a backward hook): its bucket's
        reduce-scatter starts once every parameter of the bucket has had its last pass."""
        bucket = vector.bucket_of[parameter]
        ready = self._reducer.ready(parameter, bucket.launched is not None or bucket.collected)
        vector.into_view(parameter)
        if ready is not None:
            self._launch(group_index, vector, ready.flat)
        # buckets whose reduction is done give their vector back (stage 2) for the next ones
        while self._in_flight and self._in_flight[0][1].launched[0].done():
            self._collect(*self._in_flight.popleft())

    def _launch(self, group_index, vector, bucket):
        """Start the bucket's reduce-scatter in its own gradient vector (in the engine's
        background, overlapping the rest of backward). The model's ``.grad`` of its
        parameters are let go: nothing may touch the vector while it is reduced.

        A float16 or bfloat16 vector is summed as float32 and rounded back (bfloat16 carried
        as a float32 copy). Compressed, the payload ``compression.compress`` makes of the
        vector travels instead, as the unsharded optimizer sends it (16 bits on the wire,
        every hop's sum in float32): a 16-bit wire sum is divided by the ranks before it (it
        could overflow where the average would not). Alone, nothing is compressed, as with the
        unsharded optimizer."""
        flat = vector.fill(bucket)
        for parameter in bucket.parameters:
            parameter.grad = None
        compressing = self._compression is not Compression.none and self._group.size > 1
        payload, ctx = self._compression.compress(flat) if compressing else (flat, None)
        wire = self._compression.wire if compressing else ""
        # a bfloat16 vector of the model's own is summed as float32; a compressor's
        # bfloat16 payload travels as it is
        carried = payload.float() if payload.dtype == torch.bfloat16 and not wire else payload
        handle = collectives.reducescatter_async_(
            as_numpy(carried, bfloat16=True),
            self._label(group_index, vector, f"bucket{bucket.index}"),
            self._op, self.process_set, self._prescale, self._postscale, wire=wire)
        bucket.launched = (handle, payload.dtype, ctx if compressing else None)
        self._in_flight.append((vector, bucket))
        self._synchronized, self._reducing = False, True

    def synchronize(self):
        """Wait for the gradients' reduce-scatters (starting those of buckets whose gradients
        were not all computed: missing ones count as zeros), so that this rank holds its
        slice of the reduced gradients. ``step()`` calls it; call it first to clip them
        (``clip_grad_norm_``)."""
        if self._synchronized:
            return
        with transport.activity("sharded optimizer: the gradients' reduce-scatters"):
            # what is in flight first: its vectors are free again for the buckets left
            while self._in_flight:
                self._collect(*self._in_flight.popleft())
            for group_index, vectors in enumerate(self._vectors):
                for vector in vectors:
                    for bucket in vector.buckets:
                        if bucket.launched is None and not bucket.collected:
                            self._launch(group_index, vector, bucket)
            while self._in_flight:
                self._collect(*self._in_flight.popleft())
            for vectors in self._vectors:
                for vector in vectors:
                    for bucket in vector.buckets:
                        bucket.collected = False
                    vector.pool.trim(_KEEP)
        self._reducer.step_done()
        self._synchronized, self._reducing = True, False

    def _collect(self, vector, bucket):
        """This rank's chunk of the reduced bucket, into ``bucket.reduced`` (stage 1: where
        the reduce-scatter left it, in the bucket's own vector); a stage-2 bucket's gradient
        vector goes back to the pool."""
        handle, payload_dtype, ctx = bucket.launched
        mine = from_numpy(collectives.synchronize(handle))
        if mine.dtype != payload_dtype:  # bfloat16 carried as float32
            mine = mine.to(payload_dtype)
        if ctx is not None:
            mine = self._compression.decompress(mine, ctx)
        if mine.data_ptr() != bucket.reduced.data_ptr() or mine.dtype != bucket.reduced.dtype:
            bucket.reduced.copy_(mine)  # stage 1 reduced in place: already there
        bucket.launched, bucket.collected = None, True
        if self.stage == 2:
            bucket.release(vector.pool)

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """Clip the reduced gradients by their norm over every rank's slice, as
        ``torch.nn.utils.clip_grad_norm_`` clips the whole gradient (the model's ``.grad`` are
        not the gradient under a sharded optimizer). Waits for the reduce-scatters first.
        Collective: every rank calls it. Returns the total norm (before clipping)."""
        self.synchronize()
        norm_type = float(norm_type)
        chunks = [bucket.reduced for vectors in self._vectors for vector in vectors
                  for bucket in vector.buckets]
        if norm_type == math.inf:
            local = max((float(chunk.abs().max()) for chunk in chunks if chunk.numel()),
                        default=0.0)
            total = mpi_ops.allreduce(torch.tensor([local], dtype=torch.float64), op=ops.Max,
                                      name=f"{self._prefix}.clip",
                                      process_set=self.process_set)[0]
        else:
            local = sum(float(torch.linalg.vector_norm(chunk, norm_type, dtype=torch.float64))
                        ** norm_type for chunk in chunks if chunk.numel())
            total = mpi_ops.allreduce(torch.tensor([local], dtype=torch.float64), op=ops.Sum,
                                      name=f"{self._prefix}.clip",
                                      process_set=self.process_set)[0] ** (1.0 / norm_type)
        coefficient = min(float(max_norm) / (float(total) + 1e-6), 1.0)
        for chunk in chunks:
            chunk.mul_(coefficient)
        return torch.tensor(float(total))

    def held_gradient_bytes(self):
        """The bytes of gradient memory this optimizer holds: the buckets' gradient vectors
        (stage 1: one per bucket, each reduced in place; stage 2: two kept between steps,
        reused) and, in stage 2, this rank's slice of the reduced gradients."""
        return sum((0 if vector.reduced is None else vector.reduced.nbytes) +
                   vector.pool.held_bytes() for vectors in self._vectors for vector in vectors)

    # torch.amp's GradScaler hands itself to step(): it unscales this rank's reduced
    # chunks, and every rank takes the same skip decision (amp.py)
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        """Wait for the reduce-scatters, step this rank's chunks, allgather the parameters.
        Under ``scaler.step(optimizer)`` the chunks are unscaled first, and a step with inf
        or NaN anywhere is skipped on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        with transport.activity("sharded optimizer step"):
            for vectors in self._vectors:
                for vector in vectors:
                    for leaf, grad in zip(vector.leaves, vector.leaf_grads):
                        leaf.grad = grad
            if grad_scaler is None or all_finite(self, grad_scaler, f"{self._prefix}.amp",
                                                 self.process_set):
                self._optimizer.step()
                for vectors in self._vectors:  # each rank's updated chunks, into every rank's
                    for vector in vectors:
                        self._gather.gather(vector.values.view(torch.uint8).numpy(),
                                            vector.buckets_layout)
            for vectors in self._vectors:
                for vector in vectors:
                    for leaf in vector.leaves:
                        leaf.grad = None
        self._synchronized = False
        return loss

    def zero_grad(self, set_to_none=True):
        """Clear the model's gradients (refused while they are being reduced: after
        backward, before ``step()`` or ``synchronize()``)."""
        if self._reducing:
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the gradients are being reduced "
                "across the ranks. Call step() (or synchronize()) first")
        self._reducer.step_done()  # backward passes count from here again
        for parameter in self._originals:
            if parameter.grad is None:
                continue
            if set_to_none:
                parameter.grad = None
            else:
                parameter.grad.detach_()
                parameter.grad.zero_()
        self._optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use around ``step()`` after an explicit ``synchronize()`` (Horovod's pattern for
        clipping); ``step()`` does not wait again either way."""
        if not self._synchronized:
            raise RuntimeError("skip_synchronize() without synchronize() first: a sharded "
                               "optimizer can only step reduced gradients")
        yield

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
        return shard_state.gather(self)

    def load_state_dict(self, state_dict):
        """Take a full state (from ``state_dict()`` here or of the unsharded optimizer) and
        keep this rank's chunks of it."""
        shard_state.load(self, state_dict)


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

    def state_dict(self):
        """The state gathered by ``consolidate_state_dict`` (on that rank only)."""
        if self._consolidated is None:
            raise RuntimeError("Optimizer state has not been consolidated on this rank. Please "
                               "call `consolidate_state_dict(to=<rank>)` on all ranks first, "
                               "then state_dict() on that rank")
        return self._consolidated
