"""Broadcasting variables and Python objects between ranks, for TensorFlow programs."""

import tensorflow as tf

from .. import collectives as core
from ..objects import allgather_object, broadcast_object
from ..process_sets import global_process_set, group_of
from .bridge import as_tensor, collective, op_name, restore

__all__ = ["allgather_object", "broadcast_global_variables", "broadcast_object",
           "broadcast_variables"]


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=True):
    """Give every rank ``root_rank``'s values of ``variables`` (one exchange for all of them).

    Args:
        variables: tf.Variables or Keras variables (e.g. ``model.variables``).
        root_rank: the rank whose values win, in ``hvd.rank()`` numbering.

    Returns:
        The grouped assign op (None when run eagerly, where the assignment is done).
    """
    variables = list(variables)
    if not variables:
        return None
    for index, variable in enumerate(variables):
        if not hasattr(variable, "assign"):
            raise TypeError(f"variables[{index}] is a {type(variable).__name__}, not a variable; "
                            f"broadcast_variables assigns in place (use hvd.broadcast for tensors)")
    group = group_of(process_set)
    group.set_rank(root_rank)
    converted = [as_tensor(variable, f"variables[{index}]")
                 for index, variable in enumerate(variables)]
    label = op_name("broadcast_variables", None, process_set)

    def run(arrays, base):
        handles = [core.broadcast_async(array, root_rank,
                                        name=None if base is None else f"{base}.{index}",
                                        process_set=process_set)
                   for index, array in enumerate(arrays)]
        return [core.synchronize(handle) for handle in handles]

    results = collective("broadcast_variables", [tensor for tensor, _ in converted], run,
                         [tensor.dtype for tensor, _ in converted], label)
    assigns = [variable.assign(tf.reshape(restore(result, dtype), tf.shape(tensor)))
               for variable, result, (tensor, dtype) in zip(variables, results, converted)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[assign for assign in assigns if assign is not None])


def broadcast_global_variables(root_rank):
    """TensorFlow 1 graphs only: broadcast every global variable from ``root_rank``."""
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables is for TF1 graphs; in eager mode use "
                           "hvd.broadcast_variables(model.variables, root_rank=0)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)

