"""What this rank has submitted and not yet seen completed (the engine's side of the queue).

User threads add requests (``add``, or several at once inside ``batch``); the thread that
runs the next cycle takes the queue (``take_queue``) and, as responses come, each request
by name (``take``). ``drivers`` counts the user threads driving cycles themselves inside a
wait. Every field is guarded by ``lock``; ``wake()`` (given) tells the engine's background
thread that a submission waits with nobody driving it.
"""

import contextlib
import copy
import threading
import time



class _Batch(threading.local):
    """A thread's batch (``Submissions.batch``). The attributes are always there: a thread
    that never batched reads the class's, where ``getattr(local, name, None)`` would raise
    and catch an AttributeError on every blocking call (1.2 us here)."""

    requests = None  # the requests held, inside ``batch``
    blocking = True  # every request held was submitted blocking


class Submissions:
    """One rank's queued and pending collectives; thread-safe."""

    def __init__(self, wake):
        self.lock = threading.Lock()
        self.queue = []            # submitted, not yet announced
        self.pending = {}          # name -> Request, until completed
        self.async_waiting = False  # the queue holds a submission nobody is driving
        self.drivers = 0           # user threads inside a wait, driving cycles themselves
        # the last submission, or the last cycle that ran something (deadlock grace)
        self.quiet_since = time.monotonic()
        self.failure = None        # HorovodInternalError once the engine cannot go on
        self._wake = wake
        self.batches = _Batch()  # per thread: requests held by ``batch``
        # set when a queued submission is awaited: the background thread then starts its
        # cycle at once rather than after the cycle time that lets submissions gather
        self.urgent = threading.Event()

    def add(self, request, blocking=False):
        """Queue ``request`` (or hold it in this thread's batch); return its handle. Raises
        ValueError for a name in flight, HorovodInternalError once the engine has stopped.

        Args:
            blocking: the caller will wait on the handle at once and drive the cycle
                itself, so the background thread is not woken for it.
        """
        with self.lock:
            if self.failure is not None:
                raise _again(self.failure)
            if request.name in self.pending:
                raise _in_flight(request.name)
            self.pending[request.name] = request
            request.awaited = blocking
            batch = self.batches.requests
            (self.queue if batch is None else batch).append(request)
        request.submitted = self.quiet_since = time.monotonic()
        if batch is not None:
            self.batches.blocking &= blocking
        elif not blocking:
            self.async_waiting = True
            self._wake()
        return request.handle

    def check_free(self, name):
        """Raise ValueError if a collective named ``name`` is in flight on this rank."""
        if name in self.pending:  # one dict lookup: atomic, no lock needed
            raise _in_flight(name)

    @contextlib.contextmanager
    def batch(self):
        """The requests this thread adds inside enter the queue together, so each rank
        announces all of them in one cycle (a grouped collective)."""
        if self.batches.requests is not None:
            yield  # nested: the outer batch queues them
            return
        self.batches.requests, self.batches.blocking = [], True
        try:
            yield
        finally:
            requests, self.batches.requests = self.batches.requests, None
            with self.lock:
                if self.failure is None:
                    self.queue.extend(requests)
            if requests and not self.batches.blocking:
                self.async_waiting = True
                self._wake()

    def awaited(self, name):
        """A thread is about to wait for the request named ``name`` (or its future has a
        waiter): it is not held back to gather others."""
        with self.lock:
            request = self.pending.get(name)
            if request is not None:
                request.awaited = True
        if request is not None and not self.urgent.is_set():
            self.urgent.set()

    def start_driving(self, name):
        """A user thread waits for the request named ``name`` and drives cycles until its
        ``stop_driving`` (a plain pair, not a context manager: this runs on every blocking
        call). The background thread polls slowly meanwhile."""
        with self.lock:
            self.drivers += 1
            request = self.pending.get(name)
            if request is not None:
                request.awaited = True

    def stop_driving(self):
        """If collectives are still pending when the last driver stops, the background
        thread is woken to answer the peers' wake-ups promptly again."""
        with self.lock:
            self.drivers -= 1
            resume = not self.drivers and self.pending
        if resume:
            self._wake()

    def take_queue(self):
        """The queue, emptied: what the next cycle announces."""
        with self.lock:
            fresh, self.queue = self.queue, []
            self.async_waiting = False
        return fresh

    def take(self, name):
        """Remove and return this rank's request for ``name`` (None if it has none)."""
        with self.lock:
            return self.pending.pop(name, None)

    def fail(self, error, forget):
        """Take no more requests (``error`` is what callers are told); fail every pending
        one. ``forget()`` runs under the lock (the cycle drops what it holds)."""
        with self.lock:
            if self.failure is None:
                self.failure = error
            # emptied in place: the engine hands this dict out (``Engine.in_flight``)
            pending, self.queue = dict(self.pending), []
            self.pending.clear()
            forget()
        for request in pending.values():
            request.handle.set_error(_again(self.failure))

    def blocked(self, grace, now):
        """True when every pending collective is waited for by some thread, nothing is
        queued, and nothing ran or was submitted for ``grace`` seconds (0: never)."""
        if grace <= 0 or now - self.quiet_since < grace:
            return False
        with self.lock:
            return (bool(self.pending) and not self.queue
                    and all(request.awaited for request in self.pending.values()))


def _again(error):
    """A fresh exception like ``error`` (its type, message and attributes, no traceback): each
    caller raises its own."""
    return copy.copy(error)


def _in_flight(name):
    return ValueError(f"a collective named '{name}' is already in flight on this rank; "
                      f"synchronize its handle before reusing the name, or pass a different name=")
