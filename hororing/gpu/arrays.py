"""Device arrays of any library: recognising them and checking them at the door.

cupy arrays, numba device arrays and anything else exposing ``__cuda_array_interface__``
(torch CUDA tensors, for one) are device arrays; the device memory object (``memory.py``)
views them in the library the engine runs on, and hands results back in the caller's type.
"""

import numpy as np

from ..ops import SUPPORTED_NAMES, supported, torch_numpy_dtype


def is_device_array(obj):
    """True for a cupy array, a numba.cuda device array or any CUDA-array-interface object."""
    if isinstance(obj, np.ndarray):  # the common case, decided before any string work
        return False
    module = type(obj).__module__
    return (module.startswith("cupy") or module.startswith("numba")
            or hasattr(obj, "__cuda_array_interface__"))


def as_device_view(array):
    """``array`` as a numba.cuda device array sharing its memory."""
    if type(array).__module__.startswith("numba"):
        return array
    from numba import cuda

    return cuda.as_cuda_array(array)


def device_dtype(array):
    """The numpy dtype of a device array; torch tensors' own dtype is not numpy's, so theirs is
    read from ``__cuda_array_interface__``."""
    if type(array).__module__.startswith("torch"):
        try:
            return torch_numpy_dtype(array.dtype)
        except TypeError:  # a dtype numpy lacks: refused by check_device_array
            pass
    try:
        return np.dtype(array.dtype)
    except TypeError:
        return np.dtype(array.__cuda_array_interface__["typestr"])


def check_device_array(array, argument="tensor"):
    """Raise a clear error for a device array the kernels or transports cannot take."""
    dtype = device_dtype(array)
    if not supported(dtype):
        raise TypeError(f"{argument} is a device array of unsupported dtype {dtype}; supported "
                        f"dtypes: {', '.join(SUPPORTED_NAMES)}. Convert it with .astype(...)")
    if not _c_contiguous(array):
        strides = getattr(array, "strides", None)
        if strides is None or callable(strides):  # torch: a method; the interface has them
            strides = array.__cuda_array_interface__["strides"]
        raise ValueError(f"{argument} is a non-contiguous device array (shape {tuple(array.shape)},"
                         f" strides {tuple(strides)}); pass a contiguous one, e.g. "
                         f"cupy.ascontiguousarray({argument})")
    if type(array).__module__.startswith("cupy"):
        import cupy

        current = cupy.cuda.runtime.getDevice()
        if array.device.id != current:
            raise ValueError(f"{argument} is on GPU {array.device.id}, but this rank uses GPU "
                             f"{current}; move it with cupy.asarray inside "
                             f"'with cupy.cuda.Device({current}):', or select its device first")
    return array


def ready_event(array):
    """An object whose ``synchronize()`` returns once work queued on ``array`` is done.

    cupy and torch: an event recorded on the current stream at submission, so the engine
    waits for exactly the work that produced the data; numba arrays: the device is
    synchronized.
    """
    if type(array).__module__.startswith("torch"):
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(array.device))
        return event
    if type(array).__module__.startswith("cupy"):
        import cupy

        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record()
        return event
    return _DeviceSynchronize()


class _DeviceSynchronize:
    @staticmethod
    def synchronize():
        from numba import cuda

        cuda.synchronize()


def _c_contiguous(array):
    if type(array).__module__.startswith("torch"):
        return array.is_contiguous()
    flags = getattr(array, "flags", None)
    if flags is not None and not isinstance(flags, dict):
        return bool(flags.c_contiguous)
    if hasattr(array, "is_c_contiguous"):
        return bool(array.is_c_contiguous())
    interface = array.__cuda_array_interface__
    if interface.get("strides") is None:  # the interface's way of saying C-contiguous
        return True
    expected = device_dtype(array).itemsize
    for extent, stride in zip(reversed(interface["shape"]), reversed(interface["strides"])):
        if extent > 1 and stride != expected:
            return False
        expected *= extent
    return True
