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

import math
import zlib

import numpy as np

from .. import collectives, ops
from .arrays import FLOATS, arrays_for, on_host


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
        xp = arrays_for(array)
        if xp is None or xp.dtype_name(array) not in FLOATS:
            raise TypeError(f"the powersgd hook reduces float32 or float64 gradients (numpy "
                            f"arrays or torch tensors); bucket '{bucket.name}' holds "
                            f"{getattr(array, 'dtype', type(array).__name__)} "
                            f"(use comm_hooks.fp16 or .bf16 for 16-bit gradients)")
        entry = _Entry(bucket, xp)
        if self.iter < self.start_iter:
            reduction = bucket.reduction
            entry.handles.append(xp.allreduce_async_(
                array, name=bucket.name, op=reduction.op, prescale_factor=reduction.prescale,
                postscale_factor=reduction.postscale, process_set=reduction.process_set))
        else:
            self._start(entry)
        self._step.append(entry)
        return _Waiting(self, entry)

    # ---- one bucket's first half: P = M Q, and its allreduces ---------------------------

    def _start(self, entry):
        bucket, xp = entry.bucket, entry.xp
        array, reduction = bucket.array(), bucket.reduction
        self._claim(bucket)
        source = array  # what this rank sends: its gradients, plus its error where kept
        if self.use_error_feedback:
            # the error vector becomes what is sent, and after the step what was left out
            # (no copy of the bucket: the approximation is written into the gradients)
            error = _adopted(self._errors.get(bucket.name), array, xp, xp.count(array))
            if error is None:
                error = xp.zeros_like(array)
            self._errors[bucket.name] = error
            xp.add(error, array)
            source = entry.source = error
        offset = 0
        for gradient in bucket.gradients():
            count = xp.count(gradient)
            sent = source[offset:offset + count].reshape(gradient.shape)
            offset += count
            n = gradient.shape[0] if gradient.ndim >= 2 else 0
            m = count // n if n else 0
            rank = min(n, m, self.rank)
            if n and n * m > self.min_compression_rate * (n + m) * rank:
                entry.matrices.append((sent.reshape(n, m), rank))
                entry.outputs.append(gradient.reshape(n, m))
            else:
                entry.rest.append((sent, gradient))
        if entry.rest:  # uncompressed, as the optimizer reduces without a hook
            entry.rest_flat = xp.concatenate([sent.reshape(-1) for sent, _ in entry.rest])
            entry.handles.append(xp.allreduce_async_(
                entry.rest_flat, name=f"{bucket.name}.powersgd.rest", op=reduction.op,
                prescale_factor=reduction.prescale, postscale_factor=reduction.postscale,
                process_set=reduction.process_set))
        if not entry.matrices:
            return
        entry.p_flat = xp.empty(sum(matrix.shape[0] * rank for matrix, rank in entry.matrices),
                                array)
        q_count = sum(matrix.shape[1] * rank for matrix, rank in entry.matrices)
        q_flat = _adopted(self._qs.get(bucket.name), array, xp, q_count) \
            if self.warm_start else None
        if q_flat is None:  # the same on every rank: seeded by the bucket's name and the step
            generator = np.random.default_rng(
                [self.seed, zlib.crc32(bucket.name.encode()), self.iter])
            q_flat = xp.from_host(generator.standard_normal(q_count), array)
        entry.q_flat = self._qs[bucket.name] = q_flat
        entry.ps, entry.qs = _split(entry.p_flat, [(matrix.shape[0], rank) for matrix, rank
                                                   in entry.matrices]), \
            _split(q_flat, [(matrix.shape[1], rank) for matrix, rank in entry.matrices])
        for (matrix, _), p, q in zip(entry.matrices, entry.ps, entry.qs):
            xp.orthogonalize(q)
            xp.project(matrix, q, p)
        # a sum: each P is orthogonalized next, which its scale does not change
        entry.handles.append(xp.allreduce_async_(
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
            count = math.prod(gradient.shape)
            members.append((parameter, offset, offset + count))
            offset += count
            before = self._owner.get(parameter)
            if before is not None and before != name:
                moved.add(before)
            self._owner[parameter] = name
        self._members[name] = members
        if not moved:
            return
        if self.use_error_feedback and name not in self._errors:
            array = bucket.array()
            xp = arrays_for(array)
            error = xp.zeros_like(array)
            starts = {parameter: start for parameter, start, _ in members}
            for old_name in moved:
                old_error = _adopted(self._errors.get(old_name), array, xp)
                if old_error is None:
                    continue
                for parameter, start, stop in self._members[old_name]:
                    if parameter in starts:
                        at = starts[parameter]
                        xp.assign(error[at:at + stop - start], old_error[start:stop])
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
                entry.xp.orthogonalize(p)
                entry.xp.project_back(matrix, p, q)
        # one allreduce of every Q of the step: of host arrays, and of tensors (the same
        # kinds on every rank, since the ranks' optimizers hold the same parameters)
        for kind in sorted({entry.xp.name for entry in compressed}):
            self._reduce_qs([entry for entry in compressed if entry.xp.name == kind])
        for entry in entries:
            self._finish(entry)
        self._count(entries)
        self.iter += 1

    def _reduce_qs(self, entries):
        xp = entries[0].xp
        reduction = entries[0].bucket.reduction
        qs = xp.concatenate([entry.q_flat for entry in entries])
        names = "|".join(entry.bucket.name for entry in entries)
        xp.allreduce_(qs, name=f"powersgd.q.{zlib.crc32(names.encode()):08x}", op=ops.Sum,
                      process_set=reduction.process_set)
        if reduction.op == ops.Average:
            qs /= _size(reduction.process_set)
        offset = 0
        for entry in entries:
            count = xp.count(entry.q_flat)
            xp.assign(entry.q_flat, qs[offset:offset + count])
            offset += count

    def _finish(self, entry):
        bucket, xp = entry.bucket, entry.xp
        reduction = bucket.reduction
        if entry.rest:
            offset = 0
            for _, gradient in entry.rest:
                count = xp.count(gradient)
                xp.assign(gradient, entry.rest_flat[offset:offset + count].reshape(
                    gradient.shape))
                offset += count
        factor = reduction.prescale * reduction.postscale
        for output, p, q in zip(entry.outputs, entry.ps, entry.qs):
            xp.expand(p, q, output)
            if factor != 1.0:
                output *= factor
        if entry.source is not None:  # what was sent less what every rank applies
            xp.subtract(entry.source, bucket.array())
        if not self.warm_start:
            self._qs.pop(bucket.name, None)
        entry.done = True

    def _count(self, entries):
        sent = dict.fromkeys(self.sent, 0)
        for entry in entries:
            count = entry.xp.count
            if not entry.matrices and not entry.rest:
                sent["plain"] += count(entry.bucket.array())
            sent["p"] += 0 if entry.p_flat is None else count(entry.p_flat)
            sent["q"] += 0 if entry.q_flat is None else count(entry.q_flat)
            sent["uncompressed"] += 0 if entry.rest_flat is None else count(entry.rest_flat)
        self.sent = sent

    # ---- saved with the optimizer -------------------------------------------------------------

    def state_dict(self):
        """The step count, the error vectors and the Q matrices (copies, where they live:
        numpy arrays or torch tensors), by bucket name."""
        return {"iter": self.iter,
                "errors": {name: _copy(error) for name, error in self._errors.items()},
                "qs": {name: _copy(q) for name, q in self._qs.items()}}

    def load_state_dict(self, state):
        """Take ``state_dict()``'s (after a restart or an elastic reset)."""
        if self._step:
            raise RuntimeError("powersgd state cannot be loaded while a step's buckets are "
                               "being reduced; call optimizer.step() first")
        self.iter = int(state["iter"])
        # kept as given; each moves to its bucket's kind, dtype and device at first use
        self._errors = {name: _copy(error) for name, error in state["errors"].items()}
        self._qs = {name: _copy(q) for name, q in state["qs"].items()}


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

    def __init__(self, bucket, xp):
        self.bucket, self.xp = bucket, xp  # xp: how its arrays are worked (arrays.py)
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


def _adopted(value, like, xp, count=None):
    """``value`` (an error or Q vector, perhaps restored from a state_dict taken where the
    bucket lived elsewhere) as an array of ``like``'s kind, dtype and device; None where
    there is none, or where ``count`` is given and it holds another number of elements."""
    if value is None:
        return None
    if not xp.fits(value, like):
        value = xp.from_host(on_host(value), like)
    if count is not None and xp.count(value) != count:
        return None
    return value


def _copy(value):
    """A copy of a state vector: a numpy array or a torch tensor (where it lives), or any
    array-like as a numpy array."""
    xp = arrays_for(value)
    return xp.copy(value) if xp is not None else np.array(value)


def _size(process_set):
    from ..process_sets import group_of

    return group_of(process_set).size
