"""Negotiation across ranks: the steady state is one vote per cycle, and a name whose
metadata changes, or that one rank announces by bit and another by name, is still checked."""

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from hororing.context import current
from reference import (all_inputs, assert_close, assert_identical_on_every_rank, rank_input,
                       reference_allreduce)

# decided at collection, before the session fixture has called hvd.init()
SINGLE = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="a mismatch needs two ranks")


def _stats():
    return current().engine.stats()


def test_repeated_names_negotiate_by_vote_alone():
    names = [f"steady.{index}" for index in range(3)]
    lengths = [1, 7, 1001]  # 7 and 1001 do not divide by 2, 3 or 4 ranks
    for name, length in zip(names, lengths):  # first round: by name
        hvd.allreduce(np.zeros(length), name=name, op=hvd.Sum)
    before = _stats()
    rounds = 20
    for round_index in range(rounds):
        handles = [hvd.allreduce_async(rank_input(hvd.rank(), (length,), "float64", round_index),
                                       name=name, op=hvd.Sum)
                   for name, length in zip(names, lengths)]
        for handle, length in zip(handles, lengths):
            expected = reference_allreduce(
                all_inputs(hvd.size(), (length,), "float64", round_index), hvd.Sum)
            assert_close(hvd.synchronize(handle), expected)
    after = _stats()
    cycles = after["cycles"] - before["cycles"]
    gathered = after["gather_cycles"] - before["gather_cycles"]
    # a gathered cycle in this loop can only come from a rank that waited a second
    asked = MPI.COMM_WORLD.allreduce(after["stall_gathers"] - before["stall_gathers"])
    assert cycles >= rounds
    assert gathered <= asked, (cycles, gathered, asked)
    # the vote is fixed-size: one bit per cache entry and one field, whatever the ranks; a
    # cycle that began with the fold's exchange (after lone cycles, fold.py) and completed
    # in it ran no vote, and the rows it exchanged are counted apart
    vote_bytes = 8 * (1 + (current().config.cache_capacity + 63) // 64)
    votes = cycles - (after["inline_hits"] - before["inline_hits"])
    folded = after["fold_bytes"] - before["fold_bytes"]
    assert (folded > 0) == (after["inline_cycles"] > before["inline_cycles"])
    if gathered == 0:
        assert after["received_bytes"] - before["received_bytes"] == \
            votes * vote_bytes + folded


def test_a_name_with_new_metadata_is_negotiated_again():
    for length in (5, 9, 5):
        result = hvd.allreduce(np.full(length, hvd.rank() + 1.0), name="reshaped", op=hvd.Sum)
        assert result.shape == (length,)
        assert_close(result, np.full(length, hvd.size() * (hvd.size() + 1) / 2.0))


@SINGLE
def test_a_cached_announcement_meets_a_changed_one_and_both_fail():
    hvd.allreduce(np.ones(5), name="half.cached")
    # rank 0 repeats the negotiated metadata (its cache bit), the others change the shape
    length = 5 if hvd.rank() == 0 else 6
    with pytest.raises(hvd.HorovodInternalError,
                       match=r"Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of "
                             r"shape \[5\], but another rank sent a tensor of shape \[6\]"):
        hvd.allreduce(np.ones(length), name="half.cached")
    # and the name works again afterwards on every rank
    assert_close(hvd.allreduce(np.ones(5), name="half.cached", op=hvd.Sum),
                 np.full(5, float(hvd.size())))


@SINGLE
def test_a_late_rank_with_a_cached_name_joins_the_waiting_ones():
    hvd.allreduce(np.ones(3), name="late.cached")
    handle = None
    if hvd.rank() != 0:  # the others announce it by bit, cycles pass without rank 0
        handle = hvd.allreduce_async(np.ones(3), name="late.cached", op=hvd.Sum)
    hvd.barrier()  # nobody can pass this until rank 0 arrives, after the others announced
    if hvd.rank() == 0:
        handle = hvd.allreduce_async(np.ones(3), name="late.cached", op=hvd.Sum)
    assert_close(hvd.synchronize(handle), np.full(3, float(hvd.size())))


OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]


@pytest.fixture(scope="module")
def fresh_cache():
    """Only a cached name folds, and a long session fills the response cache with the names
    of earlier tests: the fold tests start from an empty one."""
    hvd.shutdown()
    hvd.init()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32"])
@pytest.mark.parametrize("op", OPS, ids=lambda op: hvd.ops.op_name(op))
def test_a_loop_of_small_blocking_allreduces_moves_data_with_negotiation(dtype, op,
                                                                         fresh_cache):
    """From the third call on, a repeated lone small allreduce travels inside the
    negotiation exchange: still correct, and bitwise what the latency path gives."""
    length = 1001  # not divisible by 2, 3 or 4
    prescale, postscale = (1.0, 1.0) if dtype == "int32" else (0.5, 3.0)
    before = _stats()
    results = []
    calls = 8
    for seed in range(calls):  # nothing between the calls: the checks come after
        mine = rank_input(hvd.rank(), (length,), dtype, seed, op)
        results.append(hvd.allreduce(mine, name=f"folded.{dtype}", op=op,
                                     prescale_factor=prescale, postscale_factor=postscale))
    hits = _stats()["inline_hits"] - before["inline_hits"]
    for seed, result in enumerate(results):
        expected = reference_allreduce(all_inputs(hvd.size(), (length,), dtype, seed, op), op,
                                       prescale, postscale)
        assert_close(result, expected)
        assert_identical_on_every_rank(result)
    # from the third call on, each folds: a fold cycle that a peer's engine takes part in
    # before that peer's caller has submitted misses, and so does the vote after it (the peer
    # has nothing to vote for), so the call is still waiting when the peer's own cycle
    # folds it. Only a gathered cycle asked for by a rank whose call waited a second (a
    # stall check, on a crowded machine) completes a call without folding it
    asked = MPI.COMM_WORLD.allreduce(_stats()["stall_gathers"] - before["stall_gathers"])
    assert hits >= calls - 2 - asked, (hits, asked)
    # the last input again, fused with another tensor: the latency path's own Allgather
    mine = rank_input(hvd.rank(), (length,), dtype, calls - 1, op)
    handles = [hvd.allreduce_async(mine, name=f"unfolded.{dtype}", op=op,
                                   prescale_factor=prescale, postscale_factor=postscale),
               hvd.allreduce_async(mine.copy(), name=f"unfolded.{dtype}.2", op=op,
                                   prescale_factor=prescale, postscale_factor=postscale)]
    unfolded = [hvd.synchronize(handle) for handle in handles]
    assert unfolded[0].tobytes() == results[-1].tobytes()


def test_a_predicted_fold_that_does_not_come_falls_back_in_the_same_cycle():
    values = np.arange(10, dtype=np.float64) + hvd.rank()
    expected = np.arange(10, dtype=np.float64) * hvd.size() + sum(range(hvd.size()))
    for _ in range(3):  # the fold is predicted for the next 80-byte lone allreduce
        assert_close(hvd.allreduce(values, name="fold.a", op=hvd.Sum), expected)
    # the next cycle brings a new name of the same size, then two tensors, then a barrier
    assert_close(hvd.allreduce(values, name="fold.b", op=hvd.Sum), expected)
    handles = [hvd.allreduce_async(values, name=name, op=hvd.Sum) for name in ("fold.a", "fold.b")]
    for handle in handles:
        assert_close(hvd.synchronize(handle), expected)
    hvd.barrier()
    assert_close(hvd.allreduce(values, name="fold.a", op=hvd.Sum), expected)


def test_a_forced_algorithm_ends_the_fold_of_a_repeated_small_allreduce():
    """Once a lone small allreduce folds, forcing an algorithm (pipeline.force) routes the
    next calls of it there: the fold's cached plan follows what routes small sizes."""
    if hvd.size() == 1:
        pytest.skip("one rank reduces nothing")
    hvd.shutdown()  # a fresh response cache: only a cached name folds, and a long run fills it
    hvd.init()
    pipeline = current().engine.allreduce
    values = np.arange(11, dtype=np.float32) + hvd.rank()
    expected = np.arange(11, dtype=np.float32) * hvd.size() + sum(range(hvd.size()))
    before = _stats()["inline_hits"]
    for _ in range(6):
        assert_close(hvd.allreduce(values, name="fold.forced", op=hvd.Sum), expected)
    assert _stats()["inline_hits"] > before  # it folded
    pipeline.force("ring")
    try:
        for _ in range(3):
            with pipeline.watch() as seen:
                result = hvd.allreduce(values, name="fold.forced", op=hvd.Sum)
            assert_close(result, expected)
            assert seen == [("ring", "float32", 11)], seen
    finally:
        pipeline.force(None)
