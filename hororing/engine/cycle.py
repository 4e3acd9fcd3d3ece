"""One negotiation cycle, as a plain object: no threads, no locks, no queue.

Cycles are collective. Each starts with a vote: one fixed-size bitwise-AND reduction of one
bit per already-negotiated tensor this rank has pending, and a field saying whether this
rank needs more. In the steady state nobody does, and the AND is the ready list: one
reduction of ~(cache capacity / 8) bytes, whatever the number of ranks. A rank with a new
name, new metadata or a flag asks for a gathered cycle: every rank's header row and notes
(the names it announces with their metadata, a failing rank's message) are then gathered
too, and every rank computes the same ready list from the same table (``negotiation``).
A lone small allreduce that repeats is folded into the cycle's first exchange (``fold``).

A cycle decides and runs nothing: it returns what every rank agreed (a ``Decision``: the
ready responses, in the same order on every rank, and the fold's gathered rows when the fold
was agreed), as a ring's schedule is returned apart from its execution. The driver
(``engine.py``) pairs them with its requests and runs them (``executor.py``, or
``fold.LatencyFolding`` for a fold). The cycle's peers are reached only through its exchange
(``exchange.py``); who runs a cycle, when, and from which thread is the driver's business.
"""

import pickle
import time
from typing import NamedTuple, Optional

import numpy as np

from .. import transport
from .buckets import bucket_key
from .fold import Fold
from .negotiation import (CYCLE, FLAGS, NOTES_BYTES, WAITING, Negotiator, agreed_bits,
                          encode_header, encode_vote, header_words, vote_needs_gather, vote_words)

FLAG_FAILED = 1
FLAG_SHUTDOWN = 2
NOT_RUN = "not run"  # ``run_lane``: the lane's call does not fold this cycle; nothing done


class Decision(NamedTuple):
    """What one cycle agreed: ``responses`` to run, in order (maybe none), and, where the
    fold was agreed, ``folded``: every rank's row for the one response (then its only one)."""

    responses: list
    folded: Optional[np.ndarray] = None


class JobEnded(Exception):
    """A gathered cycle found a rank's failure or another rank's shutdown flag: the job
    cannot go on. ``failed``: some rank failed (not a clean shutdown)."""

    def __init__(self, message, failed):
        super().__init__(message)
        self.failed = failed


class Cycle:
    """The negotiation state of one rank, and one cycle at a time over ``exchange``.

    ``number`` counts the cycles run. ``stats``: ``cycles`` run, ``gather_cycles`` that
    gathered every rank's header (some rank had a new name, new metadata or a flag, or asked
    because a tensor announced by bit waited a second: ``stall_gathers`` counts this rank's
    asks), ``inline_cycles`` that began with the fold's exchange and ``inline_hits`` that
    completed in it (``lane_hits`` of them a lane's: ``lane.py``; ``compiled_folds`` lane
    cycles run as one compiled call: ``compiled_fold.py``), ``received_bytes`` by
    negotiation (``fold_bytes`` of them in the fold's exchanges, which carry the data too).
    """

    def __init__(self, exchange, folding, cache_capacity):
        """``folding``: the data's side of the fold (``fold.LatencyFolding``)."""
        self.size, self.rank = exchange.size, exchange.rank
        self._exchange = exchange
        self.negotiator = Negotiator(self.size, cache_capacity)
        self.number = 0
        self._by_bit = {}  # name -> Request announced by its cache bit, not yet run
        self._gather_asked = False  # a cached announcement waits long: go by name
        self._header = np.zeros(header_words(cache_capacity), dtype=np.int64)
        self._headers = np.zeros((self.size, self._header.size), dtype=np.int64)
        self._header_key = None  # what self._header encodes, less the cycle number
        self._vote = np.zeros(vote_words(cache_capacity), dtype=np.int64)
        self._agreed = np.zeros_like(self._vote)
        self._vote_key = None    # what self._vote encodes
        self._vote_exchange = exchange.repeated("allreduce", self._vote, self._agreed, op="band")
        self._fold = Fold(exchange, folding)
        self.stats = {"cycles": 0, "gather_cycles": 0, "stall_gathers": 0, "inline_cycles": 0,
                      "inline_hits": 0, "lane_hits": 0, "compiled_folds": 0,
                      "received_bytes": 0, "fold_bytes": 0, "deadlocks": 0}

    # ---- what the driver asks of it -----------------------------------------------------

    def run(self, fresh, *, flags=0, message=None, wake=None, deadline=None, waiting=None):
        """Run the next cycle on this rank; every rank runs the same cycles in order.

        Args:
            fresh: the requests submitted since the last cycle, announced in this one.
            flags: FLAG_FAILED / FLAG_SHUTDOWN, announced with ``message``.
            wake: called once if the first exchange has not completed after a brief spin
                (to wake peers that are not taking part yet).
            deadline: a ``time.monotonic()`` value to give up at.
            waiting: ``waiting()`` is True when this rank is blocked (``deadlocks.py``); asked
                only in a gathered cycle, whose header says it: when every rank's does and
                nothing is ready, every pending tensor fails.

        Returns:
            The ``Decision``, or None if the deadline passed first.

        Raises:
            JobEnded: a rank flagged failure, or another rank shut down.
        """
        self.number += 1
        negotiator = self.negotiator
        by_name = []  # (name, Meta) of what goes by name this cycle; the rest go by bit
        for request in fresh:
            request.announced = True
            request.cache_id = negotiator.cached_id(request.name, request.meta)
            if request.cache_id is None:
                by_name.append((request.name, request.meta))
            else:
                self._by_bit[request.name] = request
        needs_gather = bool(by_name or flags or self._gather_asked)
        if self._fold.bytes is not None:
            folded = self._folded(needs_gather, deadline, wake)
            if folded != ():
                return folded
            wake = None  # the peers have all taken part in this cycle already
        return self._after_fold(needs_gather, by_name, flags, message, deadline, wake, waiting)

    def run_lane(self, request, lane, wake, activity):
        """``run((request,), wake=wake)`` for a call that fits ``lane`` (``lane.py``; the
        request carries its cache id), where the next cycle, announcing only it, folds it on
        this rank: nothing else announced by bit, no gathered cycle asked for, the fold
        expected in rows that take its size, nothing in the negotiation table (so neither
        its name nor a join), its cache entry the lane's own. Then the same cycle, its steps
        written out.
        Returns ``NOT_RUN`` where it does not fold (nothing done: the call goes the usual
        way); the gathered rows when every rank folded it (``fold.REDUCED`` or
        ``fold.FINALIZED`` where the cycle ran compiled and the request's output holds them
        reduced); else None: then the cycle goes on with ``resume_lane``. ``activity``
        (``transport.activity``): entered where the cycle waits, not around it (a compiled
        cycle that completes at once has no need of it)."""
        fold = self._fold
        plan = lane.plan
        negotiator = self.negotiator
        # ``cached_id`` gives the lane's id, without the call: nothing is in the table (so
        # neither its name nor a join), and its cache entry is the one the lane was made
        # with (``record`` makes a new Response whenever it changes an entry)
        if fold.bytes is None or plan.nbytes > fold.bytes or plan.nbytes < fold.least \
                or self._by_bit or self._gather_asked or negotiator.table \
                or negotiator.cache.responses[lane.cache_id] is not lane.response:
            return NOT_RUN
        self.number += 1
        request.announced = True
        folded = fold.run_compiled(request, lane.response, plan, wake, activity)
        if folded is None:
            with activity:
                transport.wait_until(fold.start(request, plan).Test, None, wake)
                folded = fold.agreed() == request.cache_id
            rows = fold.gathered
        else:
            rows = folded
            self.stats["compiled_folds"] += 1
        stats = self.stats
        stats["inline_cycles"] += 1
        stats["received_bytes"] += fold.received_bytes
        stats["fold_bytes"] += fold.received_bytes
        if folded:
            stats["inline_hits"] += 1
            stats["lane_hits"] += 1
            stats["cycles"] += 1
            return rows
        return None

    def resume_lane(self, request, waiting):
        """The rest of a cycle ``run_lane`` did not fold: ``request`` goes on by its cache bit
        to the vote (the engine has put it with its pending requests). Returns the Decision."""
        self._by_bit[request.name] = request
        return self._after_fold(False, (), 0, None, None, None, waiting)

    def _after_fold(self, needs_gather, by_name, flags, message, deadline, wake, waiting):
        """The cycle after the fold (or without one): the vote, and a gathered cycle where
        it asks for one. Returns the Decision, or None if the deadline passed."""
        negotiator = self.negotiator
        # every cycle repeats the bits of what is still waiting: the vote has no memory
        cache_ids = tuple(request.cache_id for request in self._by_bit.values())
        self._encode_vote(needs_gather, cache_ids)
        if not transport.wait(self._vote_exchange.start(), deadline, wake):
            return None
        self.stats["cycles"] += 1
        self.stats["received_bytes"] += self._agreed.nbytes
        if vote_needs_gather(self._agreed):
            responses = self._gathered(by_name, cache_ids, flags, message, deadline, waiting)
            if responses is None:
                return None
        else:
            responses = negotiator.cache.agreed_responses(agreed_bits(self._agreed))
        if responses:
            self._fold.predict(responses)
            for response in responses:
                self._by_bit.pop(response.name, None)
        return Decision(responses)

    def reduction_order(self, names):
        """``names`` in the order a fused bucket holds them: cached names by their cache id,
        then names the cache has no room for by name (the executor sorts each bucket so,
        whatever order the cycle's responses came in). What the caller lays memory out by,
        so that a fused bucket is back to back (``buffers.HostBuffers.span``)."""
        id_of = self.negotiator.cache.id_of
        return sorted(names, key=lambda name: bucket_key(name, id_of(name)))

    def ask_gather(self):
        """Make the next cycle a gathered one (a tensor announced by its bit has waited
        long: in the table, the ranks that never submit it can be named)."""
        self._gather_asked = True
        self.stats["stall_gathers"] += 1

    def waiting_by_bit(self):
        """The requests announced by their cache bit that have not run yet."""
        return self._by_bit.values()

    def forget(self):
        """Drop the requests announced by bit (the engine has failed them)."""
        self._by_bit = {}

    def free(self, clean=True):
        """Free the exchanges (``clean`` False: after a failure, where a peer may be gone)."""
        self._vote_exchange.free()
        self._fold.free(clean)

    # ---- the cycle's parts ------------------------------------------------------------

    def _folded(self, needs_gather, deadline, wake):
        """Gather every rank's fold row (``fold.py``): when all hold the same cached
        allreduce, it is complete in this one exchange. Returns the Decision with the rows
        (the folded allreduce), () if the cycle must go on to the vote, None if the deadline
        passed."""
        waiting = None
        if len(self._by_bit) == 1 and not needs_gather:
            (waiting,) = self._by_bit.values()
        fold = self._fold
        if not transport.wait_until(fold.start(waiting).Test, deadline, wake):
            return None
        self.stats["inline_cycles"] += 1
        self.stats["received_bytes"] += fold.received_bytes
        self.stats["fold_bytes"] += fold.received_bytes
        cache_id = fold.agreed()
        if cache_id is None:
            return ()
        self.stats["inline_hits"] += 1
        self.stats["cycles"] += 1
        response = self.negotiator.cache.responses[cache_id]
        self._by_bit.pop(response.name, None)
        # Decision((response,), rows), made without its Python-level __new__ (the steady
        # state of a loop of blocking calls comes here once per call)
        return tuple.__new__(Decision, ((response,), fold.gathered))

    def _gathered(self, by_name, cache_ids, flags, message, deadline, waiting=None):
        """Gather every rank's header row and notes into the table; return the ready
        responses (None: the deadline passed). A rank's notes are the pickled pair
        (its (name, Meta) announcements by name, its outgoing message)."""
        self._gather_asked = False
        self.stats["gather_cycles"] += 1
        own_notes = b""
        if by_name or flags:
            own_notes = pickle.dumps((by_name, message))
        self._encode_header(len(own_notes), flags, cache_ids,
                            waiting is not None and waiting())
        if not transport.wait(self._exchange.allgather(self._header, self._headers), deadline):
            return None
        self.stats["received_bytes"] += self._headers.nbytes
        gathered = None
        if np.count_nonzero(self._headers[:, NOTES_BYTES]):  # metadata or flags come with notes
            notes = self._gather_notes(own_notes, deadline)
            if notes is None:
                return None
            self.stats["received_bytes"] += int(self._headers[:, NOTES_BYTES].sum())
            if np.count_nonzero(self._headers[:, FLAGS]):
                self._end_if_flagged(notes)
                return ()
            gathered = [rank_notes[0] if rank_notes else None for rank_notes in notes]
        self.negotiator.absorb_cycle(self._headers, gathered, time.monotonic())
        for request in self._by_bit.values():
            self.negotiator.backdate(request.name, request.submitted)
        self._by_bit.clear()  # the bits are in the table now: matched by name from here on
        responses = self.negotiator.ready()
        if not responses and self._headers[:, WAITING].all():
            responses = self.negotiator.deadlocked()
            self.stats["deadlocks"] += bool(responses)
        return responses

    def _encode_vote(self, needs_gather, cache_ids):
        key = (needs_gather, cache_ids)
        if key != self._vote_key:  # a steady state repeats one vote
            encode_vote(self._vote, needs_gather, cache_ids)
            self._vote_key = key

    def _encode_header(self, notes_bytes, flags, cache_ids, waiting):
        # a steady state repeats one header: then only the cycle number changes
        key = (notes_bytes, flags, cache_ids, waiting)
        if key == self._header_key:
            self._header[CYCLE] = self.number
        else:
            encode_header(self._header, self.number, notes_bytes, flags, cache_ids, waiting)
            self._header_key = key

    def _gather_notes(self, own_notes, deadline):
        lengths = self._headers[:, NOTES_BYTES]
        gathered = np.empty(int(lengths.sum()), dtype=np.uint8)
        offsets = np.zeros(self.size, dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        request = self._exchange.allgatherv(own_notes, gathered, lengths.tolist(),
                                            offsets.tolist())
        if not transport.wait(request, deadline):
            return None
        return [pickle.loads(gathered[offsets[rank]:offsets[rank] + lengths[rank]].tobytes())
                if lengths[rank] else None for rank in range(self.size)]

    def _end_if_flagged(self, notes):
        reasons, failed = [], False
        for rank in range(self.size):
            flags = int(self._headers[rank, FLAGS])
            message = notes[rank][1] if notes[rank] else None
            if flags & FLAG_FAILED:
                failed = True
                reasons.append(f"rank {rank} failed: {message}")
            elif flags & FLAG_SHUTDOWN and rank != self.rank:
                reasons.append(f"rank {rank} shut down hororing")
        if reasons:
            raise JobEnded("; ".join(reasons) + ". The job cannot continue: every rank must "
                           "take part in every collective.", failed)
