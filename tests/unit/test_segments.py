"""How a bucket is laid out in segments, and how the ring cuts its pieces at their ends."""

import numpy as np
import pytest

from hororing.algorithms import cost
from hororing.algorithms.ring import _cut
from hororing.algorithms.segmented import Segmented
from hororing.engine.segments import Segment, plan


def test_large_members_are_segments_of_their_own_and_small_runs_one_each():
    # float32: members of 1000 bytes or more are large
    assert plan([10, 300, 2, 3, 250, 400, 1], 4, 1000) == [
        Segment(0, 10, 0, 1, False), Segment(10, 310, 1, 2, True),
        Segment(310, 315, 2, 4, False), Segment(315, 565, 4, 5, True),
        Segment(565, 965, 5, 6, True), Segment(965, 966, 6, 7, False)]


def test_no_segments_without_a_large_member_a_second_member_or_the_setting():
    assert plan([10, 20, 30], 4, 1000) is None
    assert plan([5000], 4, 1000) is None  # one member is reduced where it lies anyway
    assert plan([10, 5000], 4, 0) is None


def test_a_run_of_empty_members_is_no_segment():
    assert plan([0, 300, 0, 0], 4, 1000) == [Segment(0, 300, 1, 2, True)]


def test_a_segmented_buffer_slices_within_one_array_and_refuses_to_cross():
    parts = [np.arange(3.0), np.arange(10.0, 15.0), np.arange(20.0, 22.0)]
    buffer = Segmented(parts)
    assert (buffer.size, buffer.nbytes, buffer.cuts) == (10, 80, (3, 8))
    np.testing.assert_array_equal(buffer[4:8], [11, 12, 13, 14])
    assert np.shares_memory(buffer[3:5], parts[1])
    np.testing.assert_array_equal(buffer[8:10], [20, 21])
    with pytest.raises(IndexError, match=r"elements \[2, 4\) cross the end of a segment at 3"):
        buffer[2:4]
    assert buffer.map(lambda part: part.view(np.uint64)).dtype == np.uint64


def test_the_rings_pieces_are_cut_where_segments_meet():
    assert _cut([(0, 5), (5, 10), (10, 12)], (3, 5, 11)) == [
        (0, 3), (3, 5), (5, 10), (10, 11), (11, 12)]
    assert _cut([(0, 5)], ()) == [(0, 5)]


def test_members_reduced_in_place_from_the_size_their_copies_cost_what_the_cuts_do():
    shm, ethernet = cost.PRESETS["shm"], cost.PRESETS["10gbe"]
    assert cost.in_place_member_bytes(1, cost.HOST, shm) == 0
    two = cost.in_place_member_bytes(2, cost.HOST, shm)
    assert two == int(2 * shm.latency_s * cost.HOST.copy_Bps)
    assert cost.in_place_member_bytes(16, cost.HOST, shm) == pytest.approx(15 * two, abs=16)
    assert cost.in_place_member_bytes(2, cost.HOST, ethernet) > two  # a longer latency


@pytest.mark.parametrize("ranks, across_nodes, splits", [
    (2, False, False), (4, False, False), (8, False, True), (16, False, True),
    (16, True, False)])
def test_the_cost_model_splits_a_large_bucket_on_one_node_of_many_ranks(ranks, across_nodes,
                                                                       splits):
    """Eight 4 MiB members: one ring over 32 MiB at 8 and 16 ranks of one node has more bytes
    in flight than the caches hold, and a ring per member is priced over 10% cheaper
    (measured on 16 cores: 20.0 against 27.0 ms at 8 ranks, 27.8 against 34.3 at 16); at
    2 and 4 ranks, and between nodes, one ring stays."""
    from unittest import mock

    from hororing.config import Config
    from hororing.engine.allreduce import AllreducePipeline, Route

    comm = mock.Mock()
    comm.Get_size.return_value = ranks
    pipeline = AllreducePipeline(comm, Config(), {"ring": None}, span=None,
                                 route=Route.configured(Config(), ranks, across_nodes),
                                 across_nodes=across_nodes)
    assert pipeline._split_pays((1 << 20,) * 8, 4, pipeline.route) is splits
