"""Device memory through cupy, the backend a GPU job runs on (``memory.py`` chooses it):
copies are one driver call on raw pointers, kernels launch without marshalling each argument
in Python, and device buffers are shared between the processes of a node through CUDA IPC
(the device-direct ring)."""

import ctypes
import math

import numpy as np

from ..ops import numpy_dtype, torch_numpy_dtype


class CupyMemory:
    """Device memory through cupy; arrays handed out are cupy arrays."""

    name = "cupy"
    can_share = True  # CUDA IPC: see share()

    def __init__(self):
        import cupy

        self.cupy = cupy
        self.runtime = cupy.cuda.runtime
        self.device_id = self.runtime.getDevice()
        self._streams = {}
        self.stream = self._stream_of(self.device_id)
        self._address_range = None  # cuMemGetAddressRange, looked up on first use

    # ---- where the work runs --------------------------------------------------------------

    def activate(self, array=None):
        """Run this thread's device work on ``array``'s GPU (default: the one in use) and on
        the place's stream there."""
        device_id = self.device_of(array) if array is not None else self.device_id
        if self.runtime.getDevice() != device_id:
            self.runtime.setDevice(device_id)
        if device_id != self.device_id:
            self.device_id = device_id
            self.stream = self._stream_of(device_id)
        self.stream.use()

    def _stream_of(self, device_id):
        stream = self._streams.get(device_id)
        if stream is None:
            stream = self._streams[device_id] = self.cupy.cuda.Stream(non_blocking=True)
        return stream

    def device_of(self, array):
        module = type(array).__module__
        if module.startswith("torch"):
            return array.device.index
        if module.startswith("cupy"):
            return array.device.id
        return self.device_id

    def synchronize(self):
        """Wait for everything queued on the place's stream."""
        self.stream.synchronize()

    def new_stream(self):
        return self.cupy.cuda.Stream(non_blocking=True)

    def wait(self, stream, event):
        """Make ``stream`` wait for ``event`` (no host synchronization)."""
        stream.wait_event(event)

    # ---- arrays ---------------------------------------------------------------------------

    def view(self, obj):
        """``obj`` (cupy, torch CUDA tensor, numba or any CUDA-array-interface array) as a
        cupy array over the same memory."""
        cupy = self.cupy
        if isinstance(obj, cupy.ndarray):
            return obj
        if type(obj).__module__.startswith("torch"):
            # read directly: __cuda_array_interface__ builds a dict and asks cupy to
            # synchronize the producer's stream; the engine waited for it already
            return self.from_pointer(obj.data_ptr(), tuple(obj.shape), torch_numpy_dtype(obj.dtype),
                                     obj, obj.device.index)
        return cupy.asarray(obj)

    def from_pointer(self, pointer, shape, dtype, owner, device_id=None):
        """A cupy array over ``pointer`` (kept valid by ``owner``)."""
        cupy = self.cupy
        dtype = numpy_dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0 or pointer == 0:
            return cupy.empty(shape, dtype)
        memory = cupy.cuda.UnownedMemory(pointer, nbytes, owner,
                                         self.device_id if device_id is None else device_id)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))

    @staticmethod
    def pointer(array):
        return array.data.ptr

    def allocation_base(self, pointer):
        """The start of the device allocation holding ``pointer`` (None: unknown). Memory
        that lies back to back may still be two allocations (cupy's pool, two cudaMallocs),
        and one copy may not span both: the driver refuses it."""
        if self._address_range is None:
            self._address_range = _driver_address_range()
        if not self._address_range:
            return None
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        if self._address_range(ctypes.byref(base), ctypes.byref(size),
                               ctypes.c_uint64(pointer)) != 0:
            return None
        return base.value

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype)

    def zeros(self, shape, dtype):
        return self.cupy.zeros(shape, dtype)

    def empty_bytes(self, nbytes):
        return self.cupy.empty(nbytes, np.uint8)

    def copy(self, target, source, stream=None):
        """Copy flat ``source`` into ``target`` (device memory, either may be a peer's)."""
        nbytes = target.nbytes
        if nbytes:
            self.runtime.memcpyAsync(target.data.ptr, source.data.ptr, nbytes,
                                     self.runtime.memcpyDefault,
                                     (stream or self.stream).ptr)

    def download(self, source, start, stop, host, stream):
        """Queue a copy of ``source[start:stop]`` into the pinned ``host[start:stop]``."""
        self._host_copy(source, start, stop, host, stream, down=True)

    def upload(self, target, start, stop, host, stream):
        """Queue a copy of the pinned ``host[start:stop]`` into ``target[start:stop]``."""
        self._host_copy(target, start, stop, host, stream, down=False)

    def _host_copy(self, device, start, stop, host, stream, down):
        if stop <= start:
            return
        offset = start * device.itemsize
        on_device, on_host = device.data.ptr + offset, host.ctypes.data + offset
        runtime = self.runtime
        if down:
            runtime.memcpyAsync(on_host, on_device, (stop - start) * device.itemsize,
                                runtime.memcpyDeviceToHost, stream.ptr)
        else:
            runtime.memcpyAsync(on_device, on_host, (stop - start) * device.itemsize,
                                runtime.memcpyHostToDevice, stream.ptr)

    def pinned(self, nbytes):
        """A numpy uint8 array of ``nbytes`` in page-locked host memory."""
        import cupyx

        return cupyx.empty_pinned((nbytes,), np.uint8)

    def to_host(self, array):
        """A numpy copy of the device ``array`` (waits for it)."""
        host = np.empty(array.shape, array.dtype)
        if host.nbytes:
            self.runtime.memcpyAsync(host.ctypes.data, array.data.ptr, host.nbytes,
                                     self.runtime.memcpyDeviceToHost, self.stream.ptr)
        self.stream.synchronize()
        return host

    def to_device(self, host):
        host = np.ascontiguousarray(host)
        array = self.cupy.empty(host.shape, host.dtype)
        if host.nbytes:
            self.runtime.memcpyAsync(array.data.ptr, host.ctypes.data, host.nbytes,
                                     self.runtime.memcpyHostToDevice, self.stream.ptr)
        self.stream.synchronize()  # the host array may go as soon as this returns
        return array

    def result_like(self, original, array):
        """``array`` in the type of ``original`` (no copy); torch tensors are converted by
        hororing.torch, which knows their dtype and device."""
        if type(original).__module__.startswith("numba"):
            from numba import cuda

            return cuda.as_cuda_array(array)
        return array

    # ---- CUDA IPC -------------------------------------------------------------------------

    def share(self, comm, nbytes, events=0):
        """A device buffer of ``nbytes`` and ``events`` events on every rank of ``comm`` (all
        on one node), each rank's readable (buffer) and waitable (events) by the others
        through CUDA IPC. Collective; returns a ``SharedBuffers`` or raises where a handle
        cannot be opened (on that rank only: callers agree on the outcome, see
        ``DeviceDirectRing``)."""
        cupy, runtime = self.cupy, self.runtime
        # a cudaMalloc of its own: an IPC handle covers a whole allocation, and cupy's pool
        # sub-allocates
        own = cupy.cuda.Memory(max(1, nbytes))
        own_events = [cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
                      for _ in range(events)]
        handles = comm.allgather((runtime.ipcGetMemHandle(own.ptr),
                                  [runtime.ipcGetEventHandle(event.ptr) for event in own_events]))
        rank = comm.Get_rank()
        opened, opened_events, peers, peer_events = [], [], [], []
        try:
            for peer, (memory_handle, event_handles) in enumerate(handles):
                if peer == rank:
                    pointer = own.ptr
                    peer_events.append([event.ptr for event in own_events])
                else:
                    pointer = runtime.ipcOpenMemHandle(memory_handle)
                    opened.append(pointer)
                    peer_events.append([runtime.ipcOpenEventHandle(handle)
                                        for handle in event_handles])
                    opened_events.extend(peer_events[-1])
                peers.append(self.from_pointer(pointer, (nbytes,), np.uint8, own))
        except Exception:
            _close_all(runtime, opened, opened_events)
            raise
        shared = SharedBuffers(peers[rank], peers,
                               lambda: _close_all(runtime, opened, opened_events))
        shared.events = peer_events
        shared.own_events = own_events  # kept alive with the buffer
        return shared

    def record(self, stream, event=None):
        """Record ``event`` (an event pointer of ``share``'s; None: a new event) on
        ``stream``; return the event."""
        if event is None:
            event = self.cupy.cuda.Event(block=False, disable_timing=True)
            event.record(stream)
            return event
        self.runtime.eventRecord(event, stream.ptr)
        return event

    def wait_pointer(self, stream, event):
        """Make ``stream`` wait for the last recording of ``event`` (an event pointer, this
        process's or a peer's) made before this call."""
        self.runtime.streamWaitEvent(stream.ptr, event, 0)


class SharedBuffers:
    """Every rank's shared buffer as flat uint8 arrays (``peers[rank]`` is this rank's own,
    ``own``) and, where asked for, every rank's events (``events[rank][k]``, event pointers).
    ``release()`` closes the peers' buffers and events opened here; call it on every rank
    between two barriers, and drop the object after the second: this rank's own allocation
    (which the arrays keep alive) must outlive every peer's mapping of it."""

    events = ()

    def __init__(self, own, peers, release):
        self.own = own
        self.peers = peers
        self.nbytes = own.nbytes
        self._release = release

    def release(self):
        self._release()
        self._release = _nothing


def _close_all(runtime, opened, opened_events):
    for pointer in opened:
        runtime.ipcCloseMemHandle(pointer)
    for event in opened_events:
        runtime.eventDestroy(event)


def _nothing():
    pass


def _driver_address_range():
    """The driver's cuMemGetAddressRange (False where the driver library cannot be loaded)."""
    try:
        function = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return False
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                         ctypes.c_uint64]
    return function
