"""torch.distributed over hororing: ``dist.init_process_group("hororing")``.

Importing ``hororing.torch`` registers the ``hororing`` backend with torch.distributed. Under
mpirun, hororun or srun nothing else is needed: rank and world size come from MPI
(``rendezvous.py``), and every collective torch.distributed has runs on hororing's engine
(``backend.py``), so DistributedDataParallel, its comm hooks, ZeroRedundancyOptimizer,
SyncBatchNorm and torch.distributed.checkpoint run on MPI from a pip wheel.

Example:
    >>> import torch.distributed as dist
    >>> import hororing.torch  # registers the backend
    >>> dist.init_process_group("hororing")
    >>> model = torch.nn.parallel.DistributedDataParallel(model)
"""

import torch.distributed as dist

from . import rendezvous
from .backend import NAME, ProcessGroupHororing, make

__all__ = ["NAME", "ProcessGroupHororing", "register"]


def register():
    """Register the ``hororing`` backend (CPU and CUDA tensors) and the MPI rendezvous; done
    on import, again harmless."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, make, extended_api=True, devices=["cpu", "cuda"])
    rendezvous.install()


register()
