"""The ring's schedule, checked for its structure in one process."""

import pytest

from hororing.algorithms.plan import chunk_bounds, ring_pieces, ring_schedule


@pytest.mark.parametrize("count,parts", [(0, 1), (0, 3), (2, 3), (10, 3), (12, 4), (7, 16), (100, 7)])
def test_chunk_bounds_cover_contiguously_and_balance(count, parts):
    bounds = chunk_bounds(count, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    for (_, stop), (start, _) in zip(bounds, bounds[1:]):
        assert stop == start
    lengths = [stop - start for start, stop in bounds]
    assert max(lengths) - min(lengths) <= 1
    # the first count % parts chunks are the longer ones
    assert lengths == sorted(lengths, reverse=True)


def test_chunk_bounds_rejects_zero_parts():
    with pytest.raises(ValueError, match="parts must be > 0, got 0"):
        chunk_bounds(5, 0)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8, 16])
def test_each_phase_has_size_minus_one_steps(size):
    for rank in range(size):
        schedule = ring_schedule(size, rank)
        assert len(schedule.scatter_reduce) == size - 1
        assert len(schedule.allgather) == size - 1
        assert ring_schedule(size, rank, allgather=False).allgather == ()


@pytest.mark.parametrize("size", [2, 3, 4, 7, 16])
def test_peers_form_one_cycle(size):
    rights = {rank: ring_schedule(size, rank).right for rank in range(size)}
    seen, rank = [], 0
    for _ in range(size):
        seen.append(rank)
        rank = rights[rank]
    assert rank == 0 and sorted(seen) == list(range(size))
    for rank in range(size):
        assert ring_schedule(size, ring_schedule(size, rank).right).left == rank


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6, 16])
def test_simulated_ring_reduces_every_chunk_over_every_rank(size):
    """Play the schedule with sets of contributing ranks instead of numbers."""
    holdings = [[{rank} for _ in range(size)] for rank in range(size)]
    schedules = [ring_schedule(size, rank) for rank in range(size)]
    for step in range(2 * (size - 1)):
        messages = {}
        for rank, schedule in enumerate(schedules):
            ring_step = schedule.steps[step]
            messages[schedule.right] = (ring_step.send_chunk, set(holdings[rank][ring_step.send_chunk]))
        for rank, schedule in enumerate(schedules):
            ring_step = schedule.steps[step]
            chunk, contributors = messages[rank]
            assert chunk == ring_step.recv_chunk, "sender and receiver disagree on the chunk"
            if ring_step.reduce:
                assert not contributors & holdings[rank][chunk], "a contribution counted twice"
                holdings[rank][chunk] |= contributors
            else:
                holdings[rank][chunk] = contributors
        if step == size - 2 or size == 1:
            for rank in range(size):  # after scatter-reduce, rank owns chunk `rank`
                assert holdings[rank][rank] == set(range(size))
    everyone = set(range(size))
    assert all(chunk == everyone for rank_chunks in holdings for chunk in rank_chunks)


def test_schedule_rejects_rank_outside_size():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\), got 4"):
        ring_schedule(4, 4)


@pytest.mark.parametrize("chunk,expected", [
    (0, 1), (100, 1), (256 * 1024, 1), (512 * 1024, 2), (1 << 20, 4), (3 << 20, 4),
    (4 << 20, 4), (16 << 20, 16), (16 << 20 | 1, 17)])
def test_ring_pieces_grow_to_the_ceiling_while_a_chunk_keeps_four(chunk, expected):
    assert ring_pieces(chunk, 256 * 1024, ceiling=1 << 20) == expected


@pytest.mark.parametrize("chunk,expected", [(0, 1), (1, 1), (1 << 20, 4), (16 << 20, 64)])
def test_ring_pieces_without_a_ceiling_are_sub_chunks(chunk, expected):
    assert ring_pieces(chunk, 256 * 1024) == expected
    assert ring_pieces(chunk, 256 * 1024, ceiling=256 * 1024) == expected  # not above it


def test_ring_pieces_lie_between_the_sub_chunk_rule_and_four_pieces_of_at_most_the_ceiling():
    sub, ceiling = 256 * 1024, 1 << 20
    for chunk in range(0, 40 << 20, 333_333):
        pieces = ring_pieces(chunk, sub, ceiling)
        by_sub_chunks = max(1, -(-chunk // sub))
        assert min(4, by_sub_chunks) <= pieces <= by_sub_chunks
        assert -(-chunk // pieces) <= ceiling
