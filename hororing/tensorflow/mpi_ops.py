"""Horovod's collective verbs on TensorFlow tensors, eager and in ``tf.function``.

Each verb is one stateful op (see bridge.py) and is differentiable, with the gradients
Horovod's TensorFlow ops define: allreduce's is the same allreduce of the output gradient;
allgather's is this rank's rows of the averaged gradient; broadcast's is the averaged
gradient on the root and zero elsewhere; alltoall's sends the gradient back the way the rows
came; reducescatter's is the allgather of the gradient, scaled as the forward was.
"""

import numpy as np
import tensorflow as tf

from .. import collectives as core
from .. import door, grad_rules, ops
from ..compression import wire_of
from ..context import current
from ..process_sets import global_process_set, group_of, registered_sets
from ..validate import ALLREDUCE_OPS, check_factor, resolve_op
from .bridge import as_tensor, collective, restore, to_tf
from .compression import Compression
from .graph import op_name


# ---- allreduce ------------------------------------------------------------------------------

def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """Reduce a ``tf.Tensor`` (or variable) over all ranks; Average by default.

    A ``tf.IndexedSlices`` (a sparse gradient) is reduced by gathering every rank's values
    and indices (Sum or Average only). ``compression=Compression.fp16`` sends floating
    tensors as float16. ``device_*`` and ``ignore_name_scope`` are accepted for Horovod
    compatibility. Every rank must call it with the same shape, dtype and op.

    Raises:
        NotImplementedError: a ``tf.IndexedSlices`` with an op other than Sum or Average, or
            with a prescale/postscale factor (as Horovod).
    """
    if isinstance(tensor, tf.IndexedSlices):
        op = _sparse_op(op, average, prescale_factor, postscale_factor)
        return _sparse_allreduce(tensor, op, name, process_set)
    op = resolve_op(op, average, allowed=ALLREDUCE_OPS)
    prescale_factor = check_factor(prescale_factor, "prescale_factor")
    postscale_factor = check_factor(postscale_factor, "postscale_factor")
    compressed, ctx = compression.compress(to_tf(tensor))
    reduced = _allreduce(compressed, op, prescale_factor, postscale_factor, name, process_set,
                         compression)
    return compression.decompress(reduced, ctx)


def _sparse_op(op, average, prescale_factor, postscale_factor):
    """The op a ``tf.IndexedSlices`` reduces with; refuse what Horovod refuses for one."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        op = ops.Sum if average is False else ops.Average
    if op not in (ops.Sum, ops.Average):
        raise NotImplementedError(
            f"a tf.IndexedSlices (sparse gradient) reduces with Sum or Average only, got "
            f"{ops.op_name(op)}; densify it with tf.convert_to_tensor(...) (an optimizer: "
            f"sparse_as_dense=True)")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError(
            "prescale_factor/postscale_factor do not apply to a tf.IndexedSlices; densify it "
            "with tf.convert_to_tensor(...) or scale its values")
    return op


def _sparse_allreduce(slices, op, name, process_set):
    """Gather every rank's values and indices (Average: the values divided by the set size)."""
    values = allgather(slices.values, name=None if name is None else name + ".values",
                       process_set=process_set)
    indices = allgather(slices.indices, name=None if name is None else name + ".indices",
                        process_set=process_set)
    if op == ops.Average:
        values = values / tf.cast(group_of(process_set).size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _allreduce(tensor, op, prescale_factor, postscale_factor, name, process_set,
               compression=Compression.none):
    return _reduce("allreduce", [tensor], op, prescale_factor, postscale_factor, name,
                   process_set, compression)[0]


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, name=None, process_set=global_process_set,
                      ignore_name_scope=False):
    """Allreduce a list of tensors; return the list.

    Dense tensors go in one op (fused by the engine); each ``tf.IndexedSlices`` is reduced as
    ``allreduce`` reduces one (Sum or Average only).
    """
    tensors = _tensor_list(tensors, "grouped_allreduce")
    sparse = [index for index, tensor in enumerate(tensors)
              if isinstance(tensor, tf.IndexedSlices)]
    if sparse:
        sparse_op = _sparse_op(op, average, prescale_factor, postscale_factor)
    op = resolve_op(op, average, allowed=ALLREDUCE_OPS)
    prescale_factor = check_factor(prescale_factor, "prescale_factor")
    postscale_factor = check_factor(postscale_factor, "postscale_factor")
    results = list(tensors)
    dense = [index for index in range(len(tensors)) if index not in set(sparse)]
    for number, index in enumerate(sparse):
        results[index] = _sparse_allreduce(tensors[index], sparse_op, _sub(name, f"sparse{number}"),
                                           process_set)
    if dense:
        compressed = [compression.compress(to_tf(tensors[index], f"tensors[{index}]"))
                      for index in dense]
        reduced = _reduce("grouped_allreduce", [payload for payload, _ in compressed], op,
                          prescale_factor, postscale_factor, name, process_set, compression)
        for index, result, (_, ctx) in zip(dense, reduced, compressed):
            results[index] = compression.decompress(result, ctx)
    return results


def _reduce(kind, tensors, op, prescale_factor, postscale_factor, name, process_set,
            compression=Compression.none):
    """Allreduce ``tensors`` in one op; payloads in ``compression``'s wire dtype travel in it
    (``Compression.fp16``: float16 as float16).

    Each tensor is its own engine request (the engine fuses them), named ``name`` when it
    is alone and ``name.i`` in a group. The gradient is the same reduction of the output
    gradients (Horovod's rule), without compression.
    """
    alone = kind == "allreduce"
    converted = [as_tensor(tensor, "tensor" if alone else f"tensors[{index}]", reduces=True)
                 for index, tensor in enumerate(tensors)]
    label = op_name(kind, name, process_set)
    wire = wire_of(compression)

    def run(arrays, base):
        handles = []
        for index, array in enumerate(arrays):
            member = base if alone else _sub(base, index)
            if wire and array.dtype == ops.numpy_dtype(wire):
                handles.append(core.compressed_allreduce_async_(
                    array.copy(), compression, member, op, prescale_factor, postscale_factor,
                    process_set))
            else:
                (array,), prescale = _prescaled_in_float16([array], prescale_factor)
                # synchronized below, at once: this thread drives the engine (blocking); a
                # lone tensor's cycle may run within the call (now), a group's run together
                handles.append(door.start(
                    "allreduce", array, member, process_set, blocking=True, now=alone, op=op,
                    prescale_factor=prescale, postscale_factor=postscale_factor))
        return [core.synchronize(handle) for handle in handles]

    @tf.custom_gradient
    def forward(*xs):
        results = _same_shape(collective(kind, xs, run, [x.dtype for x in xs], label), xs)

        def grad(*upstream):
            upstream = [tf.zeros_like(x) if dy is None else dy for dy, x in zip(upstream, xs)]
            return _reduce(kind, upstream, op, prescale_factor, postscale_factor, None,
                           process_set)
        return results, grad
    results = forward(*[tensor for tensor, _ in converted])
    return [restore(result, dtype) for result, (_, dtype) in zip(results, converted)]


# ---- allgather, broadcast, alltoall ---------------------------------------------------------

def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's tensor along the first dimension (which may differ per rank)."""
    return grouped_allgather([tensor], name=name, process_set=process_set, _kind="allgather")[0]


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set, _kind="grouped_allgather"):
    """Allgather a list of tensors in one op; return the list."""
    tensors = _tensor_list(tensors, _kind)
    converted = [as_tensor(tensor, f"tensors[{index}]") for index, tensor in enumerate(tensors)]
    for tensor, _ in converted:
        _need_rows(tensor, _kind)
    label = op_name(_kind, name, process_set)

    def run(arrays, base):
        if _kind == "allgather":
            return [core.allgather(arrays[0], name=base, process_set=process_set)]
        return core.grouped_allgather(arrays, name=base, process_set=process_set)

    @tf.custom_gradient
    def forward(*xs):
        results = _rows_vary(collective(_kind, xs, run, [x.dtype for x in xs], label), xs)

        def grad(*upstream):
            return _allgather_grad(xs, upstream, process_set)
        return results, grad
    if not converted:
        return []
    results = forward(*[tensor for tensor, _ in converted])
    return [restore(result, dtype) for result, (_, dtype) in zip(results, converted)]


def _allgather_grad(inputs, upstream, process_set):
    """This rank's rows of each averaged output gradient (Horovod's allgather gradient)."""
    upstream = list(upstream)
    rows = [tf.shape(x, out_type=tf.int64)[:1] for x in inputs]
    label = op_name("allgather_grad", None, process_set)

    def run(arrays, base):
        count = len(upstream)
        gradients, local_rows = arrays[:count], arrays[count:]
        reduced = core.grouped_allreduce(gradients, name=_sub(base, "reduce"), op=ops.Average,
                                         process_set=process_set)
        own = np.concatenate(local_rows).tolist()
        starts = grad_rules.own_row_starts(own, process_set, name=_sub(base, "rows"))
        return [gradient[start:start + rows_here]
                for gradient, start, rows_here in zip(reduced, starts, own)]
    dtypes = [dy.dtype for dy in upstream]
    results = collective("allgather_grad", upstream + rows, run, dtypes, label)
    for result, x in zip(results, inputs):
        result.set_shape(x.shape)
    return results


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Return ``root_rank``'s tensor on every rank (``root_rank`` in ``hvd.rank()`` numbering)."""
    tensor, dtype = as_tensor(tensor)
    label = op_name("broadcast", name, process_set)
    group_of(process_set).set_rank(_root(root_rank))

    def run(arrays, member):
        return [core.broadcast(arrays[0], root_rank, name=member, process_set=process_set)]

    @tf.custom_gradient
    def forward(x):
        result = _same_shape(collective("broadcast", [x], run, [x.dtype], label), [x])[0]

        def grad(upstream):
            reduced = _allreduce(upstream, ops.Average, 1.0, 1.0, None, process_set)
            return reduced if grad_rules.keeps_broadcast_gradient(root_rank) else reduced * 0
        return result, grad
    return restore(forward(tensor), dtype)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Send ``splits[i]`` rows to rank i of the set (even splits when None).

    Returns the received rows, and with ``splits`` given also the received splits (as
    Horovod does).
    """
    tensor, dtype = as_tensor(tensor)
    _need_rows(tensor, "alltoall")
    label = op_name("alltoall", name, process_set)
    given = splits is not None
    split_tensor = (tf.cast(tf.convert_to_tensor(splits), tf.int64) if given
                    else tf.zeros([0], tf.int64))

    def run(arrays, member):
        chosen = arrays[1] if given else None
        received, received_splits = core.alltoall(arrays[0], splits=chosen, name=member,
                                                  process_set=process_set)
        return [received, np.asarray(received_splits, dtype=np.int32)]

    @tf.custom_gradient
    def forward(x, chosen):
        received, received_splits = collective("alltoall", [x, chosen], run,
                                               [x.dtype, tf.int32], label)
        _rows_vary([received], [x])

        def grad(upstream, _splits_upstream=None):
            back = alltoall(upstream, splits=received_splits, process_set=process_set)[0]
            return back, None
        return (received, received_splits), grad
    received, received_splits = forward(tensor, split_tensor)
    received = restore(received, dtype)
    return (received, received_splits) if given else received


# ---- reducescatter --------------------------------------------------------------------------

def reducescatter(tensor, device_dense="", compression=Compression.none, op=ops.Average,
                  name=None, process_set=global_process_set, ignore_name_scope=False,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over all ranks and return this rank's block of rows (Average or Sum)."""
    return grouped_reducescatter([tensor], device_dense, compression, op, name, process_set,
                                 ignore_name_scope, prescale_factor, postscale_factor,
                                 _kind="reducescatter")[0]


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=ops.Average,
                          name=None, process_set=global_process_set, ignore_name_scope=False,
                          prescale_factor=1.0, postscale_factor=1.0, _kind="grouped_reducescatter"):
    """Reducescatter a list of tensors in one op; return the list of this rank's blocks."""
    op = resolve_op(op, allowed=(ops.Average, ops.Sum))
    prescale_factor = check_factor(prescale_factor, "prescale_factor")
    postscale_factor = check_factor(postscale_factor, "postscale_factor")
    tensors = _tensor_list(tensors, _kind)
    compressed = [compression.compress(as_tensor(tensor, f"tensors[{index}]", reduces=True)[0])
                  for index, tensor in enumerate(tensors)]
    for payload, _ in compressed:
        _need_rows(payload, _kind)
    label = op_name(_kind, name, process_set)

    def run(arrays, base):
        arrays, prescale = _prescaled_in_float16(arrays, prescale_factor)
        if _kind == "reducescatter":
            return [core.reducescatter(arrays[0], base, op, process_set, prescale,
                                       postscale_factor)]
        return core.grouped_reducescatter(arrays, base, op, process_set, prescale,
                                          postscale_factor)

    @tf.custom_gradient
    def forward(*xs):
        results = _rows_vary(collective(_kind, xs, run, [x.dtype for x in xs], label), xs)

        def grad(*upstream):
            scale = grad_rules.reducescatter_gradient_scale(op, prescale_factor,
                                                            postscale_factor, process_set)
            return grouped_allgather([dy * tf.cast(scale, dy.dtype) for dy in upstream],
                                     process_set=process_set)
        return results, grad
    if not compressed:
        return []
    results = forward(*[payload for payload, _ in compressed])
    return [compression.decompress(result, ctx) for result, (_, ctx) in zip(results, compressed)]


# ---- synchronization and queries -------------------------------------------------------------

def join():
    """Declare this rank out of data; return the rank that joined last (an int32 tensor).

    Eagerly it returns when every rank has joined; in a ``tf.function`` it is an op that
    does so when it runs.
    """
    def run(arrays, name):
        return [np.int32(core.join())]
    return collective("join", [], run, [tf.int32], None)[0]


def barrier(process_set=global_process_set):
    """Return once every rank of ``process_set`` has called barrier() (an op in a tf.function)."""
    def run(arrays, name):
        core.barrier(process_set)
        return [np.int32(0)]
    done = collective("barrier", [], run, [tf.int32], None)[0]
    return None if tf.executing_eagerly() else done


def size_op(process_set_id=0, name=None):
    """An int32 tensor holding the number of ranks (of the process set with this id)."""
    return _query(lambda: len(current().sets.ranks(process_set_id)), name or "size_op")


def rank_op(name=None):
    """An int32 tensor holding this process's rank."""
    return _query(lambda: current().rank, name or "rank_op")


def local_size_op(name=None):
    """An int32 tensor holding the number of ranks on this node."""
    return _query(lambda: current().local_size, name or "local_size_op")


def local_rank_op(name=None):
    """An int32 tensor holding this process's rank on its node."""
    return _query(lambda: current().local_rank, name or "local_rank_op")


def process_set_included_op(process_set_id=0, name=None):
    """An int32 tensor: 1 if this process belongs to the process set with this id, else 0."""
    return _query(lambda: int(current().rank in current().sets.ranks(process_set_id)),
                  name or "process_set_included_op")


def _query(value, name):
    """A query evaluated when the op runs (so a traced function reads the live value)."""
    return tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=False, name=name)


# ---- helpers ---------------------------------------------------------------------------------

def _prescaled_in_float16(arrays, factor):
    """Float16 tensors prescaled in TensorFlow's float16 arithmetic (computed in float32,
    rounded to float16), as Horovod's TensorFlow op and ``tensor * factor`` give them; the
    factor left for the core (1.0 once applied). The core reduces float16 in float32 and
    would round only the sum; a group of mixed dtypes keeps the core's rule."""
    if factor == 1.0 or not all(array.dtype == np.float16 for array in arrays):
        return arrays, factor
    return [(array.astype(np.float32) * np.float32(factor)).astype(np.float16)
            for array in arrays], 1.0


def _tensor_list(tensors, kind):
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{kind} takes a list of tensors, got {type(tensors).__name__}")
    return list(tensors)


def _need_rows(tensor, kind):
    if tensor.shape.rank == 0:
        raise ValueError(f"{kind} needs tensors with at least one dimension, got a scalar; "
                         f"reshape it with tf.reshape(t, [1])")


def _rows_vary(results, inputs):
    """Give each result its input's static shape, but for a first dimension left unknown."""
    for result, x in zip(results, inputs):
        result.set_shape([None] + x.shape[1:].as_list() if x.shape.rank else None)
    return results


def _same_shape(results, inputs):
    for result, x in zip(results, inputs):
        result.set_shape(x.shape)
    return results


def _root(root_rank):
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"root_rank must be an int, got {type(root_rank).__name__}")
    return int(root_rank)


def _sub(base, part):
    return None if base is None else f"{base}.{part}"


class _Basics:
    """Horovod's private ``mpi_ops._basics``, for the scripts and tests that read it."""

    @staticmethod
    def _get_process_set_ids_and_ranks():
        return registered_sets()


_basics = _Basics()
