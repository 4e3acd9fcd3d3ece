"""The collective verbs over numpy arrays, with Horovod's names and semantics.

Every collective here must be called by every rank of its process set (all ranks by
default), in the same order (asynchronous calls may be submitted in any order: the engine
matches them by name). ``x_`` works in place, ``x_async`` returns a handle for
``synchronize``/``poll``; each verb is a thin wrapper over one door, ``start(kind, ...)``,
which the torch and TensorFlow bindings go through too: each kind's arguments are checked by
one rule there (``_RULES``).
``process_set`` (a ``hvd.ProcessSet``, default the global set) restricts a collective to
the set's ranks; ``root_rank`` stays in ``hvd.rank()`` numbering.
"""

import inspect

import numpy as np

from . import gpu, ops
from .compression import wire_of
from .context import current
from .engine import JOIN_NAME, GroupHandle, Handle, Meta, Request
from .process_sets import group_of
from .validate import (ALLREDUCE_OPS, DTYPE_NAMES, check_adasum_dtype, check_array,
                       check_factor, check_name, check_ndim, check_root, check_splits,
                       check_writable, resolve_op)


def synchronize(handle):
    """Wait for an asynchronous collective and return its result (raises its error).

    Example:
        >>> handle = hvd.allreduce_async(np.ones(4))
        >>> hvd.synchronize(handle)
    """
    if not isinstance(handle, (Handle, GroupHandle)):
        raise TypeError(f"synchronize takes a handle from an *_async call, got {type(handle).__name__}")
    return handle.synchronize()


def poll(handle):
    """Return True if the asynchronous collective has finished; never blocks."""
    if not isinstance(handle, (Handle, GroupHandle)):
        raise TypeError(f"poll takes a handle from an *_async call, got {type(handle).__name__}")
    return handle.done()


# ---- allreduce --------------------------------------------------------------------------

def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
              process_set=None):
    """Reduce ``tensor`` over all ranks and return the result (a new array).

    Every rank must call it, in the same order, with the same shape, dtype and op.

    Args:
        tensor: numpy array (non-contiguous arrays are copied).
        average: deprecated Horovod flag; use ``op``.
        name: optional name, matched across ranks; generated when None.
        op: Average (default), Sum, Min, Max or Product. Integer Average truncates toward 0.
        prescale_factor: multiply the input before reducing.
        postscale_factor: multiply the result after reducing.
        process_set: reduce over this ``hvd.ProcessSet`` only (default: every rank).

    Returns:
        numpy array with the same shape and dtype, identical on every rank.

    Raises:
        TypeError, ValueError: bad arguments. HorovodInternalError: ranks disagree.

    Example:
        >>> hvd.allreduce(np.array([1.0, 2.0]), op=hvd.Sum)
    """
    return synchronize(start("allreduce", tensor, name, process_set, blocking=True,
                             average=average, op=op, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """In-place allreduce: ``tensor`` receives the result, which is also returned."""
    return synchronize(start("allreduce", tensor, name, process_set, inplace=True,
                             blocking=True, average=average, op=op,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None):
    """Start an allreduce; return a handle (see ``allreduce``)."""
    return start("allreduce", tensor, name, process_set, average=average, op=op,
                 prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None):
    """Start an in-place allreduce; return a handle (see ``allreduce``)."""
    return start("allreduce", tensor, name, process_set, inplace=True, average=average, op=op,
                 prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None):
    """Allreduce a list of arrays together; return the list of results."""
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                               postscale_factor, process_set))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None):
    """In-place grouped allreduce."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None):
    """Start a grouped allreduce; ``synchronize`` on the handle returns the list."""
    return _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor,
                              process_set, inplace=False)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None):
    """Start an in-place grouped allreduce."""
    return _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor,
                              process_set, inplace=True)


def _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor,
                       process_set, inplace):
    return start_group("grouped_allreduce", tensors, name, process_set,
                       lambda tensor, member: start(
                           "allreduce", tensor, member, process_set, inplace=inplace,
                           average=average, op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor))


def compressed_allreduce_async_(tensor, compression, name=None, op=None, prescale_factor=1.0,
                                postscale_factor=1.0, process_set=None):
    """In-place async allreduce of ``tensor``, a payload made by ``compression.compress``.

    The payload travels and is summed in the compressor's wire dtype
    (``hororing.compression.wire_of``); with ``Compression.fp16`` a float16 payload moves as
    float16 (each addition computed in float32 and rounded between ranks, half the bytes of
    an ordinary float16 allreduce, which sends float32 so that its partial sums stay exact),
    and Average divides before the sum, so a float16 sum cannot overflow where the average
    would not. A float16 device array travels in float16 the same way (its hops add on the
    GPU, in float32, rounding each sum). A compressor without a wire dtype, and other device
    payloads (cupy and numba have no bfloat16: a bfloat16 CUDA tensor travels as float32),
    take the ordinary path.

    Raises:
        TypeError: for a host payload whose dtype is not the compressor's wire dtype.
    """
    wire = wire_of(compression)
    if wire and gpu.is_device_array(tensor):
        if wire != "float16" or str(getattr(tensor, "dtype", "")) not in _DEVICE_FLOAT16:
            wire = ""  # no bfloat16 on the device: the ordinary path
    elif wire and (not isinstance(tensor, np.ndarray) or tensor.dtype != np.dtype(wire)):
        kind = getattr(compression, "__name__", compression)
        raise TypeError(f"compressed_allreduce_async_ with {kind} takes the {wire} numpy array "
                        f"its compress() made, got "
                        f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    return start("allreduce", tensor, name, process_set, inplace=True, op=op,
                 prescale_factor=prescale_factor, postscale_factor=postscale_factor, wire=wire)


_DEVICE_FLOAT16 = ("float16", "torch.float16")  # a device array's dtype, as str() names it


def group_handles(handles):
    """One handle over several started collectives: ``synchronize`` returns the list of
    their results, ``poll`` is True once all are done."""
    return GroupHandle(handles)


# ---- allgather, broadcast, alltoall, reducescatter ----------------------------------------

def allgather(tensor, name=None, process_set=None):
    """Concatenate every rank's ``tensor`` along the first dimension (which may differ per rank).

    Every rank must call it, in the same order; the other dimensions must agree.

    Example:
        >>> hvd.allgather(np.full((hvd.rank() + 1, 2), hvd.rank()))
    """
    return synchronize(start("allgather", tensor, name, process_set, blocking=True))


def allgather_async(tensor, name=None, process_set=None):
    """Start an allgather; return a handle."""
    return start("allgather", tensor, name, process_set)


def grouped_allgather(tensors, name=None, process_set=None):
    """Allgather a list of arrays together; return the list of results."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=None):
    """Start a grouped allgather; ``synchronize`` on the handle returns the list."""
    return start_group("grouped_allgather", tensors, name, process_set,
                    lambda tensor, member: allgather_async(tensor, member, process_set))


def broadcast(tensor, root_rank, name=None, process_set=None):
    """Return root_rank's ``tensor`` on every rank (a new array). Every rank must call it."""
    return synchronize(start("broadcast", tensor, name, process_set, blocking=True,
                             root_rank=root_rank))


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """In-place broadcast: ``tensor`` receives root_rank's values."""
    return synchronize(start("broadcast", tensor, name, process_set, inplace=True,
                             blocking=True, root_rank=root_rank))


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    """Start a broadcast; return a handle."""
    return start("broadcast", tensor, name, process_set, root_rank=root_rank)


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    """Start an in-place broadcast; return a handle."""
    return start("broadcast", tensor, name, process_set, inplace=True, root_rank=root_rank)


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send ``splits[i]`` rows of ``tensor`` to rank i; return (received rows, received splits).

    Every rank must call it. Without ``splits`` the first dimension is split evenly.
    """
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=None):
    """Start an alltoall; return a handle."""
    return start("alltoall", tensor, name, process_set, splits=splits)


def reducescatter(tensor, name=None, op=ops.Average, process_set=None, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` over all ranks and return this rank's block of rows.

    The first ``dim0 % size`` ranks get one row more than the others. Every rank must call it.
    """
    return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                           postscale_factor))


def reducescatter_async(tensor, name=None, op=ops.Average, process_set=None, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Start a reducescatter; return a handle."""
    return start("reducescatter", tensor, name, process_set, op=op,
                 prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def reducescatter_async_(tensor, name=None, op=ops.Average, process_set=None,
                         prescale_factor=1.0, postscale_factor=1.0, wire=""):
    """Start a reducescatter that works in ``tensor`` itself (hororing's own verb; Horovod
    has no in-place reducescatter). ``synchronize`` returns this rank's rows as a view into
    ``tensor``; its other rows hold partial sums by then. No copy of the tensor is made
    where it is C-contiguous and travels in its own dtype (float16 is summed in float32
    through a copy, as an allreduce sums it).

    Args:
        wire: the dtype name the tensor travels and is summed in when the sender chose it
            (``hororing.compression.wire_of``): a float16 payload summed as float16, with
            Average's division before the sum, as ``compressed_allreduce_async_`` does.
    """
    if not isinstance(tensor, np.ndarray) or not tensor.flags.c_contiguous:
        raise TypeError(f"reducescatter_async_ works in a C-contiguous numpy array, got "
                        f"{type(tensor).__name__}"
                        f"{'' if not isinstance(tensor, np.ndarray) else ' (not contiguous)'}; "
                        f"use reducescatter_async, which copies")
    if wire and tensor.dtype != np.dtype(wire):
        raise TypeError(f"reducescatter_async_ with wire={wire!r} takes a {wire} numpy array, "
                        f"got {getattr(tensor, 'dtype', type(tensor).__name__)}")
    return start("reducescatter", tensor, name, process_set, inplace=True, op=op,
                 prescale_factor=prescale_factor, postscale_factor=postscale_factor, wire=wire)


def grouped_reducescatter(tensors, name=None, op=ops.Average, process_set=None,
                          prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter a list of arrays together; return the list of this rank's blocks."""
    return synchronize(grouped_reducescatter_async(tensors, name, op, process_set,
                                                   prescale_factor, postscale_factor))


def grouped_reducescatter_async(tensors, name=None, op=ops.Average, process_set=None,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Start a grouped reducescatter; ``synchronize`` on the handle returns the list."""
    return start_group("grouped_reducescatter", tensors, name, process_set,
                    lambda tensor, member: reducescatter_async(
                        tensor, member, op, process_set, prescale_factor, postscale_factor))


# ---- synchronization ----------------------------------------------------------------------

def barrier(process_set=None):
    """Return once every rank (of ``process_set``, default all) has called barrier()."""
    return synchronize(start("barrier", process_set=process_set))


def join(device=-1):
    """Declare this rank out of data; return the rank that joined last (same on every rank).

    Until every rank has joined, a joined rank contributes zeros to the other ranks'
    allreduces (Average still divides by size), so ranks with fewer batches do not hang.

    Args:
        device: accepted for Horovod compatibility (where its zeros live); hororing makes
            zeros on the device of each tensor they stand in for.
    """
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
        raise TypeError(f"join(device=...) takes an int device id (-1: CPU), got "
                        f"{type(device).__name__}")
    return synchronize(start("join"))


# ---- the one door --------------------------------------------------------------------------

def start(kind, tensor=None, name=None, process_set=None, *, inplace=False, blocking=False,
          into=None, **arguments):
    """Start one collective: the entry every verb here and both bindings go through.

    ``arguments`` are the verb's own (``average``, ``op``, ``prescale_factor``,
    ``postscale_factor`` and the sender's ``wire`` dtype for allreduce and reducescatter;
    ``root_rank`` for broadcast; ``splits`` for alltoall; none for allgather, barrier and
    join), checked by the kind's rule below and turned into the fields every rank must agree
    on. ``blocking``: the caller synchronizes at once and drives the engine itself (the
    background thread is not woken for it). ``into``: a C-contiguous numpy array the result
    of an allgather is written into where it fits exactly (else a new one is made). Returns
    the handle.

    Raises:
        TypeError, ValueError: a bad argument, named, before anything is queued.
    """
    rule = _RULES.get(kind)
    if rule is None:
        if kind in ("barrier", "join"):
            return _synchronization(kind, process_set, arguments)
        raise ValueError(f"unknown collective {kind!r}; one of "
                         f"{', '.join(list(_RULES) + ['barrier', 'join'])}")
    group = group_of(process_set)
    if isinstance(name, str):  # before the input is converted (see Engine.check_free)
        group.engine.check_free(name)
    try:
        fields, min_ndim = rule(group, tensor, **arguments)
    except TypeError:
        _check_arguments(kind, arguments)  # names what the kind takes, where that was wrong
        raise
    return _submit(kind, tensor, name, group, inplace=inplace, min_ndim=min_ndim,
                   blocking=blocking, into=into, **fields)


def _synchronization(kind, process_set, arguments):
    """barrier (of ``process_set``) and join (of every rank): no tensor, a fixed name."""
    if arguments:
        raise TypeError(f"{kind} takes no arguments; got {', '.join(sorted(arguments))}")
    group = group_of(process_set if kind == "barrier" else None)
    name = JOIN_NAME if kind == "join" else "barrier"
    handle = Handle(name, group.engine)
    group.engine.submit(Request(name, Meta(kind=kind), None, None, handle), blocking=True)
    return handle


def _check_arguments(kind, arguments):
    takes, needs = _arguments_of(_RULES[kind])
    if not (arguments.keys() <= takes and needs <= arguments.keys()):
        raise TypeError(f"{kind} takes {', '.join(sorted(takes)) or 'no arguments'}"
                        f"{' (' + ', '.join(sorted(needs)) + ' required)' if needs else ''}; "
                        f"got {', '.join(sorted(arguments)) or 'none'}")


def start_group(kind, tensors, name, process_set, start_member):
    """``start_member(tensor, member_name)`` for each of ``tensors`` (members named
    ``<name>.<index>``, a generated name when ``name`` is None), announced together on every
    rank so they are ready together; one handle over all of them."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{kind} takes a list of arrays, got {type(tensors).__name__}")
    group = group_of(process_set)
    base = check_name(name) or group.auto_name(kind)
    group.engine.check_free(f"{base}.0")
    with group.engine.batch():
        return GroupHandle([start_member(tensor, f"{base}.{index}")
                            for index, tensor in enumerate(tensors)])


# Each kind's rule: (group, tensor, its arguments) -> (the Meta fields, the fewest dimensions)

def _reduction_fields(allowed, default_op, min_ndim):
    def fields(group, tensor, average=None, op=default_op, prescale_factor=1.0,
               postscale_factor=1.0, wire=""):
        # a float factor is taken as it is, without the call (every allreduce comes here)
        return dict(op=resolve_op(op, average, allowed=allowed),
                    prescale=prescale_factor if type(prescale_factor) is float
                    else check_factor(prescale_factor, "prescale_factor"),
                    postscale=postscale_factor if type(postscale_factor) is float
                    else check_factor(postscale_factor, "postscale_factor"),
                    wire=wire), min_ndim
    return fields


def _allgather_fields(group, tensor):
    return {}, 1


def _broadcast_fields(group, tensor, root_rank):
    return dict(root=group.set_rank(check_root(root_rank, current().size))), 0


def _alltoall_fields(group, tensor, splits=None):
    if not gpu.is_device_array(tensor):
        check_array(tensor, min_ndim=1)
    elif len(tensor.shape) < 1:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    return dict(splits=check_splits(splits, tensor.shape[0], group.size)), 1


_RULES = {"allreduce": _reduction_fields(ALLREDUCE_OPS, None, 0),
          "allgather": _allgather_fields,
          "broadcast": _broadcast_fields,
          "alltoall": _alltoall_fields,
          "reducescatter": _reduction_fields((ops.Average, ops.Sum), ops.Average, 1)}


def _arguments_of(rule):
    """The arguments a kind's rule takes (its parameters after group and tensor), and those
    it requires."""
    parameters = list(inspect.signature(rule).parameters.values())[2:]
    return ({parameter.name for parameter in parameters},
            {parameter.name for parameter in parameters
             if parameter.default is inspect.Parameter.empty})


def _submit(kind, tensor, name, group, inplace=False, min_ndim=0, blocking=False, into=None,
            **fields):
    # each check is called where it will raise, or where the array is not a plain numpy one
    # (the common case passes them inline: a call each would be paid on every collective)
    if type(tensor) is not np.ndarray:
        if gpu.is_device_array(tensor):
            return _submit_device(group, kind, tensor, name, inplace, min_ndim, blocking, fields)
        check_array(tensor, min_ndim=min_ndim)
    elif tensor.dtype not in DTYPE_NAMES or tensor.ndim < min_ndim:
        check_array(tensor, min_ndim=min_ndim)
    if type(name) is not str or not name:
        name = check_name(name) or group.auto_name(kind)
    output = writeback = None
    flags = tensor.flags  # a new flags object on every access
    if inplace:
        if not flags.writeable:
            check_writable(tensor, flags=flags)
        if flags.c_contiguous:
            output = tensor
        else:
            writeback = tensor
            tensor = output = _contiguous(tensor)
    elif not flags.c_contiguous:
        tensor = _contiguous(tensor)
    if into is not None and kind == "allgather" and type(into) is np.ndarray \
            and into.flags.c_contiguous and into.dtype == tensor.dtype:
        output = into  # the executor writes the gathered rows here where they fit exactly
    if fields.get("op") == ops.Adasum:
        check_adasum_dtype(ops.Adasum, tensor.dtype)
    meta = Meta(kind=kind, dtype=DTYPE_NAMES.get(tensor.dtype) or tensor.dtype.name,
                shape=tuple(tensor.shape), **fields)
    handle = Handle(name, group.engine)
    return group.engine.submit(Request(name, meta, tensor, output, handle, writeback), blocking)


def _contiguous(array):
    # not np.ascontiguousarray: it turns a 0-d array into shape (1,)
    return array if array.flags.c_contiguous else array.copy(order="C")


def _submit_device(group, kind, tensor, name, inplace, min_ndim, blocking, fields):
    """A cupy / numba.cuda / CUDA-array-interface tensor: the result stays on its device."""
    gpu.check_device_array(tensor)
    check_ndim(tensor.shape, min_ndim)
    name = check_name(name) or group.auto_name(kind)
    check_adasum_dtype(fields.get("op"), gpu.device_dtype(tensor))
    meta = Meta(kind=kind, dtype=gpu.device_dtype(tensor).name, shape=tuple(tensor.shape),
                device="cuda", **fields)
    request = Request(name, meta, tensor, tensor if inplace else None, Handle(name, group.engine))
    request.ready = gpu.ready_event(tensor)
    return group.engine.submit(request, blocking)
