"""Negotiation across ranks: the steady state is one vote per cycle, and a name whose
metadata changes, or that one rank announces by bit and another by name, is still checked."""

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from hororing.context import current
from reference import all_inputs, assert_close, rank_input, reference_allreduce

SINGLE = pytest.mark.skipif("hvd.size() < 2", reason="a mismatch needs two ranks")


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
    # the vote is fixed-size: one bit per cache entry and one field, whatever the ranks
    vote_bytes = 8 * (1 + (current().config.cache_capacity + 63) // 64)
    if gathered == 0:
        assert after["received_bytes"] - before["received_bytes"] == cycles * vote_bytes


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
