"""``hvd.elastic`` for torch: ``run``, ``TorchState``, ``ElasticSampler`` (Horovod's names)."""

from ...elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run,
                        run_fn)
from .sampler import ElasticSampler
from .state import TorchState

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run", "run_fn"]
