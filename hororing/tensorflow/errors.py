"""A failed collective, as a TensorFlow program sees it: the error type Horovod's op raises.

Horovod's TensorFlow ops fail with TensorFlow's own errors: ranks that disagree about a
collective give ``tf.errors.FailedPreconditionError``, a bad argument found when the op runs
``tf.errors.InvalidArgumentError``, anything else (a failed peer, a shutdown)
``tf.errors.UnknownError``. Run eagerly, hororing raises classes that are both that error and
hororing's own (``HorovodInternalError``, ``ValueError``, ``TypeError``), so either ``except``
catches them. In a traced graph the error comes from the op itself (``graph.py``).
"""

import tensorflow as tf

from ..errors import HorovodInternalError, PreconditionError


class _FromMessage:
    """A TensorFlow error made from its message alone (TensorFlow's take a node and an op)."""

    _tf_error = None  # the TensorFlow error class it is

    def __init__(self, message):
        self._tf_error.__init__(self, None, None, message)


class FailedPrecondition(_FromMessage, tf.errors.FailedPreconditionError, PreconditionError):
    """The ranks disagree about a collective (its shape, dtype, op, root or kind)."""

    _tf_error = tf.errors.FailedPreconditionError


class InvalidValue(_FromMessage, tf.errors.InvalidArgumentError, ValueError):
    """An argument the collective found wrong when it ran (a ValueError)."""

    _tf_error = tf.errors.InvalidArgumentError


class InvalidType(_FromMessage, tf.errors.InvalidArgumentError, TypeError):
    """An argument of the wrong type found when the collective ran (a TypeError)."""

    _tf_error = tf.errors.InvalidArgumentError


class Unknown(_FromMessage, tf.errors.UnknownError, HorovodInternalError):
    """The collective failed for another reason: a failed peer, a shutdown, a stall."""

    _tf_error = tf.errors.UnknownError


def as_tf_error(error):
    """Return ``error`` as the TensorFlow error Horovod's op would raise, or None to keep it."""
    if isinstance(error, tf.errors.OpError):
        return None
    if isinstance(error, PreconditionError):
        return FailedPrecondition(str(error))
    if isinstance(error, HorovodInternalError):
        return Unknown(str(error))
    if isinstance(error, ValueError):
        return InvalidValue(str(error))
    if isinstance(error, TypeError):
        return InvalidType(str(error))
    return None
