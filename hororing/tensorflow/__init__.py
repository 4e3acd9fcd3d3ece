"""``import hororing.tensorflow as hvd``: Horovod's TensorFlow API over hororing.

Collectives take ``tf.Tensor``s and variables, eagerly and inside ``tf.function`` (not with
``jit_compile=True``: XLA cannot run them). The only package of hororing, with its
``keras`` subpackage and ``hororing.keras``, that imports TensorFlow.
"""

from ..environment import reserve_tf_inter_op_threads, reserve_tf_intra_op_threads
from ..slurm import tensorflow_intra_op_threads

reserve_tf_inter_op_threads()  # before any session: graph.py, "Threads"
_intra_op_threads = tensorflow_intra_op_threads()
if _intra_op_threads is not None:  # each rank its share of the node's cores
    reserve_tf_intra_op_threads(_intra_op_threads)

from .. import (Adasum, Average, HorovodInternalError, Max, Min, ProcessSet, Product, Sum,
                add_process_set, cross_rank, cross_size, global_process_set, init,
                is_homogeneous, is_initialized, local_rank, local_size, ps_stats, rank,
                remove_process_set, shutdown, size, start_timeline, stop_timeline)
from ..build import (ccl_built, ddl_built, gloo_built, gloo_enabled, gpu_available, mpi_built,
                     mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from ..errors import HostsUpdatedInterrupt
from . import elastic
from .compression import Compression
from .functions import (allgather_object, broadcast_, broadcast_global_variables,
                        broadcast_object, broadcast_object_fn, broadcast_variables)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .mpi_ops import (allgather, allreduce, alltoall, barrier, broadcast, grouped_allgather,
                      grouped_allreduce, grouped_reducescatter, join, local_rank_op,
                      local_size_op, process_set_included_op, rank_op, reducescatter, size_op)
from .optimizer import DistributedOptimizer
from .session_hooks import BroadcastGlobalVariablesHook
from .sync_batch_norm import SyncBatchNormalization


def cuda_built():
    """False: TensorFlow tensors reach hororing's engine as host arrays, on every device."""
    return False


__all__ = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "Compression",
    "DistributedGradientTape", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min",
    "PartialDistributedGradientTape", "ProcessSet", "Product", "Sum", "SyncBatchNormalization",
    "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall", "barrier",
    "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn", "broadcast_variables", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "gpu_available",
    "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op", "local_size",
    "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "process_set_included_op", "ps_stats", "rank", "rank_op", "reducescatter",
    "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "start_timeline",
    "stop_timeline",
]
