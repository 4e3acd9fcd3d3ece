"""Negotiation is pure: feed it what the ranks announced and check what every rank decides."""

import numpy as np
import pytest

from hororing import ops
from hororing.engine.negotiation import (HEADER_FIELDS, JOIN_NAME, Meta, Negotiator,
                                         agreed_bits, decode_cache_ids, encode_header,
                                         encode_vote, header_words, vote_needs_gather,
                                         vote_words)


def allreduce_meta(shape=(5,), dtype="float32", op=ops.Average, **fields):
    return Meta(kind="allreduce", dtype=dtype, shape=shape, op=op, **fields)


def test_ready_only_when_every_rank_submitted_in_first_seen_order():
    negotiator = Negotiator(size=3, cache_capacity=8)
    negotiator.absorb(0, [], [("b", allreduce_meta()), ("a", allreduce_meta())], now=0.0)
    negotiator.absorb(1, [], [("a", allreduce_meta()), ("b", allreduce_meta())], now=0.0)
    assert negotiator.ready() == []
    negotiator.absorb(2, [], [("a", allreduce_meta()), ("b", allreduce_meta())], now=1.0)
    assert [response.name for response in negotiator.ready()] == ["b", "a"]
    assert negotiator.pending_names() == []


@pytest.mark.parametrize("other,message", [
    (allreduce_meta(shape=(6,)), r"Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of "
                                 r"shape \[5\], but another rank sent a tensor of shape \[6\]\."),
    (allreduce_meta(dtype="int32"), "Mismatched data types: One rank had type float32, but "
                                    "another rank had type int32."),
    (allreduce_meta(op=ops.Sum), "Mismatched ALLREDUCE reduction operations: One rank specified "
                                 "Average, but another rank specified Sum."),
    (Meta(kind="allgather", dtype="float32", shape=(5,)),
     "Mismatched MPI operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER."),
    (allreduce_meta(prescale=2.0), "Mismatched prescale factors"),
    (allreduce_meta(postscale=2.0), "Mismatched postscale factors"),
])
def test_mismatches_are_errors_naming_tensor_and_ranks(other, message):
    negotiator = Negotiator(size=2, cache_capacity=8)
    negotiator.absorb(0, [], [("grad", allreduce_meta())], now=0.0)
    negotiator.absorb(1, [], [("grad", other)], now=0.0)
    (response,) = negotiator.ready()
    assert response.error is not None
    assert pytest.importorskip("re").search(message, response.error)
    assert "tensor 'grad': rank 0 vs rank 1" in response.error


def test_broadcast_root_and_allgather_trailing_dims_are_checked():
    negotiator = Negotiator(size=2, cache_capacity=8)
    negotiator.absorb(0, [], [("b", Meta(kind="broadcast", dtype="int64", shape=(2,), root=0)),
                              ("g", Meta(kind="allgather", dtype="int64", shape=(2, 3)))], 0.0)
    negotiator.absorb(1, [], [("b", Meta(kind="broadcast", dtype="int64", shape=(2,), root=1)),
                              ("g", Meta(kind="allgather", dtype="int64", shape=(4, 4)))], 0.0)
    broadcast, gather = negotiator.ready()
    assert broadcast.error.startswith("Mismatched BROADCAST root ranks: One rank specified root "
                                      "rank 0, but another rank specified root rank 1.")
    assert gather.error.startswith("Mismatched ALLGATHER tensor shapes: One rank sent a tensor "
                                   "with dimension 1 equal to 3, but another rank sent a tensor "
                                   "with dimension 1 equal to 4.")


def test_allgather_first_dimension_may_differ():
    negotiator = Negotiator(size=2, cache_capacity=8)
    negotiator.absorb(0, [], [("g", Meta(kind="allgather", dtype="int64", shape=(1, 3)))], 0.0)
    negotiator.absorb(1, [], [("g", Meta(kind="allgather", dtype="int64", shape=(4, 3)))], 0.0)
    (response,) = negotiator.ready()
    assert response.error is None
    assert [response.metas[rank].shape[0] for rank in (0, 1)] == [1, 4]


def test_cache_turns_a_repeat_into_a_bit():
    negotiator = Negotiator(size=2, cache_capacity=8)
    meta = allreduce_meta()
    for rank in (0, 1):
        negotiator.absorb(rank, [], [("grad", meta)], 0.0)
    negotiator.ready()
    cache_id = negotiator.cache.lookup("grad", meta)
    assert cache_id == 0
    assert negotiator.cache.lookup("grad", allreduce_meta(shape=(6,))) is None
    negotiator.absorb(0, [cache_id], [], 1.0)
    assert negotiator.ready() == []
    negotiator.absorb(1, [cache_id], [], 1.0)
    (response,) = negotiator.ready()
    assert response.name == "grad" and response.error is None


def test_cached_and_full_announcements_of_one_name_are_compared():
    negotiator = Negotiator(size=2, cache_capacity=8)
    for rank in (0, 1):
        negotiator.absorb(rank, [], [("grad", allreduce_meta())], 0.0)
    negotiator.ready()
    negotiator.absorb(0, [0], [], 1.0)
    negotiator.absorb(1, [], [("grad", allreduce_meta(shape=(7,)))], 1.0)
    (response,) = negotiator.ready()
    assert "tensor of shape [5], but another rank sent a tensor of shape [7]" in response.error


def test_cache_capacity_is_respected():
    negotiator = Negotiator(size=1, cache_capacity=1)
    negotiator.absorb(0, [], [("a", allreduce_meta()), ("b", allreduce_meta())], 0.0)
    negotiator.ready()
    assert negotiator.cache.lookup("a", allreduce_meta()) is None  # made room for b
    assert negotiator.cache.lookup("b", allreduce_meta()) == 0


def test_names_generated_for_one_call_take_no_cache_entry():
    """Unnamed calls get a new name each time: caching them would fill the cache, and the
    names a job does repeat would then go by name in every cycle."""
    one_off = ["allreduce.noname.7", "broadcast.loader.noname.0", "grouped_allreduce.noname.3.1"]
    repeated = ["grad.fc1", "allreduce.noname.0.5", "allreduce.noname", "x.noname.y"]
    negotiator = Negotiator(size=1, cache_capacity=len(one_off) + len(repeated))
    negotiator.absorb(0, [], [(name, allreduce_meta()) for name in one_off + repeated], 0.0)
    assert len(negotiator.ready()) == len(one_off) + len(repeated)
    assert [negotiator.cache.lookup(name, allreduce_meta()) for name in one_off] == [None] * 3
    assert [negotiator.cache.lookup(name, allreduce_meta()) for name in repeated] == [0, 1, 2, 3]


def test_joined_ranks_count_as_zero_contributors_for_allreduce_only():
    negotiator = Negotiator(size=3, cache_capacity=8)
    negotiator.absorb(2, [], [(JOIN_NAME, Meta(kind="join"))], 0.0)
    negotiator.absorb(0, [], [("grad", allreduce_meta()),
                              ("gather", Meta(kind="allgather", dtype="int64", shape=(1,)))], 0.0)
    negotiator.absorb(1, [], [("grad", allreduce_meta()),
                              ("gather", Meta(kind="allgather", dtype="int64", shape=(1,)))], 0.0)
    grad, gather = negotiator.ready()
    assert grad.error is None and grad.joined == frozenset({2})
    assert "rank(s) [2] called join()" in gather.error
    negotiator.absorb(1, [], [(JOIN_NAME, Meta(kind="join"))], 1.0)
    assert negotiator.ready() == []
    negotiator.absorb(0, [], [(JOIN_NAME, Meta(kind="join"))], 2.0)
    (join,) = negotiator.ready()
    assert join.name == JOIN_NAME and join.last_joined == 0


def test_a_collective_other_than_allreduce_fails_at_once_while_a_rank_is_joined():
    # rank 1 joined; ranks 0 and 2 each submit an allgather under a different name (their
    # unnamed counters differ): neither can ever complete, so each fails without waiting
    # for the other ranks
    negotiator = Negotiator(size=3, cache_capacity=8)
    negotiator.absorb(1, [], [(JOIN_NAME, Meta(kind="join"))], 0.0)
    negotiator.absorb(0, [], [("allgather.noname.3", Meta(kind="allgather", dtype="int64",
                                                          shape=(1,)))], 0.0)
    (first,) = negotiator.ready()
    assert first.name == "allgather.noname.3"
    assert "Allgather is not supported with Join" in first.error
    negotiator.absorb(2, [], [("allgather.noname.4", Meta(kind="broadcast", dtype="int64",
                                                          shape=(1,), root=2))], 1.0)
    (second,) = negotiator.ready()
    assert "Broadcast is not supported with Join" in second.error
    assert "rank(s) [1] called join()" in second.error


def test_stalled_entries_name_the_missing_ranks_once_per_interval():
    negotiator = Negotiator(size=4, cache_capacity=8)
    negotiator.absorb(0, [], [("grad", allreduce_meta())], now=0.0)
    negotiator.absorb(2, [], [("grad", allreduce_meta())], now=0.0)
    assert list(negotiator.stalled(now=59.0, after_seconds=60.0)) == []
    assert list(negotiator.stalled(now=61.0, after_seconds=60.0)) == [("grad", [1, 3], 61.0)]
    assert list(negotiator.stalled(now=62.0, after_seconds=60.0)) == []
    assert [name for name, _, _ in negotiator.stalled(now=125.0, after_seconds=60.0)] == ["grad"]


def test_a_wait_counts_from_this_ranks_submission_once_backdated():
    # a cached tensor enters the table only when a gathered cycle asks for it, a while
    # after this rank submitted it: its wait counts from the submission, never later
    negotiator = Negotiator(size=2, cache_capacity=8)
    negotiator.absorb(0, [], [("grad", allreduce_meta())], now=50.0)
    assert list(negotiator.stalled(now=55.0, after_seconds=10.0)) == []
    negotiator.backdate("grad", since=44.0)
    negotiator.backdate("grad", since=48.0)  # a later time never shortens the wait
    negotiator.backdate("absent", since=0.0)  # nothing in the table: nothing to date
    assert list(negotiator.stalled(now=55.0, after_seconds=10.0)) == [("grad", [1], 11.0)]
    assert negotiator.pending_names() == ["grad"]


@pytest.mark.parametrize("capacity", [0, 1, 64, 65, 1024])
def test_header_bits_roundtrip(capacity):
    header = np.zeros(header_words(capacity), dtype=np.int64)
    ids = sorted({0, 63, capacity - 1, capacity // 2} & set(range(capacity)))
    encode_header(header, cycle=7, notes_bytes=12, flags=2, cache_ids=ids)
    assert header[:3].tolist() == [7, 12, 2]
    assert decode_cache_ids(header) == ids


def _headers(size, capacity, ids_per_rank):
    headers = np.zeros((size, header_words(capacity)), dtype=np.int64)
    for rank, ids in enumerate(ids_per_rank):
        encode_header(headers[rank], cycle=1, notes_bytes=0, flags=0, cache_ids=ids)
    return headers


def _negotiate(negotiator, name, meta):
    for rank in range(negotiator.size):
        negotiator.absorb(rank, [], [(name, meta)], now=0.0)
    (response,) = negotiator.ready()
    assert response.error is None
    return response


def _agreed(capacity, ids_per_rank, gather_ranks=()):
    """The bitwise AND of every rank's vote, as MPI_BAND computes it."""
    votes = np.zeros((len(ids_per_rank), vote_words(capacity)), dtype=np.int64)
    for rank, ids in enumerate(ids_per_rank):
        encode_vote(votes[rank], rank in gather_ranks, ids)
    return np.bitwise_and.reduce(votes, axis=0)


def test_steady_state_vote_reads_the_ready_set_off_the_and_of_the_bits():
    negotiator = Negotiator(size=3, cache_capacity=70)
    for name in ("a", "b", "c"):
        _negotiate(negotiator, name, allreduce_meta())
    a, b, c = (negotiator.cache.lookup(name, allreduce_meta()) for name in ("a", "b", "c"))
    # rank 1 has not submitted c yet: only a and b are ready, in cache-id order
    agreed = _agreed(70, [[c, b, a], [b, a], [a, c, b]])
    assert not vote_needs_gather(agreed)
    responses = negotiator.cache.agreed_responses(agreed_bits(agreed))
    assert [response.name for response in responses] == ["a", "b"]
    assert negotiator.pending_names() == []  # nothing entered the table


def test_one_rank_asking_for_a_gathered_cycle_is_seen_by_every_rank():
    assert vote_needs_gather(_agreed(8, [[0], [0], [0]], gather_ranks=(2,)))
    assert not vote_needs_gather(_agreed(8, [[0], [], [0]]))


@pytest.mark.parametrize("capacity", [0, 1, 64, 65, 1024])
def test_vote_bits_roundtrip_and_do_not_grow_with_the_ranks(capacity):
    ids = sorted({0, 63, capacity - 1, capacity // 2} & set(range(capacity)))
    agreed = _agreed(capacity, [ids] * 5)
    assert agreed.size == 1 + (capacity + 63) // 64
    assert decode_cache_ids(np.concatenate([np.zeros(HEADER_FIELDS - 1, np.int64), agreed])) == ids


def test_gathered_rows_put_cached_announcements_in_the_table_by_name():
    negotiator = Negotiator(size=2, cache_capacity=8)
    _negotiate(negotiator, "a", allreduce_meta())
    negotiator.absorb_cycle(_headers(2, 8, [[0], []]), None, now=1.0)
    assert negotiator.pending_names() == ["a"]
    assert negotiator.ready() == []  # rank 1 has not announced it yet
    assert negotiator.holds("a") and not negotiator.holds("b")
    # rank 1 now announces "a" by name (it is held): the entry completes
    negotiator.absorb(1, [], [("a", allreduce_meta())], now=2.0)
    (response,) = negotiator.ready()
    assert response.name == "a" and response.error is None


def test_a_joined_rank_makes_every_name_go_by_name():
    negotiator = Negotiator(size=2, cache_capacity=8)
    _negotiate(negotiator, "a", allreduce_meta())
    negotiator.absorb(1, [], [(JOIN_NAME, Meta(kind="join"))], now=1.0)
    negotiator.ready()
    assert negotiator.holds("a")


def test_agreed_votes_follow_a_name_whose_metadata_changed():
    negotiator = Negotiator(size=2, cache_capacity=8)
    _negotiate(negotiator, "a", allreduce_meta(shape=(5,)))
    bits = agreed_bits(_agreed(8, [[0], [0]]))
    (before,) = negotiator.cache.agreed_responses(bits)
    assert before.meta.shape == (5,)
    _negotiate(negotiator, "a", allreduce_meta(shape=(7,)))  # same name, new shape, same id
    assert negotiator.cache.lookup("a", allreduce_meta(shape=(7,))) == 0
    (after,) = negotiator.cache.agreed_responses(bits)
    assert after.meta.shape == (7,)


def test_a_deadlock_fails_every_pending_tensor_but_join_naming_each_ranks_wait():
    negotiator = Negotiator(size=3, cache_capacity=8)
    negotiator.absorb(0, [], [(JOIN_NAME, Meta(kind="join"))], now=0.0)
    negotiator.absorb(1, [], [("a", allreduce_meta())], now=0.0)
    negotiator.absorb(2, [], [("b", allreduce_meta()), ("c", allreduce_meta())], now=0.0)
    assert negotiator.ready() == []
    responses = negotiator.deadlocked()
    assert [response.name for response in responses] == ["a", "b", "c"]
    assert all(response.deadlock for response in responses)
    message = responses[0].error
    assert "rank 0 waits on join()" in message
    assert "rank 1 waits on allreduce 'a'" in message
    assert "rank 2 waits on allreduce 'b', allreduce 'c'" in message
    assert "'a' by rank(s) [1]; 'b' by rank(s) [2]" in message
    assert negotiator.pending_names() == [JOIN_NAME]  # join waits on: the others may join
    assert negotiator.deadlocked() == []  # nothing left to fail


def test_the_waiting_field_travels_in_the_header():
    from hororing.engine.negotiation import WAITING
    header = np.zeros(header_words(8), dtype=np.int64)
    encode_header(header, 7, 0, 0, [3], waiting=True)
    assert header[WAITING] == 1 and decode_cache_ids(header) == [3]
    encode_header(header, 7, 0, 0, [3])
    assert header[WAITING] == 0


def negotiate(negotiator, names):
    """Every rank announces ``names`` by name (a gathered cycle); the responses' names."""
    for rank in range(negotiator.size):
        negotiator.absorb(rank, [], [(name, allreduce_meta()) for name in names], now=0.0)
    return [response.name for response in negotiator.ready()]


def test_a_full_cache_makes_room_for_new_names_oldest_first():
    negotiator = Negotiator(size=2, cache_capacity=3)
    cache = negotiator.cache
    assert negotiate(negotiator, ["a", "b", "c"]) == ["a", "b", "c"]
    assert [cache.lookup(name, allreduce_meta()) for name in "abc"] == [0, 1, 2]
    negotiate(negotiator, ["d"])  # takes the oldest entry's id
    assert cache.lookup("a", allreduce_meta()) is None
    assert cache.lookup("d", allreduce_meta()) == 0 and cache.resolve(0)[0] == "d"
    assert cache.responses[0].name == "d"
    negotiate(negotiator, ["e", "a"])  # then the next oldest, round the ids
    assert [cache.id_of(name) for name in "abcde"] == [2, None, None, 0, 1]
    # a vote decoded before the change is not reused after it
    bits = np.zeros(1, dtype=np.uint64)
    bits[0] = 1  # id 0
    assert [response.name for response in cache.agreed_responses(bits.tobytes())] == ["d"]
    negotiate(negotiator, ["f"])
    assert [response.name for response in cache.agreed_responses(bits.tobytes())] == ["f"]


def test_a_cache_of_capacity_zero_keeps_nothing():
    negotiator = Negotiator(size=2, cache_capacity=0)
    assert negotiate(negotiator, ["a"]) == ["a"]
    assert negotiator.cache.id_of("a") is None
