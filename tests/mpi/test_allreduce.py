"""Allreduce on every dtype and op, any length, against numpy on the regenerated inputs."""

import os

import numpy as np
import pytest

import hororing as hvd
from reference import (ALL_DTYPES, all_inputs, assert_close, assert_identical_on_every_rank,
                       rank_input, reference_allreduce)

OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]


def lengths():
    size = hvd.size() if hvd.is_initialized() else 4
    # empty, one, shorter than the ring, not divisible, the small path, several ring pieces
    return [0, 1, max(size - 1, 1), 7, 1000, 150_001]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("op", OPS, ids=lambda op: hvd.ops.op_name(op))
@pytest.mark.parametrize("length_index", range(6))
def test_allreduce_matches_numpy(dtype, op, length_index):
    length = lengths()[length_index]
    seed = 1000 * length_index + op
    mine = rank_input(hvd.rank(), (length,), dtype, seed, op)
    result = hvd.allreduce(mine, op=op, name=f"ar.{dtype}.{op}.{length}")
    expected = reference_allreduce(all_inputs(hvd.size(), (length,), dtype, seed, op), op)
    assert_close(result, expected)
    assert_identical_on_every_rank(result)


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_multidimensional_and_scaled(dtype):
    shape = (3, 5, 2)
    mine = rank_input(hvd.rank(), shape, dtype, seed=7)
    result = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    expected = reference_allreduce(all_inputs(hvd.size(), shape, dtype, 7), hvd.Sum, 0.5, 3.0)
    assert_close(result, expected)


def test_large_buffer_through_the_pipelined_ring_is_deterministic():
    count = 1_500_007  # ~6 MB of float32: many sub-chunks, not divisible by any size here
    mine = rank_input(hvd.rank(), (count,), "float32", seed=11)
    first = hvd.allreduce(mine, name="big")
    second = hvd.allreduce(mine, name="big")
    assert first.tobytes() == second.tobytes(), "same inputs gave different bits run to run"
    expected = reference_allreduce(all_inputs(hvd.size(), (count,), "float32", 11), hvd.Average)
    assert_close(first, expected)
    assert_identical_on_every_rank(first)


def test_in_place_writes_into_the_argument_and_returns_it():
    tensor = np.full(10, float(hvd.rank()))
    returned = hvd.allreduce_(tensor, op=hvd.Sum)
    assert returned is tensor
    np.testing.assert_array_equal(tensor, np.full(10, sum(range(hvd.size())), dtype=float))


def test_non_contiguous_inputs_are_copied_and_written_back():
    base = np.arange(40, dtype=np.float64).reshape(5, 8) + hvd.rank()
    view = base[:, ::2]
    result = hvd.allreduce(view, op=hvd.Sum)
    expected = sum(np.arange(40, dtype=np.float64).reshape(5, 8)[:, ::2] + rank
                   for rank in range(hvd.size()))
    np.testing.assert_array_equal(result, expected)
    hvd.allreduce_(view, op=hvd.Sum)
    np.testing.assert_array_equal(base[:, ::2], expected)
    np.testing.assert_array_equal(base[:, 1::2], np.arange(40.0).reshape(5, 8)[:, 1::2] + hvd.rank())


def test_float16_accumulates_in_float32():
    # 2048 + 1 + ... in fp16 steps would round every 1 away; fp32 accumulation keeps them
    mine = np.array([2048.0 if hvd.rank() == 0 else 1.0], dtype=np.float16)
    result = hvd.allreduce(mine, op=hvd.Sum)
    expected = np.float16(np.float32(2048.0) + (hvd.size() - 1))
    assert result.dtype == np.float16 and result[0] == expected


@pytest.mark.parametrize("count", [5, 300_001])  # the latency path, and the ring
def test_compressed_float16_moves_as_float16_and_plain_float16_as_float32(reduced_buffers, count):
    from hororing.collectives import compressed_allreduce_async_
    values = (np.arange(count) % 5 + hvd.rank()).astype(np.float16)  # small integers: exact
    expected = (np.arange(count) % 5 * hvd.size() + hvd.size() * (hvd.size() - 1) / 2)
    compressed = values.copy()
    hvd.synchronize(compressed_allreduce_async_(compressed, hvd.Compression.fp16, name="wire.fp16",
                                                op=hvd.Sum))
    plain = hvd.allreduce(values, name="wire.plain", op=hvd.Sum)
    np.testing.assert_array_equal(compressed, expected.astype(np.float16))
    np.testing.assert_array_equal(plain, expected.astype(np.float16))
    if hvd.size() > 1:
        assert [dtype for _, dtype, _ in reduced_buffers] == ["float16", "float32"]


def test_compressed_average_divides_before_summing_so_float16_cannot_overflow():
    from hororing.collectives import compressed_allreduce_async_
    # 40000 summed over 2+ ranks is past float16's 65504; the average is not
    values = np.full(1000, 40000.0, dtype=np.float16)
    hvd.synchronize(compressed_allreduce_async_(values, hvd.Compression.fp16,
                                                name="wire.average"))
    # finite, and 40000 within float16's rounding of each partial sum (exact at 1-3 ranks; at
    # 8, 8 x 5000 summed in float16 rounds to 39968)
    assert np.isfinite(values).all()
    np.testing.assert_allclose(values.astype(np.float64), 40000.0, rtol=2e-3)
    if hvd.size() <= 3:
        np.testing.assert_array_equal(values, np.full(1000, 40000.0, dtype=np.float16))


def test_integer_average_truncates_toward_zero():
    mine = np.array([-(hvd.rank() + 1), hvd.rank() + 1], dtype=np.int64)
    result = hvd.allreduce(mine)
    total = sum(range(1, hvd.size() + 1))
    assert result.tolist() == [-(total // hvd.size()), total // hvd.size()]


def test_async_handles_complete_in_any_submission_order():
    names = [f"grad.{index}" for index in range(24)]
    order = list(range(24))
    np.random.default_rng(hvd.rank()).shuffle(order)  # each rank submits in its own order
    handles = {index: hvd.allreduce_async(np.full(index + 1, float(hvd.rank() + index)),
                                          name=names[index], op=hvd.Sum) for index in order}
    for index in range(24):
        expected = sum(rank + index for rank in range(hvd.size()))
        np.testing.assert_array_equal(hvd.synchronize(handles[index]), np.full(index + 1, float(expected)))


def test_poll_becomes_true_without_synchronize():
    handle = hvd.allreduce_async(np.ones(3), name="polled")
    while not hvd.poll(handle):
        pass
    np.testing.assert_array_equal(hvd.synchronize(handle), np.ones(3))


def test_fused_mixed_dtypes_and_ops():
    handles = []
    for index in range(40):
        dtype = ("float32", "int64", "float64", "float16")[index % 4]
        op = (hvd.Sum, hvd.Average, hvd.Max)[index % 3]
        mine = rank_input(hvd.rank(), (index + 3,), dtype, seed=index)
        handles.append((hvd.allreduce_async(mine, op=op, name=f"fuse.{index}"), dtype, op, index))
    for handle, dtype, op, index in handles:
        expected = reference_allreduce(all_inputs(hvd.size(), (index + 3,), dtype, index), op)
        assert_close(hvd.synchronize(handle), expected)


def test_grouped_allreduce():
    tensors = [np.full(3, float(hvd.rank())), np.full((2, 2), 2.0 * hvd.rank())]
    first, second = hvd.grouped_allreduce(tensors, op=hvd.Sum)
    total = sum(range(hvd.size()))
    np.testing.assert_array_equal(first, np.full(3, float(total)))
    np.testing.assert_array_equal(second, np.full((2, 2), 2.0 * total))
    hvd.grouped_allreduce_(tensors, op=hvd.Max)
    np.testing.assert_array_equal(tensors[0], np.full(3, float(hvd.size() - 1)))


def _kinds():
    from hororing.context import current
    available = ["ring", "small", "rabenseifner", "recursive_doubling"]
    if current().engine.allreduce.hierarchical_stats() is not None:
        available.append("hierarchical")
    return available


@pytest.mark.parametrize("dtype", ["float64", "int32"])
@pytest.mark.parametrize("length", [1, 10, 1001, 40_003])
def test_every_algorithm_forced_gives_the_reference(dtype, length):
    """Each algorithm, forced on every rank, on lengths below and above the small-message
    threshold and not divisible by the rank count; the watch sees the forced kind."""
    from hororing.context import current
    pipeline = current().engine.allreduce
    inputs = all_inputs(hvd.size(), (length,), dtype, seed=length)
    expected = reference_allreduce(inputs, hvd.Sum)
    for kind in _kinds():
        pipeline.force(kind)
        try:
            with pipeline.watch() as seen:
                # two names submitted together: the bucket is one fused buffer
                first = hvd.allreduce_async(inputs[hvd.rank()], op=hvd.Sum, name=f"f.{kind}.a")
                second = hvd.allreduce_async(inputs[hvd.rank()][::-1].copy(), op=hvd.Sum,
                                             name=f"f.{kind}.b")
                results = [hvd.synchronize(first), hvd.synchronize(second)]
        finally:
            pipeline.force(None)
        assert_close(results[0], expected)
        assert_close(results[1], expected[::-1])
        assert seen and {seen_kind for seen_kind, _, _ in seen} == {kind}, (kind, seen)
        assert sum(count for _, _, count in seen) == 2 * length


@pytest.mark.skipif("os.environ.get('HORORING_SMALL_ALLREDUCE_BYTES')",
                    reason="a fixed threshold is set")
def test_the_latency_path_ends_where_the_gathered_rows_reach_one_mib():
    """The automatic threshold: a lone float32 allreduce may take the latency path while
    ranks x bytes < 1 MiB (256 KiB in a job across nodes, where the rows cross the links),
    never from there; on either side the cost model's table names the algorithm (the
    hierarchical allreduce standing in for the ring or Rabenseifner's where it runs)."""
    from hororing.algorithms import cost
    from hororing.context import current
    pipeline = current().engine.allreduce
    total = (1 << 20) if hvd.cross_size() == 1 else (256 << 10)
    if os.environ.get("HORORING_SMALL_ALLREDUCE_TOTAL_BYTES"):
        total = int(os.environ["HORORING_SMALL_ALLREDUCE_TOTAL_BYTES"])
    limit = total // hvd.size()  # bytes
    assert pipeline.route.small_bytes == limit
    first_over = -(-limit // 4)  # the fewest float32 values that fill at least limit bytes
    for count in (first_over - 1, first_over):
        inputs = all_inputs(hvd.size(), (count,), "float32", seed=count)
        with pipeline.watch() as seen:
            result = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum, name=f"threshold.{count}")
        assert_close(result, reference_allreduce(inputs, hvd.Sum))
        table_kind = cost.lookup(pipeline.route.table, count * 4)
        assert len(seen) == 1 and seen[0][0] in {table_kind, "hierarchical"}, (count, seen)
        if count == first_over:
            assert seen[0][0] != "small"


def test_forcing_an_algorithm_the_job_lacks_names_what_it_has():
    from hororing.context import current
    with pytest.raises(ValueError, match=r"no 'ps' allreduce in this job \(available: .*ring"):
        current().engine.allreduce.force("ps")


@pytest.mark.parametrize("verb", ["allreduce", "reducescatter"])
def test_float16_sum_is_rounded_to_float16_before_the_postscale(verb):
    # as Horovod's float16 sum is; the prescale and the sum run in float32, one rounding
    rows = 2 * hvd.size() + 1  # not a multiple of the ranks
    inputs = [rank_input(rank, (rows, 3), "float16", seed=61) for rank in range(hvd.size())]
    # 0.5: the halves of float16 values sum exactly in float32, in any order
    scaled = [x.astype(np.float32) * np.float32(0.5) for x in inputs]
    total = np.sum(scaled, axis=0).astype(np.float16)
    expected = (total.astype(np.float32) * np.float32(1.7)).astype(np.float16)
    if verb == "allreduce":
        result = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum, prescale_factor=0.5,
                               postscale_factor=1.7)
    else:
        result = hvd.reducescatter(inputs[hvd.rank()], op=hvd.Sum, prescale_factor=0.5,
                                   postscale_factor=1.7)
        start = sum(2 + (peer < 1) for peer in range(hvd.rank()))
        expected = expected[start:start + 2 + (hvd.rank() < 1)]
    assert result.dtype == np.float16
    np.testing.assert_array_equal(result, expected)


def test_float16_average_rounds_the_exact_sum_to_float16_then_divides():
    inputs = [rank_input(rank, (9, 5), "float16", seed=62) for rank in range(hvd.size())]
    total = np.sum([x.astype(np.float32) for x in inputs], axis=0).astype(np.float16)
    expected = (total.astype(np.float32) / np.float32(hvd.size())).astype(np.float16)
    result = hvd.allreduce(inputs[hvd.rank()], op=hvd.Average)
    np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Max])
@pytest.mark.parametrize("length", [1, 1001, 40_003, 300_007])
def test_out_of_place_reads_the_input_and_never_writes_it_on_every_algorithm(op, length):
    """A lone out-of-place allreduce is reduced from the caller's array into the result (no
    copy of the input first): every algorithm leaves the input as it was."""
    from hororing.context import current
    pipeline = current().engine.allreduce
    inputs = all_inputs(hvd.size(), (length,), "float64", seed=length + op)
    expected = reference_allreduce(inputs, op)
    mine = inputs[hvd.rank()].copy()
    for kind in _kinds():
        pipeline.force(kind)
        try:
            with pipeline.watch() as seen:
                result = hvd.allreduce(mine, op=op, name=f"oop.{kind}.{op}.{length}")
        finally:
            pipeline.force(None)
        assert [seen_kind for seen_kind, _, _ in seen] == [kind]
        assert not np.shares_memory(result, mine)
        np.testing.assert_array_equal(mine, inputs[hvd.rank()])
        assert_close(result, expected)
        assert_identical_on_every_rank(result)


def _address(array):
    return array.__array_interface__["data"][0]


@pytest.mark.skipif("os.environ.get('HORORING_OUTPUT_POOL_BYTES') == '0'", reason="no pool")
def test_a_pooled_result_is_reused_only_once_nothing_refers_to_it():
    count = 300_001  # float64, 2.4 MB: the result comes from the output pool
    inputs = all_inputs(hvd.size(), (count,), "float64", seed=77)
    mine = inputs[hvd.rank()]
    first = hvd.allreduce(mine, op=hvd.Sum, name="pooled")
    address, snapshot = _address(first), first.copy()
    kept = first[10:20]  # a view keeps the whole result alive
    del first
    second = hvd.allreduce(mine * 2, op=hvd.Sum, name="pooled")
    assert _address(second) != address
    np.testing.assert_array_equal(kept, snapshot[10:20])
    del kept
    third = hvd.allreduce(mine * 3, op=hvd.Sum, name="pooled")
    assert _address(third) == address, "a result nobody held was not reused"
    expected = reference_allreduce(inputs, hvd.Sum)
    assert_close(second, 2 * expected)
    assert_close(third, 3 * expected)


@pytest.mark.parametrize("back_to_back", [True, False], ids=["views", "separate"])
def test_in_place_views_back_to_back_are_reduced_where_they_lie(back_to_back):
    """Tensors that are consecutive views of one flat array, submitted as a group in place,
    are reduced in that array (no fusion buffer); on odd ranks, with ``separate``, they are
    separate arrays and are packed: the bytes each rank reduces line up either way."""
    from hororing.context import current
    pipeline = current().engine.allreduce
    lengths = [5, 1000, 3, 20_001]
    inputs = [all_inputs(hvd.size(), (length,), "float64", seed=90 + index)
              for index, length in enumerate(lengths)]
    flat = np.concatenate([rows[hvd.rank()] for rows in inputs])
    offsets = np.cumsum([0] + lengths)
    views = [flat[start:stop] for start, stop in zip(offsets[:-1], offsets[1:])]
    if not back_to_back and hvd.rank() % 2:
        views = [view.copy() for view in views]
    buffers = []
    pipeline.observers.append(lambda kind, buffer: buffers.append(buffer))
    try:
        # a group is announced in one cycle on every rank, so its members are ready together
        results = hvd.synchronize(hvd.grouped_allreduce_async_(views, op=hvd.Sum,
                                                               name=f"views.{back_to_back}"))
    finally:
        pipeline.observers.pop()
    for result, view, rows in zip(results, views, inputs):
        assert result is view
        assert_close(result, reference_allreduce(rows, hvd.Sum))
    # a fused bucket of views reduces in the flat array itself, one of copies does not
    fused = [buffer for buffer in buffers if buffer.size > max(lengths)]
    assert fused or hvd.size() == 1, "the four members of a group were not fused"
    for buffer in fused:
        assert np.shares_memory(buffer, flat) == (back_to_back or hvd.rank() % 2 == 0)


def test_a_loop_of_small_out_of_place_calls_folded_into_negotiation():
    """Repeated lone small allreduces fold into the negotiation exchange; out of place, their
    results are new arrays there too, and the input is left alone."""
    inputs = all_inputs(hvd.size(), (37,), "float32", seed=5)
    mine = inputs[hvd.rank()].copy()
    for _ in range(6):
        result = hvd.allreduce(mine, op=hvd.Sum, name="folded.out_of_place")
        assert_close(result, reference_allreduce(inputs, hvd.Sum))
        assert not np.shares_memory(result, mine)
    np.testing.assert_array_equal(mine, inputs[hvd.rank()])
