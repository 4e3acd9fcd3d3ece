"""hororing: a pip-installable, Horovod-compatible ring-allreduce library over MPI.

``import hororing as hvd`` gives Horovod's API over numpy arrays;
``import hororing.torch as hvd`` gives it over torch tensors.
"""

from .collectives import (allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                          allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                          broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
                          grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                          grouped_allreduce_async, grouped_allreduce_async_,
                          grouped_reducescatter, grouped_reducescatter_async, join, poll,
                          reducescatter, reducescatter_async, reducescatter_async_, synchronize)
from . import data
from . import elastic
from .async_optimizer import AsyncPSOptimizer
from .compression import Compression
from .config import Config
from .context import (cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank,
                      local_size, ps_stats, rank, shutdown, size, start_timeline, stop_timeline)
from .errors import HorovodInternalError, HostsUpdatedInterrupt, PreconditionError, RanksFailedError
from .objects import allgather_object, broadcast_object
from .ops import Adasum, Average, Max, Min, Product, Sum
from .optim import SGD, DistributedOptimizer
from .local_sgd import DiLoCo, LocalSGD
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .runner.programmatic import RunError, run

__version__ = "0.1.0"

__all__ = [
    "Adasum", "AsyncPSOptimizer", "Average", "Compression", "Config", "DiLoCo",
    "DistributedOptimizer", "HorovodInternalError", "HostsUpdatedInterrupt", "LocalSGD", "Max",
    "Min", "PreconditionError", "ProcessSet", "Product", "RanksFailedError", "RunError", "SGD",
    "Sum",
    "add_process_set", "global_process_set", "grouped_allgather", "grouped_allgather_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "remove_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "cross_rank",
    "cross_size", "data", "elastic", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_size",
    "poll", "ps_stats", "rank", "reducescatter", "reducescatter_async",
    "reducescatter_async_", "run", "shutdown", "size", "start_timeline",
    "stop_timeline", "synchronize",
]
