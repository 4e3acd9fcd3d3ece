"""The bridge between torch tensors and the engine, and the handles the torch verbs return.

CPU tensors are handed to the engine as numpy views of the same memory (no copy); CUDA
tensors as themselves (the engine sees them through ``__cuda_array_interface__``, no copy),
and results come back on the input's device. In-place verbs write straight into the tensor.
A bfloat16 tensor travels as float32 (its sums then exact in float32), except a compressor's
bfloat16 payload on the CPU: that is handed over as ml_dtypes' bfloat16, the same memory.
"""

import threading

import numpy as np
import torch

from .. import collectives as core
from .. import door
from ..engine import Meta
from .. import ops
from ..validate import check_ndim

_NUMPY_FREE = (torch.bfloat16,)
# the dtypes the engine reduces whose CPU tensors ``Tensor.numpy`` views as they are
# (bfloat16 travels as float32: ``as_numpy``)
_PLAIN = frozenset([torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
                    torch.int16, torch.int32, torch.int64])
_STRIDED = torch.strided


def zeros(count, dtype, device=None):
    """A flat zero tensor for the library's own large buffers (gradient buckets, flat
    parameter vectors), on ``device`` (default: the CPU). On the CPU allocated by numpy where
    the dtype allows: numpy advises the kernel to back large arrays with transparent huge
    pages, torch's allocator does not, and the reductions over such buffers are memory-bound
    (measured: a 64 MiB allreduce at 2 ranks, 28-29 ms on numpy's memory against 33-37 ms
    on torch.zeros')."""
    if device is not None and torch.device(device).type != "cpu":
        return torch.zeros(count, dtype=dtype, device=device)
    if dtype in _NUMPY_FREE or dtype.is_complex:
        return torch.zeros(count, dtype=dtype)
    return torch.from_numpy(np.zeros(count, dtype=torch.empty(0, dtype=dtype).numpy().dtype))


def engine_meta(tensor, device=None):
    """The engine's description (an allreduce ``Meta``) of ``tensor`` as the optimizers lay
    gradients out for it: its dtype as it travels (bfloat16 as float32), its shape, and
    ``device`` (default: the tensor's own, with its index, so buckets never span devices)."""
    dtype = "float32" if tensor.dtype in _NUMPY_FREE else str(tensor.dtype).rpartition(".")[2]
    return Meta("allreduce", dtype=dtype, shape=tuple(tensor.shape),
                device=str(tensor.device) if device is None else device)


class TorchHandle:
    """An async collective on tensors: ``synchronize`` returns tensors.

    Calling the handle is the same as ``synchronize(handle)`` (Horovod's sparse handles are
    called that way).
    """

    __slots__ = ("inner", "finish")

    def __init__(self, inner, finish):
        self.inner = inner
        self.finish = finish

    def done(self):
        return self.inner.done()

    def __call__(self):
        return synchronize(self)


def synchronize(handle):
    """Wait for an ``*_async`` call and return its tensor result (raises its error)."""
    if not isinstance(handle, TorchHandle):
        raise TypeError(f"synchronize takes a handle from an *_async call, got {type(handle).__name__}")
    return handle.finish(core.synchronize(handle.inner))


def poll(handle):
    """Return True if the asynchronous collective has finished; never blocks."""
    if not isinstance(handle, TorchHandle):
        raise TypeError(f"poll takes a handle from an *_async call, got {type(handle).__name__}")
    return handle.done()


def check_tensor(tensor, argument="tensor", min_ndim=0):
    """Return ``tensor`` if it is a torch tensor of at least ``min_ndim`` dimensions; raise
    the numpy API's errors otherwise. Every verb checks its input so before touching it."""
    if not isinstance(tensor, torch.Tensor):
        got = "None" if tensor is None else type(tensor).__name__
        raise TypeError(f"{argument} must be a torch.Tensor, got {got}; convert it with torch.as_tensor(...)")
    check_ndim(tensor.shape, min_ndim, argument)
    return tensor


def check_tensors(tensors, verb, min_ndim=0):
    """The grouped verbs' ``tensors``: a list or tuple of tensors, each checked."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{verb} takes a list of tensors, got {type(tensors).__name__}")
    for tensor in tensors:
        check_tensor(tensor, min_ndim=min_ndim)
    return tensors


# The small CPU tensors lately viewed as numpy, each with what its view depends on.
# ``Tensor.numpy`` releases the GIL, which the rank's engine thread, polling, then takes:
# measured 10-15 us a call in a loop of 4 KiB allreduces at 2 ranks on 2 cores, against 1.7 us
# alone. A call that repeats a tensor reuses its view while the tensor's memory, shape,
# strides and dtype are those it was made from (``.data =``, ``set_`` or ``resize_`` change
# one of them). Up to VIEWS tensors of VIEW_BYTES in all are kept, the oldest let go first,
# so a loop that reduces a few tensors in turn (a loss and its metrics) reuses each one's
# view, and dropped tensors outlive their last call by at most that much memory.
VIEW_BYTES = 1 << 20
VIEWS = 8
_views = {}  # id(tensor): (tensor, data_ptr, shape, strides, dtype, view); its own key alive
_kept_bytes = 0  # the views' bytes
_keeping = threading.Lock()  # around changes: a view is made with the GIL released


def plain_view(tensor, name, process_set):
    """The numpy view of ``tensor`` the blocking verbs hand straight to the door, and whether
    ``name`` has been checked (``door.check_free``); (None, False) where ``tensor`` is not a
    plain one: a dense CPU ``torch.Tensor`` of a dtype ``Tensor.numpy`` views as it is,
    needing no gradient.

    A tensor viewed lately, unchanged (the same memory, dtype, shape and strides) and still
    needing no gradient, has its view reused: nothing has released the GIL since the call
    began, so the door checks the name. (That tensor was plain: ``.data =`` keeps a tensor
    dense, and any other device's memory has another address.) Otherwise the name is
    checked before ``Tensor.numpy``, which releases the GIL (None is named later)."""
    kept = _views.get(id(tensor))
    if kept is not None and not tensor.requires_grad:  # cpu_view's test, without its call
        last, pointer, shape, strides, dtype, array = kept
        if tensor is last and tensor.data_ptr() == pointer and tensor.dtype is dtype \
                and tensor.shape == shape and tensor.stride() == strides:
            return array, False
    if type(tensor) is torch.Tensor and not tensor.requires_grad and tensor.dtype in _PLAIN \
            and tensor.is_cpu and tensor.layout is _STRIDED:
        if name is not None:
            door.check_free(name, process_set)
        return cpu_view(tensor), True
    return None, False


def cpu_view(tensor):
    """``tensor.numpy()`` of a CPU tensor of a numpy dtype, a lately made view reused."""
    global _kept_bytes
    kept = _views.get(id(tensor))
    if kept is not None:  # the same test as plain_view's, written out in both: no call
        last, pointer, shape, strides, dtype, array = kept
        if tensor is last and tensor.data_ptr() == pointer and tensor.dtype is dtype \
                and tensor.shape == shape and tensor.stride() == strides:
            return array
    array = tensor.numpy()
    nbytes = array.nbytes
    if nbytes <= VIEW_BYTES:
        with _keeping:
            stale = _views.pop(id(tensor), None)
            if stale is not None:
                _kept_bytes -= stale[5].nbytes
            while _views and (len(_views) >= VIEWS or _kept_bytes + nbytes > VIEW_BYTES):
                _kept_bytes -= _views.pop(next(iter(_views)))[5].nbytes
            _views[id(tensor)] = (tensor, tensor.data_ptr(), tensor.shape, tensor.stride(),
                                  tensor.dtype, array)
            _kept_bytes += nbytes
    return array


def as_numpy(tensor, argument="tensor", bfloat16=False):
    """``tensor``'s data as the engine takes it (see the module docstring); ``bfloat16``: a
    CPU bfloat16 tensor as a bfloat16 numpy view of its memory, not a float32 copy."""
    if not isinstance(tensor, torch.Tensor):  # a tensor passes without the call
        check_tensor(tensor, argument)
    if tensor.is_sparse:
        raise ValueError(f"{argument} is sparse; densify it with .to_dense() first, or use "
                         f"sparse_allreduce_async")
    # (is_cpu and is_cuda: a tenth of the cost of device.type; detach only where needed)
    detached = tensor.detach() if tensor.requires_grad else tensor
    if detached.dtype in _NUMPY_FREE:
        if bfloat16 and detached.is_cpu:
            return detached.view(torch.int16).numpy().view(ops.bfloat16())
        detached = detached.float()
    if detached.is_cpu:
        return cpu_view(detached)
    if detached.is_cuda:
        return detached.contiguous()
    raise ValueError(f"{argument} is on {tensor.device}; hororing reduces CPU and CUDA "
                     f"tensors: move it with .cpu() or .cuda()")


def from_numpy(array):
    """A tensor over a C-contiguous numpy array's memory (ml_dtypes' bfloat16 as
    torch.bfloat16)."""
    if ops.is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_torch(array, like):
    if type(array) is np.ndarray and array.dtype.kind != "V" and array.flags.c_contiguous:
        result = torch.from_numpy(array)  # the common case, without the calls below
    elif isinstance(array, torch.Tensor):
        result = array
    elif isinstance(array, np.ndarray):
        # not np.ascontiguousarray: it turns a 0-d array into shape (1,)
        result = from_numpy(array if array.flags.c_contiguous else array.copy())
    else:  # a device array from the engine: viewed in place, on the input's device
        result = torch.as_tensor(array, device=like.device)
    return result.to(like.dtype) if result.dtype != like.dtype else result


def in_place(tensor, submit, bfloat16=False):
    """Run ``submit(array)`` on a numpy view of ``tensor`` so the result lands in it
    (``bfloat16``: as ``as_numpy``'s)."""
    array = as_numpy(tensor, bfloat16=bfloat16)
    if (tensor.device.type == "cuda" and tensor.dtype not in _NUMPY_FREE
            and array.data_ptr() != tensor.data_ptr()):
        raise ValueError("an in-place collective needs a contiguous CUDA tensor; call "
                         ".contiguous() first or use the out-of-place form")
    if tensor.dtype in _NUMPY_FREE and not (bfloat16 and tensor.is_cpu):
        # the float32 copy (a numpy array, or a CUDA tensor) comes back into the bf16 tensor
        def finish(result):
            tensor.data.copy_(to_torch(result, tensor))
            return tensor
    else:
        def finish(result):
            return tensor
    return TorchHandle(submit(array), finish)


def group_finish(tensors):
    return lambda results: [to_torch(result, tensor) for result, tensor in zip(results, tensors)]
