"""The cost model of hororing's allreduce algorithms and the choice table the engine uses."""

import math

import pytest

from hororing.algorithms import cost

HOST = cost.Host(step_s=5e-6, piece_s=50e-6, call_s=0.0, reduce_Bps=3e9, copy_Bps=10e9)
NET = cost.PRESETS["10gbe"]


@pytest.mark.parametrize("ranks", [2, 4, 8, 64, 1024])
def test_power_of_two_shapes_have_the_textbook_counts(ranks):
    nbytes = 1 << 24
    ring = cost.shape("ring", ranks, nbytes)
    halving = cost.shape("rabenseifner", ranks, nbytes)
    doubling = cost.shape("recursive_doubling", ranks, nbytes)
    log = int(math.log2(ranks))
    assert ring.steps == 2 * (ranks - 1) and halving.steps == 2 * log and doubling.steps == log
    assert halving.far_bytes == pytest.approx(ring.far_bytes)
    assert halving.far_bytes == pytest.approx(2 * (ranks - 1) / ranks * nbytes)
    assert doubling.far_bytes == pytest.approx(log * nbytes)
    assert cost.shape("small", ranks, nbytes).far_bytes == pytest.approx((ranks - 1) * nbytes)


def test_a_folded_count_pays_two_whole_buffers_more():
    folded = cost.shape("rabenseifner", 11, 1 << 20)  # 11: the largest power of two, 8
    assert folded.steps == 2 * 3 + 2
    assert folded.near_bytes == pytest.approx(2 * (1 << 20))
    exact = cost.shape("rabenseifner", 12, 1 << 20)  # 12 = 2 x 2 x 3: no fold
    assert exact.steps == 2 * (1 + 1 + 2) and exact.near_bytes == 0


def test_many_ranks_take_the_log_step_algorithms_and_few_keep_the_ring():
    many = cost.choices(1024, HOST, NET, small_bytes=1024)
    assert cost.lookup(many, 4096) == "recursive_doubling"
    assert cost.lookup(many, 16 << 20) == "rabenseifner"
    two = cost.choices(2, HOST, NET, small_bytes=1 << 19)
    # at 2 ranks both are one exchange of halves each way: the same bytes, two steps
    assert cost.lookup(two, 64 << 20) in ("ring", "rabenseifner")
    assert cost.shape("ring", 2, 1 << 26).far_bytes == cost.shape("rabenseifner", 2,
                                                                  1 << 26).far_bytes
    # the gathered path never runs from the threshold up, whatever the model says
    assert all(kind != "small" for below, kind in cost.choices(2, HOST, NET, small_bytes=1)
               if below is None or below > 1)


def test_the_table_gives_choose_s_answer_at_every_power_of_two():
    table = cost.choices(48, HOST, NET, small_bytes=(1 << 20) // 48)
    for shift in range(4, 30):
        assert cost.lookup(table, 1 << shift) == cost.choose(
            48, 1 << shift, HOST, NET, small_bytes=(1 << 20) // 48)


def test_the_bounds():
    assert cost.bandwidth_bound(4, 1000, NET) == pytest.approx(1500 / NET.bandwidth_Bps)
    assert cost.bandwidth_bound(16, 1600, NET, per_node=4) == pytest.approx(
        2400 / NET.bandwidth_Bps)
    assert cost.latency_bound(1000, NET) == 10 * NET.latency_s
    with pytest.raises(ValueError, match="unknown allreduce 'tree'"):
        cost.shape("tree", 4, 10)


def test_the_engine_s_constants_are_the_published_fit():
    """cost.HOST and the shared-memory link are docs/results/scale_fit.json's (2%)."""
    import json
    import pathlib

    fit = json.loads((pathlib.Path(__file__).resolve().parents[2] / "docs" / "results"
                      / "scale_fit.json").read_text())
    measured, factors = fit["measured"], fit["factors"]
    expected = {"step_s": factors["step"] * measured["step_s"],
                "pair_step_s": factors["step"] * measured["pair_step_s"],
                "piece_s": factors["piece"] * measured["step_s"],
                "reduce_Bps": factors["reduce"] * measured["reduce_Bps"],
                "copy_Bps": measured["copy_Bps"]}
    for name, value in expected.items():
        assert getattr(cost.HOST, name) == pytest.approx(value, rel=0.02), name
    shm = cost.PRESETS["shm"]
    assert shm.bandwidth_Bps == pytest.approx(fit["links"]["shm"]["bandwidth_Bps"], rel=0.02)
    assert shm.latency_s == pytest.approx(factors["mpi_step"] * measured["mpi_step_s"],
                                          rel=0.02)


def test_a_node_s_memory_slows_messages_its_caches_cannot_hold():
    """Within a node, messages in flight beyond the caches pay the node's memory bandwidth,
    which its ranks share; a network link has no such term."""
    shm = cost.PRESETS["shm"]
    assert cost.PRESETS["10gbe"].memory_s([(64 << 20, 64 << 20)], 16) == 0.0
    small = shm.memory_s([(64 << 10, 1 << 20)], 16)   # 1 MiB in flight across the node
    large = shm.memory_s([(8 << 20, 1 << 20)], 16)    # 128 MiB in flight
    assert 0.0 <= small < 0.01 * large
    # the same bytes cost each rank more when more ranks share the memory
    assert shm.memory_s([(8 << 20, 1 << 20)], 8) < large
    # the full share at most: bytes x ranks / memory bandwidth
    assert large <= (1 << 20) * 16 / shm.memory_Bps


def test_on_one_node_of_16_ranks_16_mib_goes_by_the_ring_and_256_kib_by_halving():
    """Measured on a 16-core host (docs/scale.md): at 16 ranks, 16 MiB took the ring 11-14 ms
    and Rabenseifner's 19-33 (its first phase holds 16 x 8 MiB in flight); 256 KiB took
    them 0.7-0.85 ms and 0.37-0.47."""
    shm = cost.PRESETS["shm"]
    ring, halving = (cost.predict(kind, 16, 16 << 20, cost.HOST, shm, shm, per_node=16)
                     for kind in ("ring", "rabenseifner"))
    assert ring < halving
    assert cost.choose(16, 16 << 20, cost.HOST, shm, shm, per_node=16) == "ring"
    assert cost.choose(16, 256 << 10, cost.HOST, shm, shm, per_node=16,
                       small_bytes=16 << 10) == "rabenseifner"


def test_the_shared_memory_allreduce_takes_the_message_algorithms_sizes_below_its_largest():
    largest = cost.SHARED_LARGEST_BYTES
    beyond = largest + (1 << 20)  # a message algorithm's range that straddles the largest
    table = ((4096, "small"), (1 << 16, "recursive_doubling"), (beyond, "rabenseifner"),
             (None, "ring"))
    shared = cost.with_shared(table)
    assert shared == ((4096, "small"), (largest, "shared"), (beyond, "rabenseifner"),
                      (None, "ring"))
    for nbytes in (1, 4095, 4096, 1 << 16, largest - 1, largest, beyond, 1 << 30):
        expected = cost.lookup(table, nbytes)
        if expected != "small" and nbytes < largest:
            expected = "shared"
        assert cost.lookup(shared, nbytes) == expected, nbytes
    # the gathered path keeps its sizes, and nothing changes beyond the largest
    assert cost.with_shared(((8 << 20, "small"), (None, "ring"))) == ((8 << 20, "small"),
                                                                       (None, "ring"))
    assert cost.with_shared(((None, "ring"),)) == ((largest, "shared"), (None, "ring"))


def test_where_ranks_crowd_the_cores_of_a_large_cache_the_shared_allreduce_takes_every_size():
    crowded = cost.SHARED_CROWDED_SEGMENT_BYTES
    plain = cost.SHARED_SEGMENT_BYTES
    room = 19 * crowded  # 16 ranks' rows, the result row and the two rows around the node
    cache = cost.SHARED_CROWDED_CACHE_BYTES
    # 4 ranks a core or more, with the room and the cache: the large segments
    assert cost.shared_segment_bytes(8, 4.0, room, cache) == crowded
    assert cost.shared_segment_bytes(16, 8.0, room, 105 << 20) == crowded
    assert cost.shared_segment_bytes(8, 4.0, room, 32 << 20) == crowded
    # fewer to a core (a segment's rows stay in the caches), no room, or a smaller or
    # unknown cache: 1 MiB
    assert cost.shared_segment_bytes(8, 3.9, room, cache) == plain
    assert cost.shared_segment_bytes(2, 1.0, room, cache) == plain
    assert cost.shared_segment_bytes(16, 8.0, room - 1, cache) == plain
    assert cost.shared_segment_bytes(16, 8.0, 0, cache) == plain
    assert cost.shared_segment_bytes(8, 4.0, room, cache - 1) == plain
    assert cost.shared_segment_bytes(8, 4.0, room, 16 << 20) == plain
    assert cost.shared_segment_bytes(8, 4.0, room, None) == plain
    assert cost.shared_largest(plain) == cost.SHARED_LARGEST_BYTES
    assert cost.shared_largest(crowded) is None
    table = ((4096, "small"), (3 << 20, "rabenseifner"), (None, "ring"))
    everywhere = cost.with_shared(table, None)
    assert everywhere == ((4096, "small"), (None, "shared"))
    for nbytes in (1, 4095):
        assert cost.lookup(everywhere, nbytes) == "small"
    for nbytes in (4096, 3 << 20, 1 << 40):
        assert cost.lookup(everywhere, nbytes) == "shared"
    assert cost.with_shared(((8 << 20, "small"), (None, "ring")), None) == (
        (8 << 20, "small"), (None, "shared"))
