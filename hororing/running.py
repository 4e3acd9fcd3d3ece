"""The job this process runs, once ``init()`` has made it: the one piece of module state.

A leaf: it imports nothing of hororing but its errors, so every module can ask for the
running context (``current()``) without importing the module that builds it
(``context.py``).
"""

import threading

from .errors import NotInitializedError


class _State:
    """Holder of the default context."""

    lock = threading.Lock()
    context = None
    hooks_installed = False


def is_initialized():
    """Return True between ``init()`` and ``shutdown()``."""
    return _State.context is not None


def current():
    """Return the default context or raise the not-initialized error."""
    context = _State.context
    if context is None:
        raise NotInitializedError()
    return context
