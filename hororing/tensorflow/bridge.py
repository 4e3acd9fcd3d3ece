"""The bridge between TensorFlow tensors and the engine: one collective is one stateful op.

A collective runs as ``tf.numpy_function(..., stateful=True)``: eagerly it runs at once; in
a ``tf.function`` it is an op that TensorFlow's automatic control dependencies keep in
program order with the other stateful ops, so every rank issues its collectives in the same
order (a stateless Python op may be reordered by the executor, which pairs the wrong tensors
between ranks). Several tensors that belong together (a tape's gradients) go into one op
that submits them all before waiting, so the engine fuses them into few exchanges and only
one executor thread blocks.

Names: eager calls are numbered by the core as its own unnamed calls are; an op built in a
``tf.function`` takes its name when it is traced, from the function's graph, so it is the
same on every rank and on every run of the function (the engine's response cache then
applies). bfloat16 and bool, which the engine does not carry, travel as float32 and uint8.
"""

import re
import sys

import numpy as np
import tensorflow as tf

from ..process_sets import group_of

_CARRIED = {tf.bfloat16: tf.float32, tf.bool: tf.uint8}
_ENGINE_DTYPES = (tf.uint8, tf.int8, tf.uint16, tf.int16, tf.uint32, tf.int32, tf.uint64,
                  tf.int64, tf.float16, tf.float32, tf.float64)
_NAMES = ", ".join(dtype.name for dtype in _ENGINE_DTYPES + tuple(_CARRIED))


def as_tensor(tensor, argument="tensor", reduces=False):
    """Return ``tensor`` as a ``tf.Tensor`` in a dtype the engine carries, and its own dtype.

    Raises:
        TypeError: not a TensorFlow tensor or variable, or a dtype no collective takes.
    """
    tensor = to_tf(tensor, argument)
    dtype = tensor.dtype
    if dtype in _ENGINE_DTYPES:
        return tensor, dtype
    if dtype == tf.bool and reduces:
        raise TypeError(f"{argument} is a bool tensor, which cannot be reduced; cast it with "
                        f"tf.cast(..., tf.int32) first")
    if dtype in _CARRIED:
        return tf.cast(tensor, _CARRIED[dtype]), dtype
    raise TypeError(f"{argument} has dtype {dtype.name}, which hororing's collectives do not "
                    f"take; supported: {_NAMES}. Cast it with tf.cast(...)")


def to_tf(tensor, argument="tensor"):
    """Return a TensorFlow tensor or variable (Keras's included) as a ``tf.Tensor``.

    Raises:
        TypeError: anything else (numpy arrays, torch tensors, lists), with the fix.
    """
    if isinstance(tensor, tf.Tensor):
        return tensor
    if isinstance(tensor, tf.IndexedSlices):
        raise TypeError(f"{argument} is a tf.IndexedSlices; only allreduce takes sparse "
                        f"gradients (or convert it with tf.convert_to_tensor(...))")
    if not (isinstance(tensor, tf.Variable) or _is_keras_variable(tensor)):
        got = "None" if tensor is None else type(tensor).__name__
        raise TypeError(f"{argument} must be a tf.Tensor or tf.Variable, got {got}; convert "
                        f"it with tf.convert_to_tensor(...) (import hororing as hvd for numpy "
                        f"arrays, hororing.torch for torch tensors)")
    return tf.convert_to_tensor(tensor)


def restore(tensor, dtype):
    """Cast a result back to the caller's dtype where it travelled as another."""
    return tensor if tensor.dtype == dtype else tf.cast(tensor, dtype)


def _is_keras_variable(value):
    return type(value).__module__.startswith("keras.") and hasattr(value, "assign")


def op_name(kind, name, process_set=None):
    """The name the engine matches this collective by, or None for the core to number it."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str or None, got {name!r}")
        return name
    if tf.executing_eagerly():
        return None
    graph = _traced_function_graph()
    label = group_of(process_set).set_id
    unique = graph.unique_name(f"hororing_{kind}_set{label}", mark_as_used=True)
    return f"{graph.name}/{unique}"


def _traced_function_graph():
    """The graph of the outermost ``tf.function`` being traced.

    Graphs nested in it (the branches of a ``tf.cond``, a loop body) are named with a
    process-wide counter (``cond_true_12``) that differs between ranks whose programs built
    different numbers of ops before; the outermost function's name is the function's own,
    and its name counter numbers the collectives of the whole trace in program order.
    """
    graph = tf.compat.v1.get_default_graph()
    outer = getattr(graph, "outer_graph", None)
    while outer is not None and hasattr(outer, "outer_graph"):
        graph, outer = outer, outer.outer_graph
    return graph


def collective(kind, tensors, run, out_dtypes, name=None):
    """Run ``run(arrays, name)`` over ``tensors`` as one stateful op; return its outputs.

    ``run`` gets numpy arrays and returns one numpy array per dtype in ``out_dtypes``.
    """
    check_not_xla()
    if tf.executing_eagerly():  # run here, so the engine's own exceptions reach the caller
        results = run([np.asarray(tensor.numpy()) for tensor in tensors], name)
        return [tf.convert_to_tensor(np.asarray(result, dtype=dtype.as_numpy_dtype))
                for result, dtype in zip(results, out_dtypes)]

    def body(*arrays):
        results = run([np.asarray(array) for array in arrays], name)
        return [np.asarray(result, dtype=dtype.as_numpy_dtype)
                for result, dtype in zip(results, out_dtypes)]

    outputs = tf.numpy_function(body, list(tensors), list(out_dtypes), stateful=True,
                                name=_op_label(kind))
    return outputs if isinstance(outputs, (list, tuple)) else [outputs]


def _op_label(kind):
    return "Hororing" + re.sub(r"(?:^|_)([a-z])", lambda match: match.group(1).upper(), kind)


def check_not_xla():
    """Refuse to build a collective in a function that XLA compiles (it cannot run Python ops).

    TensorFlow keeps ``jit_compile`` on the ``tf.function`` being traced, not on its graph;
    the tracing call is on the stack while the collective is built, so it is found there.
    """
    if tf.executing_eagerly():
        return
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if (owner is not None and type(owner).__module__.endswith("polymorphic_function")
                and getattr(owner, "_jit_compile", False)):
            raise RuntimeError(
                "hororing's collectives are Python ops, which XLA cannot compile: build this "
                "tf.function with jit_compile=False (Keras: model.compile(..., "
                "jit_compile=False))")
        frame = frame.f_back
