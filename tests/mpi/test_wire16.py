"""16-bit payloads on the wire with float32 sums (Compression.fp16 and .bf16): each hop
widens what it receives, adds in float32 and rounds to 16 bits, so the bytes halve and the
result stays within a few 16-bit units in the last place of the float64 sum."""

import numpy as np
import pytest
import torch

import hororing as hnp
import hororing.torch as hvd
from hororing import collectives
from hororing.compression import Compression
from hororing.context import current
from hororing.ops import BFLOAT16

from reference import all_inputs, assert_identical_on_every_rank

# the spacing of 16-bit values relative to their magnitude (2 ** -(mantissa bits))
EPSILON = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7}
WIRE = {"fp16": "float16", "bf16": "bfloat16"}
SHAPES = [(1001,), (30011,), (3, 7)]  # none divisible by 2 or 3 ranks


def bound(inputs, kind, divisor=1):
    """How far the 16-bit result may be from the float64 one: each rank's input rounded
    once, each of the (size - 1) hops of a partial sum once, the result once more (and an
    Average's division of each input): (2 size + 1) half-units of the largest partial sum."""
    magnitude = np.sum([np.abs(row.astype(np.float64)) for row in inputs], axis=0) / divisor
    return (2 * len(inputs) + 2) * 0.5 * EPSILON[kind] * magnitude + 1e-30


@pytest.fixture(params=["ring", "small", "rabenseifner", "recursive_doubling"])
def algorithm(request):
    """Force each path a bucket can take, so both reduce 16-bit payloads."""
    pipeline = current().engine.allreduce
    pipeline.force(request.param)
    try:
        yield request.param
    finally:
        pipeline.force(None)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", [hnp.Sum, hnp.Average], ids=["sum", "average"])
def test_numpy_payload_sums_within_a_few_16_bit_units(kind, shape, op, algorithm):
    compressor = getattr(Compression, kind)
    inputs = all_inputs(hnp.size(), shape, "float32", seed=len(shape) + op)
    payload, ctx = compressor.compress(inputs[hnp.rank()].copy())
    assert payload.dtype == np.dtype(WIRE[kind])
    with current().engine.allreduce.watch() as seen:
        reduced = collectives.synchronize(collectives.compressed_allreduce_async_(
            payload, compressor, name=f"wire16.{kind}.{algorithm}.{shape}.{op}", op=op))
    result = compressor.decompress(reduced, ctx)
    assert result.dtype == np.float32 and result.shape == shape
    divisor = hnp.size() if op == hnp.Average else 1
    expected = np.sum([row.astype(np.float64) for row in inputs], axis=0) / divisor
    error = np.abs(result.astype(np.float64) - expected)
    assert np.all(error <= bound(inputs, kind, divisor)), error.max()
    assert_identical_on_every_rank(result)
    if hnp.size() > 1:
        assert {(seen_kind, dtype) for seen_kind, dtype, _ in seen} == {(algorithm, WIRE[kind])}


def test_the_ring_sends_half_the_bytes_of_float32():
    """The same tensor through the ring, float32 and then bf16: half the bytes sent."""
    pipeline = current().engine.allreduce
    ring = pipeline.host.algorithms["ring"]
    values = all_inputs(hnp.size(), (30011,), "float32", seed=5)[hnp.rank()]
    pipeline.force("ring")
    try:
        sent = []
        for compressor in (Compression.none, Compression.bf16, Compression.fp16):
            before = ring.bytes_sent
            payload, _ = compressor.compress(values.copy())
            collectives.synchronize(collectives.compressed_allreduce_async_(
                payload, compressor, name=f"wire16.bytes.{compressor.__name__}", op=hnp.Sum))
            sent.append(ring.bytes_sent - before)
    finally:
        pipeline.force(None)
    if hnp.size() > 1:
        assert sent[1] * 2 == sent[0] and sent[2] * 2 == sent[0], sent
    else:
        assert sent == [0, 0, 0]


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_torch_allreduce_and_grouped_allreduce_travel_in_16_bits(kind, reduced_buffers):
    compression = getattr(hvd.Compression, kind)
    shapes = [(7,), (1001,), (5, 13)]
    inputs = [all_inputs(hvd.size(), shape, "float32", seed=index)
              for index, shape in enumerate(shapes)]
    mine = [torch.from_numpy(rows[hvd.rank()].copy()) for rows in inputs]
    single = hvd.allreduce(mine[1], op=hvd.Sum, compression=compression, name=f"t16.{kind}")
    grouped = hvd.grouped_allreduce(mine, op=hvd.Average, compression=compression,
                                    name=f"t16.group.{kind}")
    size = hvd.size()
    checks = [(single, inputs[1], 1)] + [(result, rows, size)
                                          for result, rows in zip(grouped, inputs)]
    for result, rows, divisor in checks:
        assert result.dtype == torch.float32
        expected = np.sum([row.astype(np.float64) for row in rows], axis=0) / divisor
        error = np.abs(result.numpy().astype(np.float64) - expected)
        assert np.all(error <= bound(rows, kind, divisor)), error.max()
        assert_identical_on_every_rank(result.numpy())
    if size > 1:
        assert {dtype for _, dtype, _ in reduced_buffers} == {WIRE[kind]}


def test_a_bfloat16_tensor_of_its_own_is_summed_in_float32():
    """Without compression a bfloat16 tensor (numpy's, through ml_dtypes) travels as float32,
    as float16 does: the sum is exact before the one rounding to bfloat16."""
    inputs = [row.astype(BFLOAT16) for row in all_inputs(hnp.size(), (1001,), "float32", 9)]
    result = hnp.allreduce(inputs[hnp.rank()], op=hnp.Sum, name="bf16.own")
    assert result.dtype == BFLOAT16
    expected = np.sum([row.astype(np.float64) for row in inputs], axis=0)
    np.testing.assert_array_equal(result, expected.astype(np.float32).astype(BFLOAT16))


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_16_bit_payloads_back_to_back_are_summed_where_they_lie(kind):
    """Payloads that are consecutive views of one flat array, started together, are reduced
    in that array as one bucket, still as 16-bit values (a bfloat16 span keeps its dtype)."""
    compressor = getattr(Compression, kind)
    lengths = [7, 1001, 30011]
    inputs = [all_inputs(hnp.size(), (length,), "float32", seed=40 + index)
              for index, length in enumerate(lengths)]
    flat, _ = compressor.compress(np.concatenate([rows[hnp.rank()] for rows in inputs]))
    offsets = np.cumsum([0] + lengths)
    views = [flat[start:stop] for start, stop in zip(offsets[:-1], offsets[1:])]
    engine = current().engine
    with engine.allreduce.watch() as seen:
        with engine.batch():
            handles = [collectives.compressed_allreduce_async_(
                view, compressor, name=f"wire16.span.{kind}.{index}", op=hnp.Sum)
                for index, view in enumerate(views)]
        results = [collectives.synchronize(handle) for handle in handles]
    for result, view, rows in zip(results, views, inputs):
        assert result is view
        expected = np.sum([row.astype(np.float64) for row in rows], axis=0)
        error = np.abs(compressor.decompress(result, np.float32).astype(np.float64) - expected)
        assert np.all(error <= bound(rows, kind)), error.max()
    if hnp.size() > 1:
        assert {dtype for _, dtype, _ in seen} == {WIRE[kind]}, seen
        assert max(count for _, _, count in seen) == sum(lengths), "not reduced as one span"
