"""The one door every collective enters by, and what a caller may ask of the engine behind it.

``start(kind, ...)`` checks a call's arguments by its kind's rule (``_RULES``), turns them
into the fields every rank must agree on and queues one Request: the numpy verbs
(``collectives.py``) and both bindings go through it; every blocking allreduce comes to it
through ``allreduce_now``, where a repeated call runs its lane instead. The questions below
it (is a name free, do device buffers stage through host memory) are what a binding asks of
an engine: no binding reaches into an engine object itself.
"""

import inspect
from threading import get_ident

import numpy as np

from . import gpu, ops
from .context import current
from .engine import JOIN_NAME, GroupHandle, Handle, Meta, Request, lane_key
from .process_sets import global_process_set, group_of
from .running import _State
from .ops import DTYPE_NAMES
from .validate import (ALLREDUCE_OPS, check_adasum_dtype, check_array,
                       check_factor, check_name, check_ndim, check_root, check_splits,
                       check_writable, resolve_op)


def start(kind, tensor=None, name=None, process_set=None, *, inplace=False, blocking=False,
          now=False, into=None, name_checked=False, lane=None, **arguments):
    """Start one collective: the entry every verb here and both bindings go through.

    ``arguments`` are the verb's own (``average``, ``op``, ``prescale_factor``,
    ``postscale_factor`` and the sender's ``wire`` dtype for allreduce and reducescatter;
    ``root_rank`` for broadcast; ``splits`` for alltoall; none for allgather, barrier and
    join), checked by the kind's rule below and turned into the fields every rank must agree
    on. ``blocking``: the caller synchronizes at once and drives the engine itself (the
    background thread is not woken for it). ``now``: blocking, and the caller synchronizes
    this handle before it starts anything else (a blocking verb), so where nothing else is
    queued the collective's cycle runs within this call (``Engine.submit_blocking``): the
    handle returned is done in the steady state of a loop of blocking calls. ``into``: a
    C-contiguous numpy array the result of an allgather is written into where it fits
    exactly (else a new one is made).
    ``name_checked``: the caller asked ``check_free`` before converting its tensor (a
    binding), so the door does not ask again. ``lane``: the key a later call must match to
    run this one's lane once it has folded (``allreduce_now``'s, ``engine/lane.py``).
    Returns the handle.

    Raises:
        TypeError, ValueError: a bad argument, named, before anything is queued.
    """
    rule = _RULES.get(kind)
    if rule is None:
        if kind in ("barrier", "join"):
            return _synchronization(kind, process_set, arguments, now)
        raise ValueError(f"unknown collective {kind!r}; one of "
                         f"{', '.join(list(_RULES) + ['barrier', 'join'])}")
    context = _State.context  # the global set's group without a call: every verb asks it
    whole = context is not None and (process_set is None or process_set is global_process_set)
    group = context.group if whole else group_of(process_set)
    if now and name is None:  # the same name every call (Group.blocking_name)
        name = group.main_blocking_names[kind] if get_ident() == group.main_ident \
            else group.blocking_name(kind)
    if not name_checked and isinstance(name, str) and name in group.engine.in_flight:  # before the input is converted
        group.engine.check_free(name)
    try:
        fields, min_ndim = rule(group, tensor, **arguments)
    except TypeError:
        _check_arguments(kind, arguments)  # names what the kind takes, where that was wrong
        raise
    return _submit(kind, tensor, name, group, inplace=inplace, min_ndim=min_ndim,
                   blocking=blocking, now=now, into=into, door=lane, **fields)


def allreduce_now(tensor, name, process_set, inplace, op, prescale_factor, postscale_factor,
                  average=None, name_checked=False):
    """A blocking allreduce's result: ``start("allreduce", ..., now=True)`` synchronized,
    the verb's arguments given by position (every blocking allreduce comes here).

    A call its name's lane fits (``engine/lane.py``) runs it (``Engine.run_lane``) without
    the door's checks: the same arguments, each of the type its first call gave
    (``lane_key``), a C-contiguous numpy array of the same dtype and shape, writeable where
    the result goes into it; compared here, not in a call. Any other call, and one its lane
    sends back, goes through ``start``."""
    context = _State.context  # the global set's group without a call, as ``start`` does
    whole = context is not None and (process_set is None or process_set is global_process_set)
    if whole:
        group = context.group
        if name is None:  # the same name every call (Group.blocking_name)
            name = group.main_blocking_names["allreduce"] if get_ident() == group.main_ident \
                else group.blocking_name("allreduce")
        lanes = group.engine.lanes
        lane = lanes.get(name) if lanes and type(name) is str else None
        if lane is not None and type(tensor) is np.ndarray and tensor.dtype is lane.dtype \
                and tensor.shape == lane.shape and average is None and type(op) is int \
                and lane.door == (inplace, op, prescale_factor, postscale_factor) \
                and type(prescale_factor) is float and type(postscale_factor) is float \
                and (flags := tensor.flags).c_contiguous and (flags.writeable or not inplace):
            handle = group.engine.run_lane(lane, tensor)
            if handle is not None:
                if handle._done:  # ``synchronize``'s first case, without its call
                    result, error = handle._outcome
                    if error is None:
                        return result
                return handle.synchronize()
    # the first call (and one its lane sends back) the usual way, with its lane's key: lanes
    # are the global set's
    return start("allreduce", tensor, name, process_set, inplace=inplace, now=True,
                 name_checked=name_checked,
                 lane=lane_key(inplace, average, op, prescale_factor, postscale_factor)
                 if whole else None, average=average, op=op,
                 prescale_factor=prescale_factor,
                 postscale_factor=postscale_factor).synchronize()


def _synchronization(kind, process_set, arguments, now):
    """barrier (of ``process_set``) and join (of every rank): no tensor, a fixed name; the
    caller drives it (``now``: as ``start``'s)."""
    if arguments:
        raise TypeError(f"{kind} takes no arguments; got {', '.join(sorted(arguments))}")
    group = group_of(process_set if kind == "barrier" else None)
    name = JOIN_NAME if kind == "join" else "barrier"
    handle = Handle(name, group.engine)
    request = Request(name, Meta(kind=kind), None, None, handle)
    if now:
        group.engine.submit_blocking(request)
    else:
        group.engine.submit(request, blocking=True)
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
        # an op already resolved (a binding's, or a user's hvd.Sum) and a float factor are
        # taken as they are, without the call (every allreduce comes here)
        return dict(op=op if type(op) is int and average is None and op in allowed
                    else resolve_op(op, average, allowed=allowed),
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


def _submit(kind, tensor, name, group, inplace=False, min_ndim=0, blocking=False, now=False,
            into=None, door=None, **fields):
    # each check is called where it will raise, or where the array is not a plain numpy one
    # (the common case passes them inline: a call each would be paid on every collective)
    if type(tensor) is not np.ndarray:
        if gpu.is_device_array(tensor):
            return _submit_device(group, kind, tensor, name, inplace, min_ndim, blocking, now,
                                  fields)
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
    engine = group.engine
    request = Request(name, meta, tensor, output, Handle(name, engine), writeback)
    request.door = door
    return engine.submit_blocking(request) if now else engine.submit(request, blocking)


def _contiguous(array):
    # not np.ascontiguousarray: it turns a 0-d array into shape (1,)
    return array if array.flags.c_contiguous else array.copy(order="C")


def _submit_device(group, kind, tensor, name, inplace, min_ndim, blocking, now, fields):
    """A cupy / numba.cuda / CUDA-array-interface tensor: the result stays on its device."""
    gpu.check_device_array(tensor)
    check_ndim(tensor.shape, min_ndim)
    name = check_name(name) or group.auto_name(kind)
    check_adasum_dtype(fields.get("op"), gpu.device_dtype(tensor))
    meta = Meta(kind=kind, dtype=gpu.device_dtype(tensor).name, shape=tuple(tensor.shape),
                device="cuda", **fields)
    request = Request(name, meta, tensor, tensor if inplace else None, Handle(name, group.engine))
    request.ready = gpu.ready_event(tensor)
    return group.engine.submit_blocking(request) if now else group.engine.submit(request,
                                                                                 blocking)


# ---- what a binding may ask of a process set's engine -------------------------------------

def check_free(name, process_set=None, member=""):
    """Raise ValueError if a collective named ``name`` (its ``member``'s, for a grouped
    verb: ``name + member``) is in flight on this rank; a ``name`` of None (generated later)
    passes. A binding asks before converting its input, which may release the GIL: a
    collective just submitted under that name could otherwise complete meanwhile, and
    whether the second call is refused would depend on the peers' timing."""
    if isinstance(name, str):
        context = _State.context  # the global set's group without a call, as ``start`` does
        if context is not None and (process_set is None or process_set is global_process_set):
            engine = context.group.engine
        else:
            engine = group_of(process_set).engine
        if name + member in engine.in_flight:
            engine.check_free(name + member)


def stages_device(process_set=None):
    """Whether the set's device buckets travel through host memory (rather than the
    device-direct ring, which reads the peers' device memory on one node)."""
    return group_of(process_set).engine.allreduce.device_transport() != "direct"
