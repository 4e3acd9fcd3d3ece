"""What a hororing process group returns for each collective: a ``torch.distributed`` Work
whose future completes when hororing's handles do, so nothing blocks inside the call and
DDP's reducer and comm hooks can chain on the future.

A future's callbacks run on the thread that completes it, and torch's hooks block in them
(PowerSGD's waits for its next allreduce inside a callback). So the engine's thread completes
a future only where no Python code chained on it (``_WatchedFuture``: DDP's reducer waits from
C++); a waiter completes its own (``Work.wait``); otherwise a completion thread does
(``_Completions``), another being started whenever every one is blocked.
"""

import queue
import threading

import torch
import torch.distributed as dist


class _Completions:
    """Threads that complete futures: one more is started whenever every one is busy (a
    callback blocked on a later collective), so a chain of hooks never waits on itself."""

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0

    def submit(self, task):
        with self._lock:
            start = self._idle == 0
            if start:
                self._threads += 1
            else:
                self._idle -= 1
        self._queue.put(task)
        if start:
            threading.Thread(target=self._run, daemon=True,
                             name=f"hororing-completions-{self._threads}").start()

    def _run(self):
        while True:
            task = self._queue.get()
            try:
                task()
            finally:
                with self._lock:
                    self._idle += 1


_COMPLETIONS = _Completions()


class _WatchedFuture(torch.futures.Future):
    """A future that knows whether Python code chained on it (``then``,
    ``add_done_callback``): such a callback may block, so it must not run on the engine's
    thread. ``lock`` orders a chaining against the engine's decision to complete at once."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.chained = False

    def then(self, callback):
        with self.lock:
            self.chained = True
        return super().then(callback)

    def add_done_callback(self, callback):
        with self.lock:
            self.chained = True
        return super().add_done_callback(callback)


class _FutureWork(dist._Work):
    """What torch asks of a Work besides ``wait``, read from its future ``_future``."""

    def get_future(self):
        return self._future

    def is_completed(self):
        return self._future.done()

    def exception(self):
        if not self._future.done():
            return None
        try:
            self._future.value()
        except BaseException as error:
            return error
        return None

    def is_success(self):
        return self._future.done() and self.exception() is None

    def result(self):
        self.wait()
        return self._future.value()

    def synchronize(self):
        self.wait()


class HandlesWork(_FutureWork):
    """The Work of one collective made of hororing handles (``TorchHandle``s).

    ``finish(results)`` runs once every handle is done, with each handle's torch result in
    order; it lays results where torch wants them (copies into output tensors) and returns
    the future's value; ``on_error()`` runs first where a handle failed. ``wait`` drives the
    engine from the calling thread, as a blocking hororing call does, then returns once
    ``finish`` has run; an error raises there and fails the future.
    """

    def __init__(self, handles, finish, on_error=None):
        super().__init__()
        self._handles = list(handles)
        self._finish = finish
        self._on_error = on_error
        self._future = _WatchedFuture()
        self._left = len(self._handles)
        self._lock = threading.Lock()
        self._waiting = False   # a thread is in wait(): it completes the future itself
        self._claimed = False   # whoever claims runs _complete, once
        if not self._handles:
            self._claim() and self._complete()
            return
        for handle in self._handles:
            for inner in _members(handle.inner):
                if inner.done():  # finished in the call (a blocking call's cycle ran there)
                    continue
                with self._lock:
                    self._left += 1
                inner.then(self._member_done)
                # torch's callers wait on the future (DDP's reducer, from C++): the engine
                # is told so, and does not hold the call back to gather others
                inner.mark_awaited()
            self._member_done(None)  # the handle itself, counted once its members are in

    def _member_done(self, _inner):
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last and not self._waiting:
            future = self._future
            with future.lock:
                if not future.chained:  # only C++ waits on it (DDP's reducer): complete here
                    if self._claim():
                        self._complete()
                    return
            _COMPLETIONS.submit(lambda: self._claim() and self._complete())

    def _claim(self):
        with self._lock:
            claimed, self._claimed = self._claimed, True
        return not claimed

    def _complete(self):
        try:
            results = [handle.finish(_result(handle.inner)) for handle in self._handles]
            value = self._finish(results)
        except BaseException as error:  # torch's future carries it to whoever waits
            if self._on_error is not None:
                self._on_error()
            self._future.set_exception(error)
            return
        self._future.set_result(value)

    def wait(self, timeout=None):
        self._waiting = True
        for handle in self._handles:
            for inner in _members(handle.inner):
                if not inner.done():
                    inner.mark_awaited()
        try:
            for handle in self._handles:
                handle.inner.synchronize()
        finally:
            if self._claim():
                self._complete()
        self._future.wait()
        return True

def _result(inner):
    """A finished engine handle's result (a group's: the list of its members'), or its
    error raised; never drives the engine (this may run on the engine's own thread)."""
    handles = getattr(inner, "handles", None)
    if handles is None:
        return inner.result()
    return [handle.result() for handle in handles]


def _members(inner):
    """The engine handles behind one started collective (one, or a group's members)."""
    handles = getattr(inner, "handles", None)
    return handles if handles is not None else [inner]


class DoneWork(_FutureWork):
    """A collective that finished inside the call (a size-1 group's, or one with nothing to
    move): its future already holds ``value``."""

    def __init__(self, value):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(value)

    def wait(self, timeout=None):
        return True


class RequestWork(_FutureWork):
    """A point-to-point send or receive: an MPI request on the group's own communicator.

    ``wait`` waits for the request and runs ``finish`` (a receive's copy into a tensor that
    was not contiguous); ``get_future`` gives a future that a helper thread completes, made
    only when asked for (``wait`` alone needs none)."""

    def __init__(self, request, tensors, finish=None):
        super().__init__()
        self._request = request
        self._tensors = tensors
        self._finish = finish
        self._future = torch.futures.Future()
        self._lock = threading.Lock()
        self._source = -1
        self._waiter = None

    def wait(self, timeout=None):
        with self._lock:
            if self._future.done():
                self._future.wait()
                return True
            try:
                from ..._mpi import MPI
                status = MPI.Status()
                self._request.Wait(status)
                self._source = status.Get_source()
                if self._finish is not None:
                    self._finish()
            except BaseException as error:
                self._future.set_exception(error)
                raise
            self._future.set_result(self._tensors)
        return True

    def get_future(self):
        with self._lock:
            if self._waiter is None and not self._future.done():
                self._waiter = threading.Thread(target=self._wait_quietly, daemon=True,
                                                name="hororing-p2p-future")
                self._waiter.start()
        return self._future

    def _wait_quietly(self):
        try:
            self.wait()
        except BaseException:  # the future carries it
            pass

    def result(self):
        self.wait()
        return self._tensors

    def _source_rank(self):
        return self._source

    def source_rank(self):
        return self._source
