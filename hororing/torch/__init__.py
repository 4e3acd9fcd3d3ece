"""``import hororing.torch as hvd``: Horovod's torch API over hororing.

The only package of hororing that imports torch.
"""

from .. import (Adasum, Average, HorovodInternalError, Max, Min, Product, Sum, barrier,
                cross_rank, cross_size, init, is_initialized, join, local_rank, local_size,
                ps_stats, rank, shutdown, size)
from .. import data
from .async_optimizer import AsyncPSOptimizer
from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                      allreduce_async_, alltoall, alltoall_async, broadcast, broadcast_,
                      broadcast_async, broadcast_async_, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, poll, reducescatter,
                      reducescatter_async, synchronize)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from .timeline import start_timeline, stop_timeline


def mpi_built():
    """True: hororing always runs over MPI."""
    return True


def mpi_enabled():
    """True once MPI is in use (always, for hororing)."""
    return True


def gloo_built():
    """False: hororing has no gloo controller."""
    return False


def nccl_built():
    """False: GPU tensors are reduced by hororing's ring, not NCCL."""
    return False


def cuda_built():
    """False: this build reduces CPU tensors."""
    return False


def rocm_built():
    return False


__all__ = [
    "Adasum", "AsyncPSOptimizer", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max",
    "Min", "Product", "Sum", "SyncBatchNorm", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "cross_rank",
    "cross_size", "cuda_built", "gloo_built", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "init", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "nccl_built", "poll", "ps_stats", "rank",
    "reducescatter", "reducescatter_async", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline", "synchronize",
]
