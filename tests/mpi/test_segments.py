"""Host buckets whose large members are reduced where they lie (engine/segments.py): the ring
cuts its pieces at the members' ends and packs only the small members between them. Results
against the float64 references, grouped calls in place and out of place, with scale factors,
on lengths no rank count divides, and with ranks whose tensors lie differently in memory."""

import contextlib

import numpy as np
import pytest

import hororing as hvd
from hororing.algorithms.segmented import Segmented
from hororing.context import current
from reference import all_inputs, assert_close, reference_allreduce

# elements per member: large ones (>= MEMBER_BYTES as float32 or float64) among small ones,
# runs of small members at both ends and between large neighbours
LENGTHS = (7, 1500, 3, 11, 2001, 1999, 5)
MEMBER_BYTES = 4000


@contextlib.contextmanager
def segmented_ring(member_bytes=MEMBER_BYTES):
    """Every bucket on the ring, members of ``member_bytes`` or more reduced where they lie;
    yields the buffers handed to the algorithm."""
    pipeline = current().engine.allreduce
    before = pipeline.route.member_bytes
    seen = []

    def record(kind, buffer):
        seen.append((kind, buffer))
    pipeline.force("ring")
    pipeline.reroute(member_bytes=member_bytes)
    pipeline.observers.append(record)
    try:
        yield seen
    finally:
        pipeline.observers.remove(record)
        pipeline.force(None)
        pipeline.reroute(member_bytes=before)


def member_inputs(dtype, seed):
    return [all_inputs(hvd.size(), (length,), dtype, seed=seed + index)
            for index, length in enumerate(LENGTHS)]


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Max])
def test_a_grouped_allreduce_in_place_reduces_large_members_where_they_lie(dtype, op):
    if op == hvd.Average and dtype == "int32":
        pytest.skip("integer averages are covered by test_allreduce")
    inputs = member_inputs(dtype, seed=10)
    arrays = [every[hvd.rank()].copy() for every in inputs]
    with segmented_ring() as seen:
        hvd.grouped_allreduce_(arrays, op=op, name=f"seg.inplace.{dtype}.{op}")
    for array, every in zip(arrays, inputs):
        assert_close(array, reference_allreduce(every, op))
    (kind, buffer), = seen  # one bucket, laid out in segments
    assert kind == "ring" and isinstance(buffer, Segmented)
    itemsize = np.dtype(dtype).itemsize
    large = [length for length in LENGTHS if length * itemsize >= MEMBER_BYTES]
    # each large member a segment, and each run of small ones around them
    assert len(buffer.parts) == len(large) + 3
    assert buffer.size == sum(LENGTHS)


def test_out_of_place_with_scale_factors_leaves_the_inputs_alone():
    inputs = member_inputs("float64", seed=30)
    mine = [every[hvd.rank()].copy() for every in inputs]
    with segmented_ring() as seen:
        results = hvd.grouped_allreduce(mine, op=hvd.Average, prescale_factor=0.5,
                                        postscale_factor=3.0, name="seg.outofplace")
    for result, array, every in zip(results, mine, inputs):
        assert_close(result, reference_allreduce(every, hvd.Average, 0.5, 3.0))
        np.testing.assert_array_equal(array, every[hvd.rank()])
    assert isinstance(seen[0][1], Segmented)


def test_ranks_whose_tensors_lie_differently_still_agree():
    """Rank 0's members are views of one flat array (a span in place); the others' are
    separate arrays (their small runs packed): the pieces are cut alike everywhere."""
    inputs = member_inputs("float32", seed=50)
    if hvd.rank() == 0:
        flat = np.concatenate([every[0] for every in inputs])
        ends = np.cumsum(LENGTHS)
        arrays = [flat[end - length:end] for end, length in zip(ends, LENGTHS)]
    else:
        arrays = [every[hvd.rank()].copy() for every in inputs]
    with segmented_ring() as seen:
        hvd.grouped_allreduce_(arrays, op=hvd.Sum, name="seg.layouts")
    for array, every in zip(arrays, inputs):
        assert_close(array, reference_allreduce(every, hvd.Sum))
    assert isinstance(seen[0][1], Segmented)


def test_without_a_large_member_or_with_segments_off_the_bucket_is_fused():
    inputs = member_inputs("float32", seed=70)
    for member_bytes in (0, 10**9):
        arrays = [every[hvd.rank()].copy() for every in inputs]
        with segmented_ring(member_bytes) as seen:
            hvd.grouped_allreduce_(arrays, op=hvd.Sum, name=f"seg.fused.{member_bytes}")
        for array, every in zip(arrays, inputs):
            assert_close(array, reference_allreduce(every, hvd.Sum))
        assert not isinstance(seen[0][1], Segmented)


def test_a_bucket_priced_cheaper_in_parts_reduces_each_segment_on_its_own(monkeypatch):
    """Where the cost model prices one reduction per segment below one ring over them all
    (many ranks of one node), each segment is reduced alone: the small runs still packed and
    unpacked, the scale factors applied to each."""
    from hororing.engine.allreduce import AllreducePipeline
    monkeypatch.setattr(AllreducePipeline, "_split_pays", lambda self, *args: True)
    inputs = member_inputs("float64", seed=90)
    arrays = [every[hvd.rank()].copy() for every in inputs]
    with segmented_ring() as seen:
        hvd.grouped_allreduce_(arrays, op=hvd.Average, prescale_factor=2.0,
                               postscale_factor=0.25, name="seg.split")
    for array, every in zip(arrays, inputs):
        assert_close(array, reference_allreduce(every, hvd.Average, 2.0, 0.25))
    # one flat buffer per segment: three large members, three runs of small ones
    assert [buffer.size for _, buffer in seen] == [7, 1500, 14, 2001, 1999, 5]
    assert not any(isinstance(buffer, Segmented) for _, buffer in seen)
