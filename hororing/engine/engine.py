"""One engine per rank: announces submitted collectives, negotiates, executes, completes handles.

Cycles are collective. Each starts with a vote: one fixed-size MPI_Iallreduce (bitwise AND)
of one bit per already-negotiated tensor this rank has pending, and a field saying whether
this rank needs more. In the steady state nobody does, and the AND is the ready list: one
reduction of ~(cache capacity / 8) bytes, whatever the number of ranks. A rank with a new
name, new metadata or a flag asks for a gathered cycle: every rank's header row and notes
(the names it announces with their metadata, a failing rank's message) are then gathered
too, and every rank computes the same ready list from the same table (``negotiation``).
A rank starts a cycle only when it has something to announce; if the cycle's first
exchange has not completed after a brief spin, it sends a one-word wake-up to its peers,
whose background threads answer by taking part. A peer that started the same cycle on its
own (a loop of blocking calls: every rank submits and drives) is never sent one; a peer
that did not always is, because the exchange cannot complete without it. An idle job
therefore exchanges nothing, and no thread spins: waits go through ``transport.wait``.
How wake-ups travel, and are drained at shutdown, is ``wakeups``; how a lone small allreduce
that repeats is folded into the exchange, ``fold``.

Whoever needs progress drives it under ``_drive_lock``: the background thread for
asynchronous submissions (after a cycle time, so tensors submitted together fuse), or the
caller's thread inside ``synchronize`` (so a blocking call pays no thread hand-off).
"""

import contextlib
import logging
import pickle
import threading
import time

import numpy as np
from .._mpi import MPI

from .. import transport
from ..errors import HorovodInternalError
from .allreduce import wire_bytes
from .executor import Executor, bucket_key
from .fold import Fold
from .wakeups import Wakeups
from .negotiation import (CYCLE, FLAGS, JOIN_NAME, NOTES_BYTES, Negotiator, agreed_bits,
                          encode_header, encode_vote, header_words, vote_needs_gather,
                          vote_words)

log = logging.getLogger("hororing")

FLAG_FAILED = 1
FLAG_SHUTDOWN = 2
# How often the stall check runs, and how long a tensor announced by its cache bit may wait
# before its rank asks for a gathered cycle (so the stall warning can name who is missing).
# Not a speed setting: one pass over the pending requests a second costs nothing measurable.
_STALL_CHECK_EVERY_S = 1.0


def _response_bytes(response):
    meta = response.meta
    return wire_bytes(meta) if meta.dtype else 0


class Engine:
    """The per-rank collective engine. Created by ``hororing.init``; not public API."""

    def __init__(self, comm, config, timeline, reducer=None):
        self.config = config
        self._poll_active_s = config.poll_active_us / 1e6
        self._poll_idle_s = config.poll_idle_us / 1e6
        self._cycle_time_s = config.cycle_time_ms / 1000.0
        self.tuner = None  # an Autotuner (tuning/), told of every cycle that ran something
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self._comm_negotiate = comm.Dup()
        # a cycle's vote waits on every other rank (named by the stall watchdog)
        self._peers = transport.world_ranks(comm, [peer for peer in range(self.size)
                                                   if peer != self.rank])
        # one activity for every cycle (cycles never nest, and one thread drives at a time)
        self._cycle_activity = transport.activity(
            lambda: f"negotiation cycle {self._cycle}", self._peers)
        self._wakeups = Wakeups(comm)
        self.executor = Executor(comm.Dup(), config, timeline, reducer)
        self.allreduce = self.executor.allreduce  # part of the engine's surface (__init__.py)
        self.timeline = timeline
        self.negotiator = Negotiator(self.size, config.cache_capacity)
        self._drive_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queue = []          # submitted, not yet announced
        self._async_waiting = False  # the queue holds a submission nobody is driving
        self._pending = {}        # name -> Request, until completed
        self._by_bit = {}         # name -> Request announced by its cache bit (driver only)
        self._gather_requested = False  # a cached announcement waits long: go by name
        self._cycle = 0
        self._last_cycle_at = 0.0
        self._outgoing_flags = 0
        self._outgoing_message = None
        self._failure = None      # HorovodInternalError once the engine cannot go on
        self._failed_job = False  # this rank or a peer failed (not a clean shutdown)
        self._stopped = False
        self._header = np.zeros(header_words(config.cache_capacity), dtype=np.int64)
        self._headers = np.zeros((self.size, self._header.size), dtype=np.int64)
        self._header_key = None   # what self._header encodes, less the cycle number
        self._vote = np.zeros(vote_words(config.cache_capacity), dtype=np.int64)
        self._agreed = np.zeros_like(self._vote)
        self._vote_key = None     # what self._vote encodes
        self._vote_exchange = transport.Exchange(self._comm_negotiate, "allreduce", self._vote,
                                                 self._agreed, op=MPI.BAND)
        # a lone small allreduce that repeats is folded into the negotiation exchange
        self._fold = Fold(self._comm_negotiate, self.executor)
        self._next_stall_check = time.monotonic() + _STALL_CHECK_EVERY_S
        self._stats = {"cycles": 0, "gather_cycles": 0, "stall_gathers": 0, "inline_cycles": 0,
                       "inline_hits": 0, "received_bytes": 0}
        self._work = threading.Event()
        self._batches = threading.local()  # per thread: requests held by ``batch``
        self._drivers = 0         # user threads inside wait(), driving cycles themselves
        # called with the name of a collective that failed on every rank but this one never
        # submitted (it was inside join()); the Group keeps its generated names in step
        self.on_missed_error = None
        self._thread = threading.Thread(target=self._background, name="hororing-engine", daemon=True)
        self._thread.start()

    # ---- called from user threads -------------------------------------------------------

    def submit(self, request, blocking=False):
        """Queue a request; return its handle. Raises ValueError for a name in flight.

        Args:
            blocking: the caller will ``wait`` on the handle at once and drive the cycle
                itself, so the background thread is not woken for it.
        """
        with self._queue_lock:
            if self._failure is not None:
                raise HorovodInternalError(str(self._failure))
            if request.name in self._pending:
                raise ValueError(
                    f"a collective named '{request.name}' is already in flight on this rank; "
                    f"synchronize its handle before reusing the name, or pass a different name=")
            self._pending[request.name] = request
            batch = getattr(self._batches, "requests", None)
            (self._queue if batch is None else batch).append(request)
        request.submitted = time.monotonic()
        if batch is not None:
            self._batches.blocking &= blocking
            return request.handle
        if not blocking:
            self._async_waiting = True
            if not self._work.is_set():  # set() takes the event's lock even when set
                self._work.set()
        return request.handle

    @contextlib.contextmanager
    def batch(self):
        """``with engine.batch():`` the requests submitted inside (by this thread) enter the
        queue together, so each rank announces all of them in one cycle and they become
        ready together (a grouped collective: fused, where they fit one bucket)."""
        if getattr(self._batches, "requests", None) is not None:
            yield  # nested: the outer batch queues them
            return
        self._batches.requests, self._batches.blocking = [], True
        try:
            yield
        finally:
            requests, self._batches.requests = self._batches.requests, None
            with self._queue_lock:
                if self._failure is None:
                    self._queue.extend(requests)
            if requests and not self._batches.blocking:
                self._async_waiting = True
                self._work.set()

    def wait(self, handle):
        """Block until ``handle`` completes, driving cycles from this thread when useful.

        While a caller drives, the background thread stops polling (it would only contend
        for the drive lock); the caller polls for its peers' wake-ups instead, as often as
        the background thread would have.
        """
        if handle.done():  # completed in an earlier cycle (fused with the one waited on)
            return handle.result()
        with self._queue_lock:
            self._drivers += 1
        try:
            return self._drive_until(handle)
        finally:
            with self._queue_lock:
                self._drivers -= 1
                # the background thread polls slowly while a caller drives: if collectives
                # are still pending, it must answer the peers' wake-ups promptly again
                resume = not self._drivers and self._pending
            if resume:
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
            else:  # the peers are not there yet: poll for their wake-ups, backing off
                now = time.monotonic()
                idle_since = idle_since or now
                ceiling = self._poll_active_s if now - idle_since < 1.0 else self._poll_idle_s
                handle.wait(idle_wait)
                idle_wait = min(idle_wait * 2, ceiling)
        return handle.result()

    def reduction_order(self, names):
        """``names`` in the order a fused bucket holds them: cached names by their cache id,
        then names the cache has no room for by name (the executor sorts each bucket so,
        whatever order the cycle's responses came in). What the caller lays memory out by,
        so that a fused bucket is back to back (``buffers.HostBuffers.span``)."""
        id_of = self.negotiator.cache.id_of
        return sorted(names, key=lambda name: bucket_key(name, id_of(name)))

    @property
    def fusion_threshold(self):
        """The fusion threshold in effect (the autotuner's where it runs): what gradient
        buckets are laid out by."""
        return self.executor.fusion_threshold

    def apply_settings(self, settings):
        """Take the autotuner's ``settings`` (tuning.Settings) from the next cycle on.
        Called by the tuner inside a cycle, the same cycle on every rank."""
        self._cycle_time_s = settings.cycle_time_ms / 1000.0
        self.executor.fusion_threshold = settings.fusion_threshold
        self.executor.allreduce.apply_settings(settings)

    def stats(self):
        """Counters of this rank's negotiation: ``cycles`` run, ``gather_cycles`` that
        gathered every rank's header (some rank had a new name, new metadata or a flag, or
        asked because a tensor announced by bit waited a second: ``stall_gathers`` counts
        this rank's asks), ``received_bytes`` by negotiation."""
        return dict(self._stats)

    def set_timeline(self, timeline):
        """Replace the timeline (None stops it); the old one is closed."""
        with self._drive_lock:
            old, self.timeline = self.timeline, timeline
            self.executor.timeline = timeline
        if old is not None:
            old.close()

    def stop(self, message=None, flags=FLAG_SHUTDOWN, deadline_s=30.0):
        """Tell the peers this rank is leaving (shutdown, or failure with a message); stop.

        Returns True if the peers were told within the deadline.
        """
        told = False
        if flags & FLAG_FAILED:
            self._failed_job = True
        if self._failure is None and not self._stopped:
            self._outgoing_flags |= flags
            self._outgoing_message = message
            if self._drive_lock.acquire(timeout=deadline_s):
                try:
                    if self._failure is None and not self._stopped:
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
                busy = now - last_activity < 1.0 and not self._drivers
                interval = self._poll_active_s if busy else self._poll_idle_s
                if self._work.wait(interval):
                    self._work.clear()
                    # let tensors submitted together arrive, so they negotiate and fuse as one
                    delay = self._last_cycle_at + self._cycle_time_s - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                elif self._drivers and time.monotonic() < self._next_stall_check:
                    continue  # a caller is driving cycles: polling too would only contend
                with self._drive_lock:
                    if self._stopped:
                        return
                    if self._progress(include_queue=self._async_waiting):
                        last_activity = time.monotonic()
                    self._check_stalls()
        except Exception as error:  # an engine bug must not leave callers waiting forever
            log.exception("hororing engine thread failed")
            self._halt(HorovodInternalError(f"hororing engine failed on rank {self.rank}: {error!r}"))

    def _progress(self, include_queue):
        """Run one cycle if a peer asked for one, or (include_queue) this rank has news.

        The caller holds the drive lock.
        """
        if self._stopped:
            return False
        news = include_queue and bool(self._queue)
        # A rank whose collectives wait for its peers looks for their wake-ups thoroughly.
        # With news, a cycle runs anyway, and one test tells whether a peer started it
        # first; with nothing pending, a wake-up seen at the next poll costs nothing, while
        # one seen at once often starts an empty cycle just before this rank's own caller
        # arrives (measured: 100 us late ranks at 2 ranks, ~50 us more per step)
        thorough = not news and bool(self._pending)
        woken_for = self._wakeups.latest() if thorough else self._wakeups.latest(patience=1)
        if woken_for > self._cycle or news:
            self._run_cycle(initiate=woken_for <= self._cycle)
            return True
        return False

    def _run_cycle(self, initiate, deadline=None):
        with self._cycle_activity:
            return self._cycle_body(initiate, deadline)

    def _cycle_body(self, initiate, deadline):
        self._cycle += 1
        self._last_cycle_at = time.monotonic()
        wake = None
        if initiate:
            cycle = self._cycle

            def wake():
                self._wakeups.send(cycle)
        with self._queue_lock:
            fresh, self._queue = self._queue, []
            self._async_waiting = False
        negotiator = self.negotiator
        by_name = []  # (name, Meta) of what goes by name this cycle; the rest go by bit
        for request in fresh:
            request.announced = True
            if not negotiator.holds(request.name):
                request.cache_id = negotiator.cache.lookup(request.name, request.meta)
            if request.cache_id is None:
                by_name.append((request.name, request.meta))
            else:
                self._by_bit[request.name] = request
        needs_gather = bool(by_name or self._outgoing_flags or self._gather_requested)
        if self._fold.bytes is not None:
            folded = self._inline_cycle(needs_gather, deadline, wake)
            if folded is None:
                return False
            if folded:
                return True
            wake = None  # the peers have all taken part in this cycle already
        # every cycle repeats the bits of what is still waiting: the vote has no memory
        cache_ids = tuple(request.cache_id for request in self._by_bit.values())
        self._encode_vote(needs_gather, cache_ids)
        if not transport.wait(self._vote_exchange.start(), deadline, wake):
            return False
        self._stats["cycles"] += 1
        self._stats["received_bytes"] += self._agreed.nbytes
        if vote_needs_gather(self._agreed):
            responses = self._gathered_cycle(by_name, cache_ids, deadline)
            if responses is None:
                return False
        else:
            responses = negotiator.cache.agreed_responses(agreed_bits(self._agreed))
        if self.timeline is not None:
            self.timeline.cycle(self._cycle)
        if responses:
            self._fold.predict(responses)
            self.executor.execute(responses, self._take, self._missed,
                                  self.negotiator.cache.id_of)
        self._cycle_done(responses, lambda: sum(map(_response_bytes, responses)))
        return True

    def _cycle_done(self, responses, nbytes):
        """After a cycle's responses ran: tell the autotuner (``nbytes()``: the bytes they
        moved), and flush the timeline (live: what the cycle recorded is in the file now)."""
        if responses and self.tuner is not None and self.tuner.active:
            self.tuner.observe(responses, nbytes())
        if self.timeline is not None:
            self.timeline.flush()

    def _inline_cycle(self, needs_gather, deadline, wake):
        """Gather every rank's fold row (``fold.py``): when all hold the same cached
        allreduce, it is complete in this one exchange. Returns True if it was, False if
        the cycle must go on to the vote, None if the deadline passed."""
        waiting = None
        if len(self._by_bit) == 1 and not needs_gather:
            (waiting,) = self._by_bit.values()
        rows = self._fold.rows(waiting)
        if not transport.wait(self._fold.exchange(), deadline, wake):
            return None
        self._stats["inline_cycles"] += 1
        self._stats["received_bytes"] += rows.nbytes
        cache_id = self._fold.agreed()
        if cache_id is None:
            return False
        self._stats["inline_hits"] += 1
        self._stats["cycles"] += 1
        response = self.negotiator.cache.response(cache_id)
        data = self._fold.data()
        if self.timeline is not None:
            self.timeline.cycle(self._cycle)
        self.executor.finish_inline(response, self._take(response.name), data)
        self._cycle_done((response,), lambda: data.shape[1])
        return True

    def _gathered_cycle(self, by_name, cache_ids, deadline):
        """Gather every rank's header row and notes into the table; return the ready
        responses (None: the deadline passed). A rank's notes are the pickled pair
        (its (name, Meta) announcements by name, its outgoing message)."""
        self._gather_requested = False
        self._stats["gather_cycles"] += 1
        own_notes = b""
        if by_name or self._outgoing_flags:
            own_notes = pickle.dumps((by_name, self._outgoing_message))
        self._encode_header(len(own_notes), cache_ids)
        if not transport.wait(self._comm_negotiate.Iallgather(self._header, self._headers),
                              deadline=deadline):
            return None
        self._stats["received_bytes"] += self._headers.nbytes
        gathered = None
        if np.count_nonzero(self._headers[:, NOTES_BYTES]):  # metadata or flags come with notes
            notes = self._gather_notes(own_notes, deadline)
            if notes is None:
                return None
            self._stats["received_bytes"] += int(self._headers[:, NOTES_BYTES].sum())
            if np.count_nonzero(self._headers[:, FLAGS]):
                self._apply_flags(notes)
                return ()
            gathered = [rank_notes[0] if rank_notes else None for rank_notes in notes]
        self.negotiator.absorb_cycle(self._headers, gathered, time.monotonic())
        for request in self._by_bit.values():
            self.negotiator.backdate(request.name, request.submitted)
        self._by_bit.clear()  # the bits are in the table now: matched by name from here on
        return self.negotiator.ready()

    def _missed(self, name):
        if self.on_missed_error is not None:
            self.on_missed_error(name)

    def _encode_vote(self, needs_gather, cache_ids):
        key = (needs_gather, cache_ids)
        if key != self._vote_key:  # a steady state repeats one vote
            encode_vote(self._vote, needs_gather, cache_ids)
            self._vote_key = key

    def _encode_header(self, notes_bytes, cache_ids):
        # a steady state repeats one header: then only the cycle number changes
        key = (notes_bytes, self._outgoing_flags, cache_ids)
        if key == self._header_key:
            self._header[CYCLE] = self._cycle
        else:
            encode_header(self._header, self._cycle, notes_bytes, self._outgoing_flags, cache_ids)
            self._header_key = key

    def _gather_notes(self, own_notes, deadline):
        lengths = self._headers[:, NOTES_BYTES]
        gathered = np.empty(int(lengths.sum()), dtype=np.uint8)
        offsets = np.zeros(self.size, dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        request = self._comm_negotiate.Iallgatherv(
            np.frombuffer(own_notes, dtype=np.uint8),
            [gathered, lengths.tolist(), offsets.tolist(), MPI.BYTE])
        if not transport.wait(request, deadline=deadline):
            return None
        return [pickle.loads(gathered[offsets[rank]:offsets[rank] + lengths[rank]].tobytes())
                if lengths[rank] else None for rank in range(self.size)]

    def _take(self, name):
        """Remove and return this rank's request for ``name`` (None if it has none)."""
        self._by_bit.pop(name, None)
        with self._queue_lock:
            return self._pending.pop(name, None)

    def _apply_flags(self, notes):
        reasons = []
        for rank in range(self.size):
            flags = int(self._headers[rank, FLAGS])
            message = notes[rank][1] if notes[rank] else None
            if flags & FLAG_FAILED:
                self._failed_job = True
                reasons.append(f"rank {rank} failed: {message}")
            elif flags & FLAG_SHUTDOWN and rank != self.rank:
                reasons.append(f"rank {rank} shut down hororing")
        if reasons:
            self._halt(HorovodInternalError("; ".join(reasons) + ". The job cannot continue: "
                                            "every rank must take part in every collective."))

    def _halt(self, error):
        """Stop for good: fail every pending handle with ``error``."""
        with self._queue_lock:
            if self._failure is None:
                self._failure = error
            self._stopped = True
            pending, self._pending, self._queue = self._pending, {}, []
            self._by_bit = {}
        for request in pending.values():
            request.handle.set_error(HorovodInternalError(str(self._failure)))
        self._work.set()

    def close(self):
        """Release MPI resources; call after ``stop``."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        # after a failure, peers may be gone: leave what is in flight to MPI
        self._wakeups.close(None if self._failed_job else time.monotonic() + 10.0)
        self.executor.close()
        if self.tuner is not None:
            self.tuner.close()
        self._vote_exchange.free()
        self._fold.free()
        self._comm_negotiate.Free()
        if self.timeline is not None:
            self.timeline.close()

    def _check_stalls(self):
        now = time.monotonic()
        if not self.config.stall_check_enabled or now < self._next_stall_check:
            return
        self._next_stall_check = now + _STALL_CHECK_EVERY_S
        if any(now - request.submitted >= _STALL_CHECK_EVERY_S
               for request in self._by_bit.values()):
            # announced by bit, it is invisible to the table: a gathered cycle puts it there,
            # so the ranks that never submit it can be named
            self._gather_requested = True
            self._stats["stall_gathers"] += 1
            self._run_cycle(initiate=True)
            now = time.monotonic()
        shutdown_after = self.config.stall_shutdown_seconds
        for name, missing, waited in self.negotiator.stalled(now, self.config.stall_check_seconds):
            kind = "join" if name == JOIN_NAME else name
            message = (f"hororing stall: tensor '{kind}' has been waiting {waited:.0f} s for "
                       f"rank(s) {missing} to submit it. One or more ranks may have called a "
                       f"different collective, or none; every rank must call the same "
                       f"collectives in the same order.")
            if self.rank == 0 or self.rank in missing:
                log.warning(message)
            if shutdown_after > 0 and waited >= shutdown_after:
                transport.end_job(f"[rank {self.rank}] {message} Ending the job: stalled longer "
                                  f"than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={shutdown_after:g}.")
