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


class FailedPrecondition(tf.errors.FailedPreconditionError, PreconditionError):
    """The ranks disagree about a collective (its shape, dtype, op, root or kind)."""

    def __init__(self, message):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class InvalidValue(tf.errors.InvalidArgumentError, ValueError):
    """An argument the collective found wrong when it ran (a ValueError)."""

    def __init__(self, message):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


class InvalidType(tf.errors.InvalidArgumentError, TypeError):
    """An argument of the wrong type found when the collective ran (a TypeError)."""

    def __init__(self, message):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


class Unknown(tf.errors.UnknownError, HorovodInternalError):
    """The collective failed for another reason: a failed peer, a shutdown, a stall."""

    def __init__(self, message):
        tf.errors.UnknownError.__init__(self, None, None, message)


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
