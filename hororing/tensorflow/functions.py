"""Broadcasting variables and Python objects between ranks, for TensorFlow programs."""

import warnings

import tensorflow as tf

from .. import collectives as core
from .. import objects
from ..process_sets import global_process_set, group_of
from .bridge import as_tensor, collective, restore
from .graph import op_name

__all__ = ["allgather_object", "broadcast_", "broadcast_global_variables", "broadcast_object",
           "broadcast_object_fn", "broadcast_variables"]


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``obj`` (any picklable object) on every rank.

    Every rank must call it. It runs at once, in eager and in graph programs alike;
    ``session`` is accepted for Horovod compatibility.
    """
    return objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """Return a function ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's TF1
    helper; every rank must call the function)."""
    def broadcast(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)
    return broadcast


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Return the list of every rank's ``obj``, in rank order. Every rank must call it."""
    return objects.allgather_object(obj, name=name, process_set=process_set)


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=True):
    """Give every rank ``root_rank``'s values of ``variables`` (one exchange for all of them).

    Every rank must call it with the same variables, in the same order.

    Args:
        variables: tf.Variables or Keras variables (e.g. ``model.variables``).
        root_rank: the rank whose values win, in ``hvd.rank()`` numbering.

    Returns:
        The grouped assign op (None when run eagerly, where the assignment is done).

    Warns:
        UserWarning: ``variables`` is empty (e.g. a Keras model not built yet).
    """
    variables = list(variables)
    if not variables:
        warnings.warn("broadcast_variables was given no variables, so nothing was broadcast: a "
                      "Keras model built on its first batch has none until then. Broadcast "
                      "after the first step, build the model first (keras.Input or "
                      "model.build(input_shape)), or use BroadcastGlobalVariablesCallback",
                      stacklevel=2)
    assigns = _assign_from_root(variables, root_rank, None, process_set, "broadcast_variables")
    if tf.executing_eagerly():
        return None
    return tf.group(*[assign for assign in assigns if assign is not None])


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Broadcast ``variables`` from ``root_rank`` in place; return their new values.

    Every rank must call it with the same variables, in the same order. In a graph the
    returned tensors are read after the assignment, so evaluating them performs it.

    Example:
        >>> value, = hvd.broadcast_([variable], root_rank=0)
    """
    variables = list(variables)
    assigns = _assign_from_root(variables, root_rank, name, process_set, "broadcast_")
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(variable) for variable in variables]
    values = []
    for variable, assign in zip(variables, assigns):
        with tf.control_dependencies([assign]):
            values.append(variable.read_value())
    return values


def _assign_from_root(variables, root_rank, name, process_set, kind):
    """Broadcast the variables' values in one op and assign them; return the assign ops."""
    variables = list(variables)
    if not variables:
        return []
    for index, variable in enumerate(variables):
        if not hasattr(variable, "assign"):
            raise TypeError(f"variables[{index}] is a {type(variable).__name__}, not a variable; "
                            f"{kind} assigns in place (use hvd.broadcast for tensors)")
    group = group_of(process_set)
    group.set_rank(root_rank)
    converted = [as_tensor(variable, f"variables[{index}]")
                 for index, variable in enumerate(variables)]
    label = op_name(kind, name, process_set)

    def run(arrays, base):
        handles = [core.broadcast_async(array, root_rank,
                                        name=None if base is None else f"{base}.{index}",
                                        process_set=process_set)
                   for index, array in enumerate(arrays)]
        return [core.synchronize(handle) for handle in handles]

    results = collective(kind, [tensor for tensor, _ in converted], run,
                         [tensor.dtype for tensor, _ in converted], label)
    return [variable.assign(tf.reshape(restore(result, dtype), tf.shape(tensor)))
            for variable, result, (tensor, dtype) in zip(variables, results, converted)]


def broadcast_global_variables(root_rank):
    """TensorFlow 1 graphs only: broadcast every global variable from ``root_rank``."""
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables is for TF1 graphs; in eager mode use "
                           "hvd.broadcast_variables(model.variables, root_rank=0)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)

