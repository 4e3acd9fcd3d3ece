"""One engine per rank: the driver of its negotiation cycles.

Collectives are submitted here (``submit``) and queued; a cycle (``cycle.py``, a plain
object with no threads) announces what is queued, agrees with the peers on what is ready
and runs it. This module decides who runs a cycle and when.

A rank starts a cycle only when it has something to announce; if the cycle's first
exchange has not completed after a brief spin, it sends a one-word wake-up to its peers,
whose background threads answer by taking part. A peer that started the same cycle on its
own (a loop of blocking calls: every rank submits and drives) is never sent one; a peer
that did not always is, because the exchange cannot complete without it. An idle job
therefore exchanges nothing, and no thread spins: waits go through ``transport.wait``.
How wake-ups travel, and are drained at shutdown, is ``wakeups``.

Whoever needs progress drives it under ``_drive_lock``: the background thread for
asynchronous submissions (after a cycle time, so tensors submitted together fuse), or the
caller's thread inside ``synchronize`` (so a blocking call pays no thread hand-off). The
background thread also runs the stall checks.
"""

import copy
import functools
import logging
import threading
import time

from .. import faults, transport
from .._mpi import MPI
from ..errors import HorovodInternalError
from . import stalls
from .allreduce import moved_bytes
from .cycle import FLAG_FAILED, FLAG_SHUTDOWN, NOT_RUN, Cycle, JobEnded
from .exchange import MpiExchange
from .executor import Executor
from .fold import FINALIZED, REDUCED, LatencyFolding
from .lane import Lanes
from .request import Handle, Request
from .submissions import Submissions
from .wakeups import CallerGrace, Wakeups

log = logging.getLogger("hororing")

__all__ = ["Engine", "FLAG_FAILED", "FLAG_SHUTDOWN"]


class Engine:
    """The per-rank collective engine. Created by ``hororing.init``; not public API."""

    def __init__(self, comm, config, timeline, reducer=None):
        self.config = config
        self._poll_active_s = config.poll_active_us / 1e6
        self._poll_idle_s = config.poll_idle_us / 1e6
        self.tuner = None  # an Autotuner (tuning/), told of every cycle that ran something
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        # a cycle's vote waits on every other rank (named by the stall watchdog)
        self._peers = transport.world_ranks(comm, [peer for peer in range(self.size)
                                                   if peer != self.rank])
        # one activity for every cycle (cycles never nest, and one thread drives at a time)
        self._cycle_activity = transport.activity(
            lambda: f"negotiation cycle {self.cycle.number}", self._peers)
        self._wakeups = Wakeups(comm)
        self.executor = Executor(faults.track(comm.Dup()), config, timeline, reducer)
        self.allreduce = self.executor.allreduce  # part of the engine's surface (__init__.py)
        # the fold's small rows in shared memory too where every rank runs compiled cycles
        self._exchange = MpiExchange(comm, shared=config.shared_fold,
                                     small_shared=self.allreduce.route.compiled_ring)
        # the fold takes the shared allreduce's sizes only where its rows meet in shared
        # memory: gathered (HORORING_SHARED_FOLD=0), rows that wide are an allgather of every
        # rank's buffer (a lone 1 MiB call at 4 ranks: 3.6 ms against the ring's 1.7)
        self._folding = LatencyFolding(self.allreduce, self.size, self.executor,
                                       self.executor.rows_budget if config.shared_fold else 0)
        self.cycle = Cycle(self._exchange, self._folding, config.cache_capacity)
        self._drive_lock = threading.Lock()
        self._work = threading.Event()
        self._submissions = Submissions(self._nudge)
        self.submit = self._submissions.add
        self.check_free = self._submissions.check_free
        # the names in flight on this rank (read only): ``name in engine.in_flight`` is the
        # door's test before it asks ``check_free`` to raise
        self.in_flight = self._submissions.pending
        self.lanes = Lanes()  # the door's: name -> the Lane of a repeated blocking call
        self._last_cycle_at = 0.0
        self._grace = CallerGrace()  # a peer's wake-up left for this rank's caller
        self._outgoing_flags = 0
        self._outgoing_message = None
        self._failed_job = False  # this rank or a peer failed (not a clean shutdown)
        self.peers_lost = False  # a peer process died (ULFM): the communicators are revoked
        self._stopped = False
        self._watch = stalls.Watch(lambda: self.config, self.cycle, self.rank, self._blocked,
                                   self._gather_cycle)
        # called with the name of a collective that failed on every rank but this one never
        # submitted (it was inside join()); the Group keeps its generated names in step
        self.on_missed_error = None
        self._thread = threading.Thread(target=self._background, name="hororing-engine", daemon=True)
        self._thread.start()

    # ---- called from user threads -------------------------------------------------------

    # Two entries every call goes through are the queue's own methods, bound in __init__
    # (a wrapper here would be one more Python call per collective):
    #   submit(request, blocking=False): queue a request; return its handle. Raises ValueError
    #       for a name in flight. ``blocking``: the caller will ``wait`` on the handle at once
    #       and drive the cycle itself, so the background thread is not woken for it.
    #   check_free(name): raise ValueError if a collective named ``name`` is in flight on
    #       this rank. The verbs ask first, before converting their input, which may release
    #       the GIL: a collective just submitted under that name could otherwise complete
    #       meanwhile (its peers already waiting), and whether the second call is refused
    #       would depend on timing (``submit`` checks again, under the queue's lock).

    def submit_blocking(self, request):
        """Submit ``request`` for a caller that waits for it at once (a blocking verb);
        return its handle.

        When nothing else is queued or pending on this rank and no thread drives, the
        request's cycle runs here and now, as the caller's wait would run it first: a loop of
        blocking calls (the fold's steady state) completes in this one call, without the
        queue and the wait's driving loop. Otherwise the request is queued for the caller's
        ``synchronize`` to drive. Raises as ``submit`` does.
        """
        submissions = self._submissions
        if not (submissions.queue or submissions.pending) and \
                self._drive_lock.acquire(blocking=False):
            try:
                with submissions.lock:  # the queue's own checks, as ``add`` makes them
                    alone = not (submissions.queue or submissions.pending or self._stopped
                                 or submissions.failure is not None
                                 or submissions.batches.requests is not None)
                    if alone:
                        submissions.pending[request.name] = request
                if alone:
                    request.awaited = True
                    request.submitted = submissions.quiet_since = time.monotonic()
                    self._run_cycle(self._wakeups.latest(patience=1) <= self.cycle.number,
                                    fresh=(request,))
                    return request.handle
            finally:
                self._drive_lock.release()
        return submissions.add(request, blocking=True)

    def run_lane(self, lane, tensor):
        """Run a call that fits ``lane`` (``lane.py``) on ``tensor``: its cycle, written
        out, on this thread. Returns the call's handle (done where every rank folded it), or
        None where the call must take the usual way (nothing has been done then)."""
        submissions = self._submissions
        if submissions.queue or submissions.pending or self._outgoing_flags \
                or self.executor.timeline is not None \
                or (self.tuner is not None and self.tuner.active) \
                or lane.plan.version != self.allreduce.route.version \
                or submissions.batches.requests is not None \
                or not self._drive_lock.acquire(blocking=False):
            return None
        try:
            if self._stopped:
                return None
            name = lane.name
            request = Request(name, lane.meta, tensor, tensor if lane.door[0] else None,
                              Handle(name, self))
            request.cache_id, request.awaited = lane.cache_id, True
            with submissions.lock:  # in flight, as a submitted call (another thread's refused)
                if submissions.queue or submissions.pending or submissions.failure is not None:
                    return None
                submissions.pending[name] = request
            self._last_cycle_at = self._grace.lane_at = request.submitted = \
                submissions.quiet_since = time.monotonic()
            activity = self._cycle_activity  # entered where the cycle waits (run_lane)
            rows = self.cycle.run_lane(request, lane, self._wake_for_lane, activity)
            if rows is not None:
                with submissions.lock:
                    submissions.pending.pop(name, None)
                if rows is NOT_RUN:
                    return None
                if (rows is REDUCED and lane.plan.after_compiled is None
                        or rows is FINALIZED) and request.writeback is None:
                    # the rows reduced into its output: ``set_result`` written out. The handle
                    # is made above and returned below: no thread waits on it, none has a
                    # callback on it, so it needs neither the lock nor the call
                    handle = request.handle
                    handle._outcome = (request.output, None)
                    handle._done = True
                else:
                    with activity:
                        self._folding.finish(lane.response, request, rows, lane.plan)
                return request.handle
            with activity:
                self._run(self.cycle.resume_lane(request, self._blocked))  # the vote, as usual
        except JobEnded as ended:
            self._end(ended)
        except MPI.Exception as error:
            if not self._lose_peers(error):
                raise
        finally:
            self._drive_lock.release()
        return request.handle  # its caller's ``synchronize`` drives what is left

    def _wake_for_lane(self):
        """A lane's cycle has not completed after the spin: wake the peers, unless one of
        them started this cycle (its wake-up is in), as ``_run_cycle`` decides up front."""
        number = self.cycle.number
        if self._wakeups.latest(patience=1) < number:
            self._wakeups.send(number)

    def batch(self):
        """``with engine.batch():`` the requests submitted inside (by this thread) enter the
        queue together, so each rank announces all of them in one cycle and they become
        ready together (a grouped collective: fused, where they fit one bucket)."""
        return self._submissions.batch()

    def wait(self, handle):
        """Block until ``handle`` completes, driving cycles from this thread when useful.

        While a caller drives, the background thread stops polling (it would only contend
        for the drive lock); the caller polls for its peers' wake-ups instead, as often as
        the background thread would have.
        """
        if handle.done():  # completed in an earlier cycle (fused with the one waited on)
            return handle.result()
        self._submissions.start_driving(handle.name)
        try:
            return self._drive_until(handle)
        finally:
            self._submissions.stop_driving()

    def await_(self, handle):
        """A thread is about to wait for ``handle`` (a grouped call's members, all at once)."""
        self._submissions.awaited(handle.name)

    def _nudge(self):
        """A submission waits with nobody driving it: wake the background thread."""
        if not self._work.is_set():  # set() takes the event's lock even when set
            self._work.set()

    def _drive_until(self, handle):
        idle_wait = 1e-4
        idle_since = None
        while not handle.done():
            progressed = False
            if self._drive_lock.acquire(blocking=False) or self._drive_lock.acquire(timeout=0.001):
                try:
                    progressed = self._progress(include_queue=True)
                finally:
                    self._drive_lock.release()
            if progressed:
                idle_wait, idle_since = 1e-4, None
            elif self._stopped:  # failed while the executor held it (a peer died mid-way)
                if not handle.done():
                    handle.set_error(copy.copy(self._submissions.failure))
            else:  # the peers are not there yet: poll for their wake-ups, backing off
                now = time.monotonic()
                idle_since = idle_since or now
                ceiling = self._poll_active_s if now - idle_since < 1.0 else self._poll_idle_s
                handle.wait(idle_wait)
                idle_wait = min(idle_wait * 2, ceiling)
        return handle.result()

    def reduction_order(self, names):
        """``names`` in the order a fused bucket holds them (``Cycle.reduction_order``)."""
        return self.cycle.reduction_order(names)

    @property
    def route(self):
        """The routing settings in effect (``allreduce.Route``, the autotuner's where it
        runs): what gradient buckets are laid out by (its ``fusion_threshold``), kept until
        its ``version`` changes."""
        return self.allreduce.route

    def apply_settings(self, settings):
        """Take the autotuner's ``settings`` (tuning.Settings) from the next cycle on.
        Called by the tuner inside a cycle, the same cycle on every rank."""
        self.allreduce.apply_settings(settings)

    def stats(self):
        """Counters of this rank's negotiation (``Cycle.stats``)."""
        return dict(self.cycle.stats)

    @property
    def timeline(self):
        """The timeline the cycles and the executor record to (None: none)."""
        return self.executor.timeline

    def set_timeline(self, timeline):
        """Replace the timeline (None stops it); the old one is closed."""
        with self._drive_lock:
            old, self.executor.timeline = self.executor.timeline, timeline
        if old is not None:
            old.close()

    def stop(self, message=None, flags=FLAG_SHUTDOWN, deadline_s=30.0):
        """Tell the peers this rank is leaving (shutdown, or failure with a message); stop.

        Returns True if the peers were told within the deadline.
        """
        told = False
        if flags & FLAG_FAILED:
            self._failed_job = True
        if self._submissions.failure is None and not self._stopped:
            self._outgoing_flags |= flags
            self._outgoing_message = message
            if self._drive_lock.acquire(timeout=deadline_s):
                try:
                    if self._submissions.failure is None and not self._stopped:
                        told = self._run_cycle(initiate=True, deadline=time.monotonic() + deadline_s)
                finally:
                    self._drive_lock.release()
        self._halt(HorovodInternalError(
            "hororing has been shut down on this rank; call hvd.init() again to use it"))
        return told

    # ---- progress -----------------------------------------------------------------------

    def _background(self):
        last_activity = time.monotonic()
        try:
            while not self._stopped:
                now = time.monotonic()
                # while a caller drives, it polls for wake-ups itself: waking often here too
                # would only take CPU time from the ranks it is waiting for (oversubscribed)
                drivers = self._submissions.drivers
                busy = now - last_activity < 1.0 and not drivers
                interval = self._poll_active_s if busy else self._poll_idle_s
                if self._work.wait(interval):
                    self._work.clear()
                    # let tensors submitted together arrive, so they negotiate and fuse as one
                    delay = (self._last_cycle_at + self.allreduce.route.cycle_time_ms / 1000.0
                             - time.monotonic())
                    if delay > 0:  # cut short when a submission is awaited
                        self._submissions.urgent.wait(delay)
                    self._submissions.urgent.clear()
                elif self._submissions.drivers \
                        and time.monotonic() < self._watch.next_stall_check:
                    # a caller is driving cycles now (read again: the wait may have outlasted
                    # the one read above): polling too would only contend
                    continue
                with self._drive_lock:
                    if self._stopped:
                        return
                    if self._progress(include_queue=self._submissions.async_waiting):
                        last_activity = time.monotonic()
                    self._watch.check()
        except Exception as error:  # an engine bug must not leave callers waiting forever
            if self._lose_peers(error):
                return
            log.exception("hororing engine thread failed")
            self._halt(HorovodInternalError(f"hororing engine failed on rank {self.rank}: {error!r}"))

    def _progress(self, include_queue):
        """Run one cycle if a peer asked for one, or (include_queue) this rank has news.

        The caller holds the drive lock.
        """
        if self._stopped:
            return False
        submissions = self._submissions
        news = include_queue and bool(submissions.queue)
        # A rank whose collectives wait for its peers looks for their wake-ups thoroughly.
        # With news, a cycle runs anyway, and one test tells whether a peer started it
        # first; with nothing pending, a wake-up seen at the next poll costs nothing, while
        # one seen at once often starts an empty cycle just before this rank's own caller
        # arrives (measured: 100 us late ranks at 2 ranks, ~50 us more per step)
        thorough = not news and bool(submissions.pending)
        woken_for = self._wakeups.latest() if thorough else self._wakeups.latest(patience=1)
        asked = woken_for > self.cycle.number
        if asked and not (news or submissions.queue or submissions.pending) \
                and self._grace.leave(woken_for):
            return False
        if asked or news:
            self._run_cycle(initiate=not asked)
            return True
        return False

    def _run_cycle(self, initiate, deadline=None, fresh=None):
        """Run the next cycle with what is queued (or ``fresh``, requests that bypassed the
        queue: ``submit_blocking``); False if the deadline passed first. ``initiate``: this
        rank starts it (no peer's wake-up asked for it), so it wakes the peers if they do
        not take part soon."""
        self._last_cycle_at = time.monotonic()
        wake = functools.partial(self._wakeups.send, self.cycle.number + 1) if initiate else None
        if fresh is None:
            fresh = self._submissions.take_queue()
        try:
            with self._cycle_activity:
                decision = self.cycle.run(fresh, flags=self._outgoing_flags,
                                          message=self._outgoing_message, wake=wake,
                                          deadline=deadline, waiting=self._blocked)
                if decision is None:
                    return False
                responses = decision.responses
                self._run(decision)
        except JobEnded as ended:
            self._end(ended)
            return True
        except MPI.Exception as error:
            if not self._lose_peers(error):
                raise
            return True
        if responses:
            self._submissions.quiet_since = time.monotonic()
        if responses and self.tuner is not None and self.tuner.active:
            self.tuner.observe(responses, moved_bytes(responses))
        if self.executor.timeline is not None:  # live: what the cycle recorded is in the file
            self.executor.timeline.flush()
        return True

    def _end(self, ended):
        self._failed_job |= ended.failed
        self._halt(HorovodInternalError(str(ended)))

    def _run(self, decision):
        """Run what a cycle agreed, pairing each response with this rank's request."""
        responses, folded = decision
        if self.executor.timeline is not None:
            self.executor.timeline.cycle(self.cycle.number)
        if folded is not None:
            response = responses[0]
            request = self._submissions.take(response.name)
            if self.executor.timeline is not None:
                self.executor.negotiated(response, request, time.monotonic())
            self._folding.finish(response, request, folded)
            if request.door is not None:  # a call the door may send down a lane next time
                self.lanes.learn(request, response, self._folding.plan_of(response.meta))
        elif responses:
            # a deadlock fails each rank's own names: none were missed
            missed = None if responses[0].deadlock else self.on_missed_error
            self.executor.execute(responses, self._submissions.take, missed,
                                  self.cycle.negotiator.cache.id_of)

    def _lose_peers(self, error):
        """An operation failed with ``error``: where it says a peer died (ULFM), revoke the
        job's communicators so that every survivor's operations fail too, fail every pending
        collective here with ``RanksFailedError`` and return True; else return False."""
        if not faults.peer_lost(error, self.comm):
            return False
        self.peers_lost = True
        self._failed_job = True
        faults.revoke_all()
        self._halt(faults.error_for(error, self.comm, self.rank))
        return True

    def _halt(self, error):
        """Stop for good: fail every pending handle with ``error``."""
        def stop():
            self._stopped = True
            self.cycle.forget()
        self._submissions.fail(error, stop)
        self._work.set()

    def close(self):
        """Release MPI resources; call after ``stop``."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self.peers_lost:  # the communicators are revoked: nothing to free or drain
            return
        # after a failure, peers may be gone: leave what is in flight to MPI
        self._wakeups.close(None if self._failed_job else time.monotonic() + 10.0)
        self.executor.close(clean=not self._failed_job)
        if self.tuner is not None:
            self.tuner.close()
        self.cycle.free(clean=not self._failed_job)
        self._exchange.free()
        if self.timeline is not None:
            self.timeline.close()

    def _blocked(self, now=None):
        """True when every collective pending here is waited for by some thread, nothing is
        queued, and nothing ran or was submitted for the deadlock grace: this rank can only
        go on if its peers' collectives match its own (``deadlocks.py``)."""
        return self._submissions.blocked(self.config.deadlock_grace_seconds,
                                         time.monotonic() if now is None else now)

    def _gather_cycle(self):
        """Run a gathered cycle now (the watch's: a stall to name, a deadlock to find)."""
        self.cycle.ask_gather()
        self._run_cycle(initiate=True)
