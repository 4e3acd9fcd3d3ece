"""``import hororing.tensorflow.keras as hvd`` (or ``hororing.keras``): Horovod's Keras API.

For Keras 3 with the TensorFlow backend, or tf-keras when ``TF_USE_LEGACY_KERAS=1``::

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())),
                  loss=...)
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback()],
              verbose=1 if hvd.rank() == 0 else 0)
"""

from ... import (Adasum, Average, HorovodInternalError, Max, Min, ProcessSet, Product, Sum,
                 add_process_set, cross_rank, cross_size, global_process_set, init,
                 is_initialized, local_rank, local_size, ps_stats, rank, remove_process_set,
                 shutdown, size, start_timeline, stop_timeline)
from ..compression import Compression
from ..functions import allgather_object, broadcast_object, broadcast_variables
from ..mpi_ops import allgather, allreduce, alltoall, barrier, broadcast, join, reducescatter
from ...errors import HostsUpdatedInterrupt
from . import callbacks, elastic
from ._backend import keras
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer


def broadcast_global_variables(root_rank):
    """Horovod's Keras name: in Keras 3 use BroadcastGlobalVariablesCallback or
    ``hvd.broadcast_variables(model.variables, root_rank)``."""
    raise RuntimeError("broadcast_global_variables needs a TF1 session; with Keras 3 use "
                       "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) or "
                       "hvd.broadcast_variables(model.variables, root_rank)")


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, **optimizer_options):
    """Load a saved Keras model and wrap its optimizer in DistributedOptimizer.

    Every rank loads the file itself; ``custom_optimizers`` (classes) and ``custom_objects``
    are handed to Keras. The optimizer's state comes from the file, the same on every rank.
    """
    objects = dict(custom_objects or {})
    for optimizer_class in custom_optimizers or []:
        objects[optimizer_class.__name__] = optimizer_class
    model = keras.models.load_model(filepath, custom_objects=objects)
    if getattr(model, "optimizer", None) is not None:
        DistributedOptimizer(model.optimizer, compression=compression, **optimizer_options)
    return model


__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max",
    "Min", "PartialDistributedOptimizer", "ProcessSet", "Product", "Sum", "add_process_set",
    "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast",
    "broadcast_global_variables", "broadcast_object", "broadcast_variables", "callbacks",
    "cross_rank", "cross_size", "elastic", "global_process_set", "init", "is_initialized", "join",
    "load_model", "local_rank", "local_size", "ps_stats", "rank", "reducescatter",
    "remove_process_set", "shutdown", "size", "start_timeline", "stop_timeline",
]
