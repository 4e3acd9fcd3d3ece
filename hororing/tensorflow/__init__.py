"""``import hororing.tensorflow as hvd``: Horovod's TensorFlow API over hororing.

Collectives take ``tf.Tensor``s and variables, eagerly and inside ``tf.function`` (not with
``jit_compile=True``: XLA cannot run them). The only package of hororing, with its
``keras`` subpackage and ``hororing.keras``, that imports TensorFlow.
"""

from .. import (Adasum, Average, HorovodInternalError, Max, Min, ProcessSet, Product, Sum,
                add_process_set, cross_rank, cross_size, global_process_set, init,
                is_initialized, local_rank, local_size, ps_stats, rank, remove_process_set,
                shutdown, size, start_timeline, stop_timeline)
from .compression import Compression
from .functions import (allgather_object, broadcast_global_variables, broadcast_object,
                        broadcast_variables)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .mpi_ops import (allgather, allreduce, alltoall, barrier, broadcast, grouped_allgather,
                      grouped_allreduce, grouped_reducescatter, join, local_rank_op,
                      local_size_op, process_set_included_op, rank_op, reducescatter, size_op)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNormalization

__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer",
    "HorovodInternalError", "Max", "Min", "PartialDistributedGradientTape", "ProcessSet",
    "Product", "Sum", "SyncBatchNormalization", "add_process_set", "allgather",
    "allgather_object", "allreduce", "alltoall", "barrier", "broadcast",
    "broadcast_global_variables", "broadcast_object", "broadcast_variables", "cross_rank",
    "cross_size", "global_process_set", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "init", "is_initialized", "join", "local_rank", "local_rank_op",
    "local_size", "local_size_op", "process_set_included_op", "ps_stats", "rank", "rank_op",
    "reducescatter", "remove_process_set", "shutdown", "size", "size_op", "start_timeline",
    "stop_timeline",
]
