"""The collective verbs over numpy arrays, with Horovod's names and semantics.

Every collective here must be called by every rank of its process set (all ranks by
default), in the same order (asynchronous calls may be submitted in any order: the engine
matches them by name). ``x_`` works in place, ``x_async`` returns a handle for
``synchronize``/``poll``; each verb is a thin wrapper over one door, ``door.start(kind, ...)``
(``door.py``), which the torch and TensorFlow bindings go through too.
``process_set`` (a ``hvd.ProcessSet``, default the global set) restricts a collective to
the set's ranks; ``root_rank`` stays in ``hvd.rank()`` numbering.
"""

import numpy as np

from . import door, gpu, ops
from .compression import wire_of
from .engine import GroupHandle, Handle


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
    if op is None:  # ``average``'s op, as ``resolve_op`` gives it: a lane's key is the op
        op, average = ops.Sum if average is False else ops.Average, None
    return door.allreduce_now(tensor, name, process_set, False, op, prescale_factor,
                              postscale_factor, average)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """In-place allreduce: ``tensor`` receives the result, which is also returned."""
    if op is None:
        op, average = ops.Sum if average is False else ops.Average, None
    return door.allreduce_now(tensor, name, process_set, True, op, prescale_factor,
                              postscale_factor, average)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None):
    """Start an allreduce; return a handle (see ``allreduce``)."""
    return door.start("allreduce", tensor, name, process_set, average=average, op=op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None):
    """Start an in-place allreduce; return a handle (see ``allreduce``)."""
    return door.start("allreduce", tensor, name, process_set, inplace=True, average=average, op=op,
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
    return door.start_group("grouped_allreduce", tensors, name, process_set,
                            lambda tensor, member: door.start(
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
    elif wire and (not isinstance(tensor, np.ndarray) or tensor.dtype != ops.numpy_dtype(wire)):
        kind = getattr(compression, "__name__", compression)
        raise TypeError(f"compressed_allreduce_async_ with {kind} takes the {wire} numpy array "
                        f"its compress() made, got "
                        f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    return door.start("allreduce", tensor, name, process_set, inplace=True, op=op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      wire=wire)


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
    return door.start("allgather", tensor, name, process_set, now=True).synchronize()


def allgather_async(tensor, name=None, process_set=None):
    """Start an allgather; return a handle."""
    return door.start("allgather", tensor, name, process_set)


def grouped_allgather(tensors, name=None, process_set=None):
    """Allgather a list of arrays together; return the list of results."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=None):
    """Start a grouped allgather; ``synchronize`` on the handle returns the list."""
    return door.start_group("grouped_allgather", tensors, name, process_set,
                         lambda tensor, member: allgather_async(tensor, member, process_set))


def broadcast(tensor, root_rank, name=None, process_set=None):
    """Return root_rank's ``tensor`` on every rank (a new array). Every rank must call it."""
    return door.start("broadcast", tensor, name, process_set, now=True,
                      root_rank=root_rank).synchronize()


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """In-place broadcast: ``tensor`` receives root_rank's values."""
    return door.start("broadcast", tensor, name, process_set, inplace=True, now=True,
                      root_rank=root_rank).synchronize()


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    """Start a broadcast; return a handle."""
    return door.start("broadcast", tensor, name, process_set, root_rank=root_rank)


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    """Start an in-place broadcast; return a handle."""
    return door.start("broadcast", tensor, name, process_set, inplace=True, root_rank=root_rank)


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send ``splits[i]`` rows of ``tensor`` to rank i; return (received rows, received splits).

    Every rank must call it. Without ``splits`` the first dimension is split evenly.
    """
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=None):
    """Start an alltoall; return a handle."""
    return door.start("alltoall", tensor, name, process_set, splits=splits)


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
    return door.start("reducescatter", tensor, name, process_set, op=op,
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
    if wire and tensor.dtype != ops.numpy_dtype(wire):
        raise TypeError(f"reducescatter_async_ with wire={wire!r} takes a {wire} numpy array, "
                        f"got {getattr(tensor, 'dtype', type(tensor).__name__)}")
    return door.start("reducescatter", tensor, name, process_set, inplace=True, op=op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      wire=wire)


def grouped_reducescatter(tensors, name=None, op=ops.Average, process_set=None,
                          prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter a list of arrays together; return the list of this rank's blocks."""
    return synchronize(grouped_reducescatter_async(tensors, name, op, process_set,
                                                   prescale_factor, postscale_factor))


def grouped_reducescatter_async(tensors, name=None, op=ops.Average, process_set=None,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Start a grouped reducescatter; ``synchronize`` on the handle returns the list."""
    return door.start_group("grouped_reducescatter", tensors, name, process_set,
                         lambda tensor, member: reducescatter_async(
                             tensor, member, op, process_set, prescale_factor, postscale_factor))


# ---- synchronization ----------------------------------------------------------------------

def barrier(process_set=None):
    """Return once every rank (of ``process_set``, default all) has called barrier()."""
    return door.start("barrier", process_set=process_set, now=True).synchronize()


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
    return door.start("join", now=True).synchronize()
