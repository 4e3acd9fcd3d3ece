"""A submitted collective (Request) and what the caller holds while it runs (Handle)."""

import threading


_EVENT_LOCK = threading.Lock()


class Handle:
    """Completion of one asynchronous collective; pass it to ``synchronize`` or ``poll``.

    The Event behind ``wait`` is made only when a thread actually has to sleep on it: a
    blocking call whose own thread drives the cycle never needs one.
    """

    __slots__ = ("name", "_engine", "_done", "_event", "_outcome", "_then")

    def __init__(self, name, engine):
        self.name, self._engine = name, engine
        self._done = False
        self._event = None
        self._outcome = (None, None)  # (result, error) once done
        self._then = None

    def done(self):
        """Return True once the result (or an error) is available; never blocks."""
        return self._done

    def wait(self, timeout=None):
        if self._done:
            return True
        with _EVENT_LOCK:
            if self._event is None:
                self._event = threading.Event()
            if self._done:  # finished while the event was being made
                return True
        return self._event.wait(timeout)

    def set_result(self, result, error=None):
        """Complete the handle with ``result`` (or ``error``: ``set_error``); every
        collective's result comes here, so it is one call."""
        self._outcome = (result, error)
        with _EVENT_LOCK:
            self._done = True
            event, then = self._event, self._then
        if event is not None:
            event.set()
        if then is not None:
            then(self)

    def set_error(self, error):
        self.set_result(None, error)

    def then(self, callback):
        """Call ``callback(handle)`` once the handle is done: at once if it already is, else
        on the thread that completes it (the engine's, or one driving it). One callback per
        handle; it must not block."""
        with _EVENT_LOCK:
            if self._then is not None:
                raise RuntimeError(f"{self!r} already has a completion callback")
            self._then = callback
            done = self._done
        if done:
            callback(self)

    def synchronize(self):
        """Wait for the result (driving the engine from this thread) and return it, or raise
        its error."""
        if self._done:  # a blocking call's cycle has run it already (submit_blocking)
            result, error = self._outcome
            if error is not None:
                raise error
            return result
        return self._engine.wait(self)

    def mark_awaited(self):
        """Tell the engine a thread is about to wait for this handle (``Engine.await_``)."""
        self._engine.await_(self)

    def result(self):
        """Return the result of a finished handle, or raise its error."""
        result, error = self._outcome
        if error is not None:
            raise error
        return result

    def __repr__(self):
        state = "done" if self.done() else "pending"
        return f"<hororing Handle {self.name!r} {state}>"


class GroupHandle:
    """One handle over several (grouped_allreduce): its result is the list of results."""

    __slots__ = ("handles",)

    def __init__(self, handles):
        self.handles = list(handles)

    def done(self):
        return all(handle.done() for handle in self.handles)

    def synchronize(self):
        """The list of the members' results, in order."""
        for handle in self.handles:  # every member is waited for, not only the first
            handle.mark_awaited()
        return [handle.synchronize() for handle in self.handles]


class Request:
    """What the engine needs to run one collective on this rank.

    ``tensor`` is the contiguous input; ``output`` is where an in-place or preallocated
    result goes (None: the engine allocates); ``writeback`` is a non-contiguous array that
    receives the result at the end. ``ready`` (device arrays) has a ``synchronize()`` that
    returns once the work that produced ``tensor`` on the caller's stream is done.
    ``awaited``: a thread waits for it (a blocking call, or ``synchronize`` on its handle).
    ``door``: set by the door on a blocking call that may take a lane once folded.
    """

    __slots__ = ("name", "meta", "tensor", "output", "writeback", "handle", "submitted", "cache_id",
                 "announced", "ready", "awaited", "door")

    def __init__(self, name, meta, tensor, output, handle, writeback=None):
        self.name = name
        self.meta = meta
        self.tensor = tensor
        self.output = output
        self.writeback = writeback
        self.handle = handle
        self.submitted = 0.0
        self.cache_id = None
        self.announced = False
        self.ready = None
        self.awaited = False
        self.door = None  # a blocking call's key, as the door gave it (``lane.py``)
