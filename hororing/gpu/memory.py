"""Device memory through one small interface: cupy where it is installed and sees a GPU,
numba.cuda elsewhere (its CPU simulator in CI).

The device place (``engine/device.py``), the staged ring and the device-direct ring ask this
object, never a library, for device arrays, copies, pinned host memory, streams and events.
cupy is the one a GPU job runs on: its copies are one driver call on raw pointers and its
kernels launch without marshalling each argument in Python, where a numba copy of an array
slice cost 120-150 us and a numba launch tens of microseconds per array argument (measured on
an H100, docs/gpu.md). numba stays for machines without cupy and for the simulator.

Every device operation of one place runs on the place's own stream (``stream``), in the
thread that calls ``activate`` first: work queued by the training thread on its own stream is
waited for through the events recorded at submission, never through the legacy default
stream, so the place's copies and reductions can run beside the framework's kernels.
"""

import sys

from .cupy_memory import CupyMemory
from .numba_memory import NumbaMemory


def memory_for_device_arrays():
    """CupyMemory where cupy imports and sees a GPU, unless numba.cuda runs in its simulator
    (whose arrays live in host memory); else NumbaMemory."""
    numba_cuda = sys.modules.get("numba.cuda")  # simulated arrays exist only once it is imported
    if numba_cuda is None or not numba_cuda.config.ENABLE_CUDASIM:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return CupyMemory()
        except Exception:  # no cupy, or cupy without a driver
            pass
    return NumbaMemory()
