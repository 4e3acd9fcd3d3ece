"""Cross-rank agreement on which named tensors are ready, with what metadata, in what order.

This module is pure: the engine feeds it what every rank announced in a cycle (identical
input on every rank), and every rank computes the identical answer, so no coordinator rank
is needed. A tensor is ready when every rank has submitted it (a rank that called
``join()`` counts as submitting zeros to an allreduce). Before any data moves, the ranks'
metadata is compared and a mismatch becomes an error, worded as Horovod words it, for that
tensor on every rank.

A tensor negotiated once is remembered (the response cache): a rank that submits it again
with the same metadata announces one bit instead of its metadata. Every cycle starts with a
vote: one fixed-size bitwise-AND reduction of each rank's cache bits and one field. When no
rank asks for more (the steady state of a training loop), the AND is the ready set, read
off with one dictionary lookup: the cycle's bytes and work do not grow with the ranks.
A rank asks for a gathered cycle when it has a new name, new metadata, or a flag: then
every rank's header row and notes (the (name, Meta) pairs it announces by name, and a
failing rank's message) are gathered and enter the table (``absorb_cycle``),
including the cached bits, which are matched by name from then on.
"""

import dataclasses
import itertools
from typing import NamedTuple

import numpy as np

from .deadlocks import deadlock_message
from .mismatch import mismatch

JOIN_NAME = "__join__"
UNCACHED_KINDS = ("join",)


class Meta(NamedTuple):
    """What one rank says about one named collective; the ranks must agree on it.

    A NamedTuple: built on every call and compared on every cycle, so it must be cheap.
    """

    kind: str
    dtype: str = ""
    shape: tuple = ()
    op: int = 1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple = None
    device: str = "cpu"
    wire: str = ""  # the dtype sent and summed in, when the sender chose it (compression)


@dataclasses.dataclass
class Response:
    """A tensor every rank has agreed on (``error`` is None) or failed on (``error`` set)."""

    name: str
    meta: Meta                      # the lowest present rank's metadata
    metas: dict                     # rank -> Meta, for per-rank shapes and splits
    joined: frozenset = frozenset()  # ranks that contribute zeros (allreduce after join)
    error: str = None
    last_joined: int = -1           # for join: the last rank to join
    deadlock: bool = False          # failed because every rank was blocked on another


@dataclasses.dataclass
class _Entry:
    order: int
    first_seen: float
    metas: dict
    warned_at: float = None


def generated_once(name):
    """True for a name ``Group.auto_name`` generated for one unnamed call
    (``allreduce.noname.7``, a grouped call's members ``grouped_allreduce.noname.3.0``, the
    parts of one unnamed object or sparse call: ``broadcast_object.noname.4.size``,
    ``.data``, ``sparse_allreduce.noname.2.values``): it never comes again, so it takes no
    cache entry (the cache keeps nothing new once full, so entries for names that never
    come again would leave the names a job repeats without one). A function of the name
    alone, so every rank decides alike; a DistributedOptimizer's
    ``allreduce.noname.<group>.<index>`` repeats and is cached."""
    prefix, separator, tail = name.rpartition(".noname.")
    if not separator:
        return False
    number, _, member = tail.partition(".")
    if not number.isdigit():
        return False
    if member.isdigit():
        return prefix.startswith("grouped_")
    return True  # no member, or a named part of the one call


class ResponseCache:
    """Negotiated (name, metadata) pairs by id; the same ids on every rank.

    Once full, a new pair takes the place of the oldest entry (the ids round-robin), so a
    job that has met more names than ``capacity`` keeps caching the ones it repeats now. An
    entry changes only in ``record``, during a gathered cycle, after every rank's cached ids
    of that cycle went into the table by name: no rank holds a request by an id then, so an
    id that comes to mean another name is never misread."""

    def __init__(self, capacity):
        self.capacity = capacity
        self._next_out = 0  # the id a new pair takes once the cache is full
        self._entries = []
        # the agreed Response for each id (the cycle reads it), reused in the steady state
        self.responses = []
        self._ids = {}
        self._agreed = {}     # a vote's cache bits -> the Responses they stand for

    def lookup(self, name, meta):
        """Return the id of (name, meta) if cached with exactly this metadata, else None."""
        cache_id = self._ids.get(name)
        if cache_id is not None and self._entries[cache_id][1] == meta:
            return cache_id
        return None

    def resolve(self, cache_id):
        return self._entries[cache_id]

    def id_of(self, name):
        """The id ``name`` is cached under (any metadata), or None."""
        return self._ids.get(name)

    def agreed_responses(self, bits):
        """The Responses for the bytes of a reduced vote's cache bits: the tensors every
        rank announced. A training loop repeats a few such votes, so each is decoded once."""
        responses = self._agreed.get(bits)
        if responses is None:
            if len(self._agreed) >= _AGREED_VOTES:
                self._agreed.clear()
            ids = _decode_bits(np.frombuffer(bits, dtype=np.uint64))
            responses = self._agreed[bits] = tuple(self.responses[cache_id] for cache_id in ids)
        return responses

    def record(self, name, meta):
        """Remember a successful negotiation; a known name gets its metadata updated."""
        if meta.kind in UNCACHED_KINDS or generated_once(name):
            return
        response = Response(name=name, meta=meta, metas=_SameForEveryRank(meta))
        self._agreed.clear()  # a decoded vote may name the entry this replaces
        cache_id = self._ids.get(name)
        if cache_id is not None:
            self._entries[cache_id] = (name, meta)
            self.responses[cache_id] = response
        elif len(self._entries) < self.capacity:
            self._ids[name] = len(self._entries)
            self._entries.append((name, meta))
            self.responses.append(response)
        elif self.capacity:
            cache_id = self._next_out
            self._next_out = (cache_id + 1) % self.capacity
            del self._ids[self._entries[cache_id][0]]
            self._ids[name] = cache_id
            self._entries[cache_id] = (name, meta)
            self.responses[cache_id] = response


class Negotiator:
    """The table of tensors announced by some ranks: the same entries, in the same order, on
    every rank (only the times each rank first saw them differ)."""

    def __init__(self, size, cache_capacity):
        self.size = size
        self.cache = ResponseCache(cache_capacity)
        self.table = {}  # name -> _Entry; read by the cycle (a lane runs only while it is empty)
        self._counter = itertools.count()
        self._join_order = {}  # rank -> when it joined, while a join is pending

    def absorb(self, rank, cache_ids, by_name, now):
        """Record what ``rank`` announced this cycle: cached ids, and (name, Meta) pairs
        announced by name."""
        for cache_id in cache_ids:
            name, meta = self.cache.resolve(cache_id)
            self._add(rank, name, meta, now)
        for name, meta in by_name:
            self._add(rank, name, meta, now)

    def absorb_cycle(self, headers, by_name, now):
        """Record a gathered cycle: every rank's header row and the (name, Meta) pairs it
        announced by name (``by_name[rank]``; None: no rank sent any). Cached ids in the rows enter the table too, so from here
        on those tensors are matched by name, with the ranks that have not announced them
        named if they stall."""
        if by_name is None:
            by_name = (None,) * self.size
        for rank in range(self.size):
            self.absorb(rank, decode_cache_ids(headers[rank]), by_name[rank] or (), now)

    def backdate(self, name, since):
        """This rank submitted ``name`` at ``since``, before a gathered cycle put it in the
        table (it was announced by cache bit until then): count its wait from there."""
        entry = self.table.get(name)
        if entry is not None and since < entry.first_seen:
            entry.first_seen = since

    def cached_id(self, name, meta):
        """The cache id ``name`` goes by this cycle, announced with ``meta``: None where it
        must go by name (not cached with exactly this metadata, or ``holds`` it)."""
        table = self.table
        if name in table or JOIN_NAME in table:
            return None
        cache = self.cache  # its ``lookup``, written out: every announcement asks it
        cache_id = cache._ids.get(name)
        if cache_id is not None and cache._entries[cache_id][1] == meta:
            return cache_id
        return None

    def holds(self, name):
        """True if a tensor of this name must be announced by name, not by its cache bit:
        some rank's announcement of it is already in the table, or a rank has joined."""
        return name in self.table or JOIN_NAME in self.table

    def ready(self):
        """Return the responses this cycle, in the same order on every rank, and drop them."""
        join_entry = self.table.get(JOIN_NAME)
        joined = frozenset(join_entry.metas) if join_entry else frozenset()
        everyone = frozenset(range(self.size))
        responses = []
        for name, entry in list(self.table.items()):
            if name == JOIN_NAME:
                continue
            present = frozenset(entry.metas)
            kind = entry.metas[min(present)].kind
            if joined and kind != "allreduce":
                # a joined rank waits inside join() and submits nothing more, so this can
                # never complete: fail it now on the ranks that submitted it (their names
                # need not even agree), instead of leaving them waiting
                responses.append(self._pop(name, error=(
                    f"{kind.capitalize()} is not supported with Join at this time: tensor "
                    f"'{name}' cannot complete: rank(s) {sorted(joined - present)} called "
                    f"join(), and only allreduce may run while ranks are joined")))
                continue
            needed = everyone - joined if kind == "allreduce" else everyone
            if not present >= needed:
                continue
            error = mismatch(name, entry.metas)
            response = self._pop(name, error=error)
            if kind == "allreduce":
                response.joined = joined - present
            if error is None:
                self.cache.record(name, response.meta)
            responses.append(response)
        if join_entry is not None and len(join_entry.metas) == self.size:
            response = self._pop(JOIN_NAME)
            response.last_joined = max(join_entry.metas, key=self._join_order.__getitem__)
            self._join_order.clear()
            responses.append(response)
        return responses

    def deadlocked(self):
        """Fail every pending tensor but ``join`` (called when every rank is blocked and none
        is ready: none of them can ever complete); the responses carry one message naming
        what each rank waits on and which ranks submitted each name."""
        entries = {name: entry.metas for name, entry in self.table.items() if name != JOIN_NAME}
        if not entries:
            return []
        message = deadlock_message(entries, self.table.get(JOIN_NAME), self.size)
        responses = [self._pop(name, error=message) for name in entries]
        for response in responses:
            response.deadlock = True
        return responses

    def stalled(self, now, after_seconds):
        """Yield (name, missing ranks, seconds waiting) for entries older than the threshold.

        Each entry is reported once per ``after_seconds`` interval.
        """
        everyone = set(range(self.size))
        for name, entry in self.table.items():
            waited = now - entry.first_seen
            if waited < after_seconds:
                continue
            if entry.warned_at is None or now - entry.warned_at >= after_seconds:
                entry.warned_at = now
                yield name, sorted(everyone - set(entry.metas)), waited

    def pending_names(self):
        return list(self.table)

    def _add(self, rank, name, meta, now):
        entry = self.table.get(name)
        if entry is None:
            entry = self.table[name] = _Entry(next(self._counter), now, {})
        if name == JOIN_NAME:
            self._join_order.setdefault(rank, next(self._counter))  # for the last to join
        entry.metas.setdefault(rank, meta)

    def _pop(self, name, error=None):
        entry = self.table.pop(name)
        first_rank = min(entry.metas)
        return Response(name=name, meta=entry.metas[first_rank], metas=entry.metas, error=error)


class _SameForEveryRank(dict):
    """rank -> Meta where every rank sent the same metadata (the cached steady state)."""

    def __init__(self, meta):
        super().__init__()
        self._meta = meta

    def __missing__(self, rank):
        return self._meta


HEADER_FIELDS = 4  # the header's fields, then its cache bits:
# NOTES_BYTES: the rank's pickled notes; WAITING: 1 when the rank is blocked (deadlocks.py)
CYCLE, NOTES_BYTES, FLAGS, WAITING = range(HEADER_FIELDS)
VOTE_FIELDS = 1    # all ones: this rank needs no gathered cycle; zero: it does
_AGREED_VOTES = 64  # distinct reduced votes remembered


def header_words(cache_capacity):
    """Length in int64 words of a cycle header: fields, then one bit per cache id."""
    return HEADER_FIELDS + (cache_capacity + 63) // 64


def vote_words(cache_capacity):
    """Length in int64 words of a cycle's vote: the field, then one bit per cache id."""
    return VOTE_FIELDS + (cache_capacity + 63) // 64


def encode_header(header, cycle, notes_bytes, flags, cache_ids, waiting=False):
    """Fill the int64 ``header`` in place."""
    header[:] = 0
    header[CYCLE] = cycle
    header[NOTES_BYTES] = notes_bytes
    header[FLAGS] = flags
    header[WAITING] = int(waiting)
    _set_bits(header[HEADER_FIELDS:], cache_ids)


def encode_vote(vote, needs_gather, cache_ids):
    """Fill the int64 ``vote`` in place. Reduced with a bitwise AND over the ranks, its
    field stays all ones only if no rank needs a gathered cycle, and its bits are the
    cached tensors every rank announced."""
    vote[:] = 0
    vote[0] = 0 if needs_gather else -1
    _set_bits(vote[VOTE_FIELDS:], cache_ids)


def vote_needs_gather(agreed):
    """True if some rank asked for a gathered cycle in the reduced vote ``agreed``."""
    return agreed[0] != -1


def agreed_bits(agreed):
    """The bytes of the reduced vote's cache bits (for ResponseCache.agreed_responses)."""
    return agreed[VOTE_FIELDS:].tobytes()


def _set_bits(words, cache_ids):
    values = {}
    for cache_id in cache_ids:
        values[cache_id >> 6] = values.get(cache_id >> 6, 0) | (1 << (cache_id & 63))
    if values:
        bits = words.view(np.uint64)
        for word, value in values.items():
            bits[word] = value


def decode_cache_ids(header):
    """Return the cache ids whose bits are set in ``header``, ascending."""
    return _decode_bits(header[HEADER_FIELDS:].view(np.uint64))


def _decode_bits(words):
    ids = []
    for word, value in enumerate(words.tolist()):
        while value:
            low = value & -value
            ids.append(word * 64 + low.bit_length() - 1)
            value ^= low
    return ids
