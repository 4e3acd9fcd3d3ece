"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019) as a gradient communication hook.

Each gradient of two or more dimensions, seen as a matrix M (n x m: its first dimension by
the rest), is sent as two thin matrices of ``rank`` columns instead of n x m values:

1. P = M Q (Q: m x rank, the last step's Q where ``warm_start``, else random with a seed
   every rank shares); the P of every matrix of a bucket travel in one allreduce (a sum);
2. each P is orthogonalized (a QR factorization's Q: Gram-Schmidt loses orthogonality where
   a gradient is rank-deficient, as a classifier's last layer is, whose rows sum to zero);
3. Q = Mᵀ P; the Q of every matrix of the step travel in one allreduce (a sum, divided by
   the ranks for Average);
4. M is replaced by P Qᵀ, the rank-``rank`` approximation of the ranks' average.

Vectors and matrices too small to gain (n m < ``min_compression_rate`` (n + m) rank) travel
uncompressed, one allreduce per bucket. With ``use_error_feedback`` what the approximation
left out of this rank's gradient is added to the next step's (the bucket's whole vector:
local minus what every rank applies). The first ``start_iter`` steps are plain allreduces.

The hook's work for a bucket starts when the bucket is handed over (its P's allreduce runs
while backward goes on); the first ``wait()`` of a step finishes every bucket of the step
together, so the Q of all of them travel in one allreduce. Its state (the step count, the
error vectors and the Q matrices, by bucket name) is ``state_dict()``; the optimizers save it
with their own.
"""

import zlib

import numpy as np

from . import collectives, ops
from .kernels import lowrank


class PowerSGD:
    """A PowerSGD hook: ``hook(state, bucket)``; see the module docstring."""

    def __init__(self, rank=1, start_iter=1000, min_compression_rate=2.0,
                 use_error_feedback=True, warm_start=True, seed=0):
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"powersgd rank must be an int >= 1 (the approximation's "
                             f"columns), got {rank!r}")
        if not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"powersgd start_iter must be an int >= 0 (steps of plain "
                             f"allreduce first), got {start_iter!r}")
        if min_compression_rate < 0:
            raise ValueError(f"powersgd min_compression_rate must be >= 0, got "
                             f"{min_compression_rate!r}")
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.seed = seed
        self.iter = 0  # steps finished
        self._errors = {}  # bucket name -> this rank's error vector
        self._qs = {}      # bucket name -> the Q matrices of its compressed gradients, flat
        # bucket name -> its parameters with their (start, stop) in the bucket, and
        # parameter -> the bucket name that holds it now (see _claim)
        self._members, self._owner = {}, {}
        self._step = []    # this step's buckets in flight (_Entry), in the order handed over
        # elements sent per step (the last step's), for benchmarks and logs
        self.sent = {"plain": 0, "p": 0, "q": 0, "uncompressed": 0}

    def __repr__(self):
        return (f"powersgd(rank={self.rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate}, "
                f"use_error_feedback={self.use_error_feedback}, warm_start={self.warm_start})")

    # ---- the hook ---------------------------------------------------------------------------

    def __call__(self, state, bucket):
        array = bucket.array()
        if not isinstance(array, np.ndarray) or array.dtype not in (np.float32, np.float64):
            raise TypeError(f"the powersgd hook reduces float32 or float64 CPU gradients; "
                            f"bucket '{bucket.name}' holds "
                            f"{getattr(array, 'dtype', type(array).__name__)} on "
                            f"{'the CPU' if isinstance(array, np.ndarray) else 'a device'} "
                            f"(use comm_hooks.fp16 or .bf16 there)")
        entry = _Entry(bucket)
        if self.iter < self.start_iter:
            reduction = bucket.reduction
            entry.handles.append(collectives.allreduce_async_(
                array, name=bucket.name, op=reduction.op, prescale_factor=reduction.prescale,
                postscale_factor=reduction.postscale, process_set=reduction.process_set))
        else:
            self._start(entry)
        self._step.append(entry)
        return _Waiting(self, entry)

    # ---- one bucket's first half: P = M Q, and its allreduces ---------------------------

    def _start(self, entry):
        bucket = entry.bucket
        array, reduction = bucket.array(), bucket.reduction
        self._claim(bucket)
        source = array  # what this rank sends: its gradients, plus its error where kept
        if self.use_error_feedback:
            # the error vector becomes what is sent, and after the step what was left out
            # (no copy of the bucket: the approximation is written into the gradients)
            error = self._errors.get(bucket.name)
            if error is None or error.shape != array.shape or error.dtype != array.dtype:
                error = self._errors[bucket.name] = np.zeros_like(array)
            np.add(error, array, out=error)
            source = entry.source = error
        offset = 0
        for gradient in bucket.gradients():
            sent = source[offset:offset + gradient.size].reshape(gradient.shape)
            offset += gradient.size
            n = gradient.shape[0] if gradient.ndim >= 2 else 0
            m = gradient.size // n if n else 0
            rank = min(n, m, self.rank)
            if n and n * m > self.min_compression_rate * (n + m) * rank:
                entry.matrices.append((sent.reshape(n, m), rank))
                entry.outputs.append(gradient.reshape(n, m))
            else:
                entry.rest.append((sent, gradient))
        if entry.rest:  # uncompressed, as the optimizer reduces without a hook
            entry.rest_flat = np.concatenate([sent.reshape(-1) for sent, _ in entry.rest])
            entry.handles.append(collectives.allreduce_async_(
                entry.rest_flat, name=f"{bucket.name}.powersgd.rest", op=reduction.op,
                prescale_factor=reduction.prescale, postscale_factor=reduction.postscale,
                process_set=reduction.process_set))
        if not entry.matrices:
            return
        dtype = array.dtype
        entry.p_flat = np.empty(sum(matrix.shape[0] * rank for matrix, rank in entry.matrices),
                                dtype)
        q_count = sum(matrix.shape[1] * rank for matrix, rank in entry.matrices)
        q_flat = self._qs.get(bucket.name) if self.warm_start else None
        fresh = q_flat is None or q_flat.size != q_count or q_flat.dtype != dtype
        if fresh:  # the same on every rank: seeded by the bucket's name and the step
            generator = np.random.default_rng(
                [self.seed, zlib.crc32(bucket.name.encode()), self.iter])
            q_flat = generator.standard_normal(q_count).astype(dtype)
        entry.q_flat = self._qs[bucket.name] = q_flat
        entry.ps, entry.qs = _split(entry.p_flat, [(matrix.shape[0], rank) for matrix, rank
                                                   in entry.matrices]), \
            _split(q_flat, [(matrix.shape[1], rank) for matrix, rank in entry.matrices])
        for (matrix, _), p, q in zip(entry.matrices, entry.ps, entry.qs):
            _orthogonalize(q)
            lowrank.project(matrix, q, p)
        # a sum: each P is orthogonalized next, which its scale does not change
        entry.handles.append(collectives.allreduce_async_(
            entry.p_flat, name=f"{bucket.name}.powersgd.p", op=ops.Sum,
            process_set=reduction.process_set))

    def _claim(self, bucket):
        """Record which parameters the bucket holds, the first time its name is seen. When
        the optimizer lays its buckets out again (the autotuner moved the fusion threshold)
        the names change: a new bucket takes over its parameters' error from the buckets
        that held them, and a bucket left with none of its parameters has its state (error
        and Q) dropped, so none is kept for buckets that no longer exist."""
        name = bucket.name
        if name in self._members:
            return
        members, offset, moved = [], 0, set()
        for parameter, gradient in zip(bucket.parameters(), bucket.gradients()):
            members.append((parameter, offset, offset + gradient.size))
            offset += gradient.size
            before = self._owner.get(parameter)
            if before is not None and before != name:
                moved.add(before)
            self._owner[parameter] = name
        self._members[name] = members
        if not moved:
            return
        if self.use_error_feedback and name not in self._errors:
            error = np.zeros_like(bucket.array())
            starts = {parameter: start for parameter, start, _ in members}
            for old_name in moved:
                old_error = self._errors.get(old_name)
                if old_error is None:
                    continue
                for parameter, start, stop in self._members[old_name]:
                    if parameter in starts:
                        at = starts[parameter]
                        error[at:at + stop - start] = old_error[start:stop]
            self._errors[name] = error
        holding = set(self._owner.values())
        for old_name in [old for old in self._members if old not in holding]:
            del self._members[old_name]
            self._errors.pop(old_name, None)
            self._qs.pop(old_name, None)

    # ---- every bucket of the step: Q = Mᵀ P, one allreduce, M = P Qᵀ ---------------------

    def _finish_step(self):
        entries, self._step = self._step, []
        for entry in entries:
            for handle in entry.handles:
                collectives.synchronize(handle)
        compressed = sorted((entry for entry in entries if entry.matrices),
                            key=lambda entry: entry.bucket.name)  # one order on every rank
        for entry in compressed:
            for (matrix, _), p, q in zip(entry.matrices, entry.ps, entry.qs):
                _orthogonalize(p)
                lowrank.project_back(matrix, p, q)
        if compressed:
            reduction = compressed[0].bucket.reduction
            qs = np.concatenate([entry.q_flat for entry in compressed])
            names = "|".join(entry.bucket.name for entry in compressed)
            collectives.allreduce_(
                qs, name=f"powersgd.q.{zlib.crc32(names.encode()):08x}",
                op=ops.Sum, process_set=reduction.process_set)
            if reduction.op == ops.Average:
                qs /= _size(reduction.process_set)
            offset = 0
            for entry in compressed:
                entry.q_flat[...] = qs[offset:offset + entry.q_flat.size]
                offset += entry.q_flat.size
        for entry in entries:
            self._finish(entry)
        self._count(entries)
        self.iter += 1

    def _finish(self, entry):
        bucket = entry.bucket
        reduction = bucket.reduction
        if entry.rest:
            offset = 0
            for _, gradient in entry.rest:
                gradient[...] = entry.rest_flat[offset:offset + gradient.size].reshape(
                    gradient.shape)
                offset += gradient.size
        factor = reduction.prescale * reduction.postscale
        for output, p, q in zip(entry.outputs, entry.ps, entry.qs):
            lowrank.expand(p, q, output)
            if factor != 1.0:
                output *= factor
        if entry.source is not None:  # what was sent less what every rank applies
            np.subtract(entry.source, bucket.array(), out=entry.source)
        if not self.warm_start:
            self._qs.pop(bucket.name, None)
        entry.done = True

    def _count(self, entries):
        sent = dict.fromkeys(self.sent, 0)
        for entry in entries:
            if not entry.matrices and not entry.rest:
                sent["plain"] += entry.bucket.array().size
            sent["p"] += 0 if entry.p_flat is None else entry.p_flat.size
            sent["q"] += 0 if entry.q_flat is None else entry.q_flat.size
            sent["uncompressed"] += 0 if entry.rest_flat is None else entry.rest_flat.size
        self.sent = sent

    # ---- saved with the optimizer -------------------------------------------------------------

    def state_dict(self):
        """The step count, the error vectors and the Q matrices (copies), by bucket name."""
        return {"iter": self.iter,
                "errors": {name: error.copy() for name, error in self._errors.items()},
                "qs": {name: q.copy() for name, q in self._qs.items()}}

    def load_state_dict(self, state):
        """Take ``state_dict()``'s (after a restart or an elastic reset)."""
        if self._step:
            raise RuntimeError("powersgd state cannot be loaded while a step's buckets are "
                               "being reduced; call optimizer.step() first")
        self.iter = int(state["iter"])
        self._errors = {name: np.array(error) for name, error in state["errors"].items()}
        self._qs = {name: np.array(q) for name, q in state["qs"].items()}


class _Waiting:
    """What the hook returns for a bucket: ``wait()`` finishes the step's buckets (the
    first call of the step) and gives this one's reduced vector."""

    def __init__(self, hook, entry):
        self._hook, self._entry = hook, entry

    def wait(self):
        if not self._entry.done:
            self._hook._finish_step()
        return self._entry.bucket.array()


class _Entry:
    """One bucket of the step, from hand-over to done."""

    def __init__(self, bucket):
        self.bucket = bucket
        self.handles = []     # its allreduces in flight (plain, or uncompressed and P)
        self.matrices = []    # (what is sent of a gradient, as an n x m view; its rank)
        self.outputs = []     # the gradients those approximate, n x m views
        self.rest = []        # (what is sent, the gradient) of those sent uncompressed
        self.rest_flat = None
        self.p_flat = self.q_flat = None
        self.ps = self.qs = ()
        self.source = None    # the error vector holding what was sent (error feedback)
        self.done = False


def _split(flat, shapes):
    """Views of ``flat``, one per (rows, columns), back to back."""
    views, offset = [], 0
    for rows, columns in shapes:
        views.append(flat[offset:offset + rows * columns].reshape(rows, columns))
        offset += rows * columns
    return views


def _orthogonalize(matrix):
    """Replace the columns of ``matrix`` (rows >= columns) by orthonormal ones spanning
    theirs (Householder QR: orthonormal even where they are dependent)."""
    matrix[...] = np.linalg.qr(matrix, mode="reduced")[0]


def _size(process_set):
    from .process_sets import group_of

    return group_of(process_set).size
