"""``import hororing.torch as hvd``: Horovod's torch API over hororing.

The only package of hororing that imports torch.
"""

from ..environment import torch_huge_pages

torch_huge_pages()  # before the first large tensor: torch reads it once (environment.py)

from .. import (Adasum, Average, HorovodInternalError, Max, Min, ProcessSet, Product, Sum,
                add_process_set, cross_rank, cross_size, global_process_set, init,
                is_initialized, local_rank, local_size, ps_stats, rank, remove_process_set,
                shutdown, size)
from .. import data
from ..errors import HostsUpdatedInterrupt, PreconditionError, RanksFailedError
from . import checkpoint, comm_hooks, distributed, elastic
from .async_optimizer import AsyncPSOptimizer
from .bridge import poll, synchronize
from .build import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, gpu_available,
                    mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                      allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_,
                      broadcast_async, broadcast_async_, grouped_allgather,
                      grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                      grouped_reducescatter_async, join, reducescatter, reducescatter_async,
                      sparse_allreduce_async)
from .local_sgd import DiLoCo, LocalSGD
from .optimizer import DistributedOptimizer
from .sharded import ZeroRedundancyOptimizer
from .sync_batch_norm import SyncBatchNorm
from .timeline import start_timeline, stop_timeline

__all__ = [
    "Adasum", "AsyncPSOptimizer", "Average", "Compression", "DiLoCo", "DistributedOptimizer",
    "LocalSGD",
    "ZeroRedundancyOptimizer",
    "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min", "PreconditionError", "ProcessSet", "Product", "RanksFailedError", "Sum", "SyncBatchNorm",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "checkpoint", "cross_rank", "cross_size",
    "comm_hooks", "cuda_built", "distributed", "data", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "gpu_available",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_initialized", "join", "local_rank", "local_size",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "ps_stats",
    "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built",
    "shutdown", "size", "sparse_allreduce_async", "start_timeline", "stop_timeline",
    "synchronize",
]
