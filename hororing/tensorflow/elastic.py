"""``hvd.elastic`` for TensorFlow: ``run``, ``TensorFlowState``, ``TensorFlowKerasState``.

Variables are saved as numpy values, so a commit can be written to disk and read back by a
relaunched job (hororing.elastic). ``TensorFlowState`` also works in a TF1 graph with a
session; the Keras state is for eager programs (TensorFlow 2).
"""

import functools

import tensorflow as tf

from ..elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run_fn
from ..elastic.state import HandledState, StateHandler
from .functions import broadcast_object, broadcast_variables

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "run", "run_fn"]


def run(func):
    """Horovod's ``hvd.elastic.run`` for TensorFlow (see hororing.elastic.run).

    A collective that fails inside a ``tf.function`` reaches Python as TensorFlow's
    ``UnknownError`` or ``FailedPreconditionError`` from hororing's op, not as
    ``HorovodInternalError``; such an error is turned into one, so the state rolls back.
    """
    @functools.wraps(func)
    def translating(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except (tf.errors.UnknownError, tf.errors.FailedPreconditionError) as error:
            if isinstance(error, HorovodInternalError) or not _from_hororing(error):
                raise
            raise HorovodInternalError(error.message) from error
    return run_fn(translating)


def _from_hororing(error):
    message = error.message or ""
    return "hororing collective failed" in message or "Hororing" in message


class _VariablesHandler(StateHandler):
    """A list of variables, read and assigned eagerly or through a TF1 session."""

    def __init__(self, value, session=None):
        self.value = value
        self.session = session
        self._broadcast_op = None
        if not tf.executing_eagerly():  # one op, built once, run by every sync
            self._broadcast_op = broadcast_variables(self.variables(), root_rank=0)
        super().__init__(value)

    def variables(self):
        return list(self.value)

    def capture(self):
        variables = self.variables()
        if self.session is not None:
            return list(self.session.run(variables))
        return [variable.numpy() for variable in variables]

    def apply(self, saved):
        variables = self.variables()
        if len(saved) != len(variables):
            raise ValueError(f"the saved state has {len(saved)} variables, this one "
                             f"{len(variables)}: was the model or optimizer changed?")
        for variable, value in zip(variables, saved):
            if self.session is not None:
                variable.load(value, self.session)
            else:
                variable.assign(value)

    def sync(self):
        if self._broadcast_op is not None:
            self.session.run(self._broadcast_op)
        else:
            broadcast_variables(self.variables(), root_rank=0)


class _ModelHandler(_VariablesHandler):
    def variables(self):
        return list(self.value.variables)


class _OptimizerHandler(_VariablesHandler):
    """An optimizer's variables, its slots created up front.

    Optimizers create their slots (momentum, Adam's moments) on their first step. Were the
    first commit taken before it, restoring it after a failure in the first batches would
    find more variables than were saved; so the slots are created for the model's trainable
    variables when the state is made, and every commit holds all of them.
    """

    def __init__(self, optimizer, model):
        create_slots(optimizer, model.trainable_variables)
        super().__init__(optimizer)

    def variables(self):
        variables = self.value.variables
        return list(variables() if callable(variables) else variables)


def create_slots(optimizer, variables):
    """Create ``optimizer``'s slot variables for ``variables`` unless it has them already."""
    if hasattr(optimizer, "_create_all_weights"):  # tf-keras's legacy (OptimizerV2) line
        optimizer._create_all_weights(variables)
    elif hasattr(optimizer, "build") and not (getattr(optimizer, "built", False)
                                              or getattr(optimizer, "_built", False)):
        optimizer.build(variables)  # Keras 3, and tf-keras's current optimizers


class TensorFlowState(HandledState):
    """State of a list of TensorFlow variables (Horovod's ``hvd.elastic.TensorFlowState``).

    Args:
        variables: the variables (default: ``tf.compat.v1.global_variables()``).
        session: in a TF1 graph, the session that holds their values (default: the default
            session).
        **kwargs: plain Python objects to keep too, exposed as attributes.
    """

    def __init__(self, variables=None, session=None, **kwargs):
        eager = tf.executing_eagerly()
        if variables is None:
            variables = tf.compat.v1.global_variables()
        if not eager and session is None:
            session = tf.compat.v1.get_default_session()
            if session is None:
                raise ValueError("in a TF1 graph, TensorFlowState needs a session: pass "
                                 "session= or create it inside `with session.as_default()`")
        handler = _VariablesHandler(variables, session if not eager else None)
        self.session = session
        super().__init__({"variables": handler}, broadcast_object, None, **kwargs)


class TensorFlowKerasState(HandledState):
    """State of a Keras model and its optimizer (Horovod's ``TensorFlowKerasState``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        backend: accepted for Horovod compatibility (TF1 Keras sessions are not supported).
        **kwargs: plain Python objects to keep too, exposed as attributes.

    Raises:
        ValueError: the model is not built yet.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if hasattr(model, "build") and not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        if not tf.executing_eagerly():
            raise ValueError("TensorFlowKerasState needs eager execution (TensorFlow 2); for "
                             "a TF1 graph use TensorFlowState(session=...)")
        optimizer = optimizer or getattr(model, "optimizer", None)
        handlers = {"model": _ModelHandler(model)}
        if optimizer is not None:
            handlers["optimizer"] = _OptimizerHandler(optimizer, model)
        self.backend = backend
        super().__init__(handlers, broadcast_object, None, **kwargs)
