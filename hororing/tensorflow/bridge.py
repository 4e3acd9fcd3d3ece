"""The bridge between TensorFlow tensors and the engine: one collective is one stateful op.

A collective runs as ``tf.numpy_function(..., stateful=True)``: eagerly it runs at once; in
a ``tf.function`` it is an op that TensorFlow's automatic control dependencies keep in
program order with the other stateful ops, so every rank issues its collectives in the same
order (a stateless Python op may be reordered by the executor, which pairs the wrong tensors
between ranks); in a TF1 ``tf.Graph`` run by a Session the ops one ``session.run`` executes
pair up by name, whatever order the executor picks (graph.py). Several tensors that belong
together (a tape's gradients) go into one op that submits them all before waiting, so the
engine fuses them into few exchanges and only one executor thread blocks.

Names: eager calls are numbered by the core as its own unnamed calls are; an op built in a
graph takes its name when it is built (graph.py), so it is the same on every rank and on
every run (the engine's response cache then applies). bool, which the engine does not
carry, travels as uint8.
"""

import re
import sys

import numpy as np
import tensorflow as tf

from ..errors import PreconditionError
from ..ops import supported_dtypes
from .errors import as_tf_error
from .graph import raise_on_failure

_CARRIED = {tf.bool: tf.uint8}  # bfloat16 is the engine's own (ml_dtypes, as TF's numpy)
_ENGINE_DTYPES = tuple(tf.as_dtype(dtype) for dtype in supported_dtypes())  # the engine's list
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


def collective(kind, tensors, run, out_dtypes, name=None):
    """Run ``run(arrays, name)`` over ``tensors`` as one stateful op; return its outputs.

    ``run`` gets numpy arrays and returns one numpy array per dtype in ``out_dtypes``. Its
    errors reach the program as the TensorFlow errors Horovod's ops raise (``errors.py``;
    in a traced graph through ``graph.raise_on_failure``).
    """
    check_not_xla()
    if tf.executing_eagerly():  # run here, so the engine's own exceptions reach the caller
        try:
            results = run([np.asarray(tensor.numpy()) for tensor in tensors], name)
        except Exception as error:
            translated = as_tf_error(error)
            if translated is None:
                raise
            raise translated from error
        return [tf.convert_to_tensor(np.asarray(result, dtype=dtype.as_numpy_dtype))
                for result, dtype in zip(results, out_dtypes)]

    def body(*arrays):
        try:
            results = run([np.asarray(array) for array in arrays], name)
        except PreconditionError as error:  # raised as FailedPreconditionError by the graph
            return [np.empty(0, dtype=dtype.as_numpy_dtype) for dtype in out_dtypes] + [
                np.bytes_(str(error).encode("utf-8"))]
        return [np.asarray(result, dtype=dtype.as_numpy_dtype)
                for result, dtype in zip(results, out_dtypes)] + [np.bytes_(b"")]

    *outputs, failure = tf.numpy_function(body, list(tensors), list(out_dtypes) + [tf.string],
                                          stateful=True, name=_op_label(kind))
    return raise_on_failure(outputs, failure)


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
