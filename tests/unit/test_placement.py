"""Parameter-server placement: every element on exactly one server, loads as each strategy says."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hororing.algorithms.ps.placement import Placement, bucket_plan


def covered(pieces, count):
    elements = sorted((start, stop) for _, start, stop in pieces)
    assert elements[0][0] == 0 and elements[-1][1] == count
    for (_, stop), (start, _) in zip(elements, elements[1:]):
        assert stop == start


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 5000), min_size=1, max_size=30),
       servers=st.integers(1, 6), strategy=st.sampled_from(["round_robin", "greedy_bytes",
                                                            "partitioned"]))
def test_every_tensor_is_covered_once(counts, servers, strategy):
    placement = Placement(servers, strategy, partition_bytes=4000)
    for index, count in enumerate(counts):
        pieces = placement.pieces(f"t{index}", count, 4)
        covered(pieces, count)
        assert all(0 <= server < servers for server, _, _ in pieces)
    assert sum(placement.held_bytes) == 4 * sum(counts)


def test_round_robin_follows_tensor_order():
    placement = Placement(3, "round_robin")
    servers = [placement.pieces(f"t{index}", 10, 4)[0][0] for index in range(7)]
    assert servers == [0, 1, 2, 0, 1, 2, 0]
    assert placement.pieces("t1", 10, 4)[0][0] == 1  # remembered, not placed again


def test_greedy_bytes_takes_the_least_loaded_server():
    placement = Placement(2, "greedy_bytes")
    assert [placement.pieces(name, count, 1)[0][0]
            for name, count in (("a", 100), ("b", 10), ("c", 10), ("d", 200))] == [0, 1, 1, 1]
    assert placement.held_bytes == [100, 220]


def test_partitioned_splits_large_tensors_over_every_server():
    placement = Placement(3, "partitioned", partition_bytes=64)
    assert placement.pieces("big", 100, 4) == [(0, 0, 34), (1, 34, 67), (2, 67, 100)]
    assert len(placement.pieces("small", 10, 4)) == 1


def test_bucket_plan_groups_and_merges_ranges_per_server():
    placement = Placement(2, "round_robin")
    plan = bucket_plan(placement, [("a", 0, 5), ("b", 5, 8), ("c", 8, 9)], 4)
    assert plan == {0: [(0, 5), (8, 9)], 1: [(5, 8)]}


@pytest.mark.parametrize("arguments,message", [
    ((0, "round_robin"), "at least one server"), ((2, "random"), "PS placement must be one of"),
])
def test_bad_placements_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        Placement(*arguments)
