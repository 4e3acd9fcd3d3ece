"""How each collective's gradient is made, written once for every binding.

Horovod's rules (each binding's autograd applies them to its own tensors):

- allreduce: the allreduce of the output's gradient, with the forward's op and scales;
- allgather: the Average-allreduce of the output's gradient, of which each rank keeps the
  rows its own input gave (``own_row_starts``);
- broadcast: the Average-allreduce of the output's gradient on the root, zero elsewhere
  (``keeps_broadcast_gradient``);
- alltoall: the output's gradient sent back to where its rows came from;
- reducescatter: the allgather of the output's gradient, scaled as the forward scaled
  (``reducescatter_gradient_scale``).
"""

import numpy as np

from . import collectives, ops
from .process_sets import group_of
from .running import current


def own_row_starts(rows, process_set=None, name=None):
    """Where this rank's rows start in each allgathered output, for inputs of ``rows`` rows
    (one count per tensor of a grouped allgather). One allgather of the counts: a
    collective over the set, called by every member alike."""
    counts = collectives.allgather(np.asarray(rows, dtype=np.int64), name=name,
                                   process_set=process_set)
    group = group_of(process_set)
    return counts.reshape(group.size, len(rows))[:group.rank].sum(axis=0).tolist()


def keeps_broadcast_gradient(root_rank):
    """Whether this rank's input to a broadcast gets the averaged gradient (the root), or
    zero (every other rank)."""
    return current().rank == root_rank


def reducescatter_gradient_scale(op, prescale_factor, postscale_factor, process_set=None):
    """The factor a reducescatter's output gradient is scaled by before it is allgathered:
    the forward's scales, and for Sum the set's size (each rank's block summed everyone's)."""
    scale = prescale_factor * postscale_factor
    if op == ops.Sum:
        scale *= group_of(process_set).size
    return scale
