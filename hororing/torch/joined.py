"""After ``hvd.join()`` every rank holds the same parameters, as after DDP's Join.

Ranks with fewer batches join early. Until the last rank joins, they add zeros to the others'
allreduces and step no more, so their parameters fall behind. When ``join()`` returns (the same
last rank everywhere), every DistributedOptimizer takes the last rank's parameters, in the
order the optimizers were made. The same code runs on every rank, so the order is the same,
and each broadcast is named after its parameter.
"""

import gc
import weakref

from ..process_sets import global_process_set
from .async_ops import broadcast_async_
from .bridge import synchronize

_OPTIMIZERS = []  # weak references to the DistributedOptimizers, in the order they were made


def track(optimizer):
    """Have ``optimizer`` take the last rank's parameters after each ``join()``."""
    _OPTIMIZERS.append(weakref.ref(optimizer))


def after_join(last_rank):
    """Every live tracked optimizer over the global process set: the last rank's
    parameters, broadcast to every rank."""
    # an optimizer dropped in a reference cycle goes now on every rank alike, not whenever
    # each rank's collector happens to run
    gc.collect()
    for reference in list(_OPTIMIZERS):
        optimizer = reference()
        if optimizer is None:
            _OPTIMIZERS.remove(reference)
            continue
        if optimizer.process_set is not global_process_set:
            continue
        handles = [broadcast_async_(parameter.data, last_rank, name=f"join.{name}")
                   for parameter, name in optimizer.joined_parameters()]
        for handle in handles:
            synchronize(handle)
