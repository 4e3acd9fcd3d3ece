"""Device arrays: recognising them, where they live, and whether MPI may touch them.

Nothing here imports cupy, numba or torch until a device array is actually seen (an array of
theirs cannot exist before they are imported), so host-only jobs never pay for them.
"""

from .arrays import as_device_view, check_device_array, device_dtype, is_device_array, ready_event
from .aware import cuda_aware, query_mpi_cuda_support
from .select import select_device

__all__ = ["as_device_view", "check_device_array", "cuda_aware", "device_dtype", "is_device_array",
           "query_mpi_cuda_support", "ready_event", "select_device"]
