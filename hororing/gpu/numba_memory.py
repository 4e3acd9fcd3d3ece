"""Device memory through numba.cuda, for machines without cupy and for numba's CPU simulator
(``memory.py`` chooses it). No IPC: the device-direct ring needs cupy."""

import numpy as np


class NumbaMemory:
    """Device memory through numba.cuda (also its CPU simulator); arrays are numba device
    arrays."""

    name = "numba"
    can_share = False  # no IPC here: the device-direct ring needs cupy

    def __init__(self):
        from numba import cuda

        self.cuda = cuda
        self.stream = 0  # the default stream: numba's kernels and copies take it

    def activate(self, array=None):
        pass

    def synchronize(self):
        self.cuda.synchronize()

    def new_stream(self):
        return self.cuda.stream()

    def record(self, stream):
        event = self.cuda.event()
        event.record(stream)
        return event

    def wait(self, stream, event):
        event.wait(stream)

    def view(self, obj):
        if type(obj).__module__.startswith("numba"):
            return obj
        return self.cuda.as_cuda_array(obj)

    def empty(self, shape, dtype):
        return self.cuda.device_array(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        array = self.cuda.device_array(shape, dtype=dtype)
        if array.size:  # empty device arrays refuse copies (their strides differ)
            array.copy_to_device(np.zeros(shape, dtype))
        return array

    def empty_bytes(self, nbytes):
        return self.cuda.device_array(nbytes, dtype=np.uint8)

    @staticmethod
    def copy(target, source, stream=None):
        if target.size:
            target.copy_to_device(source.reshape(source.size))

    @staticmethod
    def download(source, start, stop, host, stream):
        if stop > start:
            source[start:stop].copy_to_host(host[start:stop], stream=stream)

    @staticmethod
    def upload(target, start, stop, host, stream):
        if stop > start:
            target[start:stop].copy_to_device(host[start:stop], stream=stream)

    def pinned(self, nbytes):
        return self.cuda.pinned_array(nbytes, dtype=np.uint8)

    @staticmethod
    def to_host(array):
        return array.copy_to_host()

    def to_device(self, host):
        return self.cuda.to_device(np.ascontiguousarray(host))

    @staticmethod
    def result_like(original, array):
        if type(original).__module__.startswith("cupy"):
            import cupy

            return cupy.asarray(array)
        return array

    def share(self, comm, nbytes):
        raise RuntimeError("device buffers cannot be shared between processes through numba; "
                           "install cupy (pip install 'hororing[cuda]') for the device-direct "
                           "ring, or set HORORING_DEVICE_RING=staged")
