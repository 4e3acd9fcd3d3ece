"""Collectives on device arrays (numba.cuda; its CPU simulator where there is no GPU).

On a GPU (NUMBA_ENABLE_CUDASIM=0, scripts/gpu_checks.sh) the same tests run the device-direct
ring or, with HORORING_DEVICE_RING=staged, the staged ring. In the simulator the PyPI MPI is
not CUDA-aware and device memory cannot be shared, so allreduce takes the staged ring: device fusion buffer,
chunks copied to pinned host memory in the order the ring reads them, the host ring, pieces
copied back as they become final. References are computed on the host from every rank's
regenerated input. Lengths include 0, 1 and sizes not divisible by the number of ranks;
140001 float64 values (1.1 MB) are above the small-message threshold at every job size
(1 MiB / ranks), so they take the ring.
"""

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd
from reference import all_inputs, rank_input, reference_allreduce

cuda = pytest.importorskip("numba.cuda")
# decided at collection, before the session fixture has called hvd.init()
SINGLE = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="a mismatch needs two ranks")


def device(array):
    return cuda.to_device(array)


@pytest.mark.parametrize("count", [0, 1, 7, 1001, 140001])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product])
def test_device_allreduce_matches_reference(count, op):
    seed = count * 7 + op
    inputs = all_inputs(hvd.size(), (count,), "float64", seed=seed, op=op)
    result = hvd.allreduce(device(inputs[hvd.rank()]), op=op, name=f"dev.{count}.{op}")
    assert type(result).__module__.startswith("numba")
    # the ring sums in another order than the reference: a few ulps of the inputs (|x| < 20)
    # absolute, which is more than rtol where the sum nearly cancels
    np.testing.assert_allclose(result.copy_to_host(), reference_allreduce(inputs, op),
                               rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "float16", "float32"])
def test_device_allreduce_dtypes_with_scaling(dtype):
    op = hvd.Average if dtype != "uint8" else hvd.Sum
    shape = (3, 5, 7)
    inputs = all_inputs(hvd.size(), shape, dtype, seed=11)
    result = hvd.allreduce(device(inputs[hvd.rank()]), op=op, name=f"devdt.{dtype}",
                           prescale_factor=0.5, postscale_factor=2.0)
    expected = reference_allreduce(inputs, op, prescale=0.5, postscale=2.0)
    assert result.shape == shape and result.dtype == np.dtype(dtype)
    tolerance = 1e-2 if dtype == "float16" else 1e-6
    np.testing.assert_allclose(result.copy_to_host().astype(np.float64), expected.astype(np.float64),
                               rtol=tolerance, atol=tolerance)


def test_device_allreduce_in_place_writes_the_callers_array():
    inputs = all_inputs(hvd.size(), (2, 9001), "float64", seed=3)
    array = device(inputs[hvd.rank()])
    returned = hvd.allreduce_(array, op=hvd.Sum, name="dev.inplace")
    assert returned is array
    np.testing.assert_allclose(array.copy_to_host(), reference_allreduce(inputs, hvd.Sum))


def test_device_async_allreduces_fuse_and_complete():
    handles, expected = [], []
    for index, count in enumerate([5, 300, 1, 64]):
        inputs = all_inputs(hvd.size(), (count,), "float32", seed=100 + index)
        handles.append(hvd.allreduce_async(device(inputs[hvd.rank()]), name=f"dev.fused.{index}"))
        expected.append(reference_allreduce(inputs, hvd.Average))
    for handle, reference in zip(handles, expected):
        np.testing.assert_allclose(hvd.synchronize(handle).copy_to_host(), reference, rtol=1e-5)


def test_device_allgather_broadcast_alltoall_reducescatter():
    rank, size = hvd.rank(), hvd.size()
    gathered = hvd.allgather(device(np.full((rank + 1, 2), rank, np.int32)), name="dev.ag")
    expected = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(size)])
    np.testing.assert_array_equal(gathered.copy_to_host(), expected)

    array = device(np.full(5, rank, np.int64))
    assert hvd.broadcast_(array, root_rank=size - 1, name="dev.bc") is array
    np.testing.assert_array_equal(array.copy_to_host(), np.full(5, size - 1))

    rows = np.arange(size * 2, dtype=np.float32).reshape(size * 2, 1) + 100 * rank
    received, splits = hvd.alltoall(device(rows), name="dev.a2a")
    np.testing.assert_array_equal(splits, [2] * size)
    expected = np.concatenate([np.arange(2 * rank, 2 * rank + 2, dtype=np.float32) + 100 * r
                               for r in range(size)]).reshape(-1, 1)
    np.testing.assert_array_equal(received.copy_to_host(), expected)

    inputs = all_inputs(size, (size * 2 + 1, 3), "float64", seed=5)
    mine = hvd.reducescatter(device(inputs[rank]), op=hvd.Sum, name="dev.rs")
    total = reference_allreduce(inputs, hvd.Sum)
    np.testing.assert_allclose(mine.copy_to_host(), np.array_split(total, size)[rank], rtol=1e-12)


@SINGLE
def test_host_and_device_under_one_name_is_a_mismatch_on_every_rank():
    values = rank_input(hvd.rank(), (4,), "float32")
    tensor = values if hvd.rank() == 0 else device(values)
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched ALLREDUCE CPU/GPU device "
                                                       "selection: One rank specified device cpu, "
                                                       "but another rank specified device cuda"):
        hvd.allreduce(tensor, name="dev.mixed")


def test_bad_device_arrays_are_refused_at_the_door():
    strided = device(np.arange(12.0).reshape(3, 4))[:, ::2]
    with pytest.raises(ValueError, match="non-contiguous device array .*contiguous"):
        hvd.allreduce(strided, name="dev.strided")
    with pytest.raises(TypeError, match="device array of unsupported dtype complex64"):
        hvd.allreduce(device(np.ones(3, np.complex64)), name="dev.complex")


def test_compressed_allreduce_of_a_device_array_takes_the_device_path():
    from hororing.collectives import compressed_allreduce_async_
    inputs = [np.full(9, rank + 1, dtype=np.float16) for rank in range(hvd.size())]
    array = device(inputs[hvd.rank()])
    hvd.synchronize(compressed_allreduce_async_(array, hvd.Compression.fp16, name="dev.compressed",
                                                op=hvd.Sum))
    np.testing.assert_array_equal(array.copy_to_host(), sum(inputs))


@pytest.mark.parametrize("count", [1001, 140001])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average], ids=["sum", "average"])
def test_a_float16_device_payload_travels_in_float16_as_the_host_one_does(count, op):
    """Compression.fp16 on a device array: 16 bits on the wire (half the bytes of float32),
    each hop adding in float32 and rounding: the same bits as the host payload's ring (both
    forced onto it: by default a host buffer may take a halving algorithm, whose sums go in
    another order, where a device buffer takes the ring)."""
    from hororing.collectives import compressed_allreduce_async_
    from hororing.context import current
    inputs = all_inputs(hvd.size(), (count,), "float32", seed=count + op)
    payload = inputs[hvd.rank()].astype(np.float16)
    on_host = payload.copy()
    array = device(payload)
    pipeline = current().engine.allreduce
    pipeline.force("ring")
    try:
        hvd.synchronize(compressed_allreduce_async_(on_host, hvd.Compression.fp16,
                                                    name=f"wire.host.{count}.{op}", op=op))
        with pipeline.watch() as seen:
            hvd.synchronize(compressed_allreduce_async_(array, hvd.Compression.fp16,
                                                        name=f"wire.dev.{count}.{op}", op=op))
    finally:
        pipeline.force(None)
    np.testing.assert_array_equal(array.copy_to_host(), on_host)
    divisor = hvd.size() if op == hvd.Average else 1
    expected = np.sum([row.astype(np.float16).astype(np.float64) for row in inputs],
                      axis=0) / divisor
    # each hop's sum rounded to float16 once, the Average's division of each input once
    magnitude = np.sum([np.abs(row.astype(np.float64)) for row in inputs], axis=0) / divisor
    tolerance = (hvd.size() + 1) * 2.0 ** -11 * magnitude + 1e-7
    assert np.all(np.abs(array.copy_to_host().astype(np.float64) - expected) <= tolerance)
    if hvd.size() > 1:
        assert {dtype for _, dtype, _ in seen} == {"float16"}


def test_device_transport_follows_the_setting():
    import os
    from hororing.context import current
    from hororing.gpu.memory import memory_for_device_arrays
    forced = os.environ.get("HORORING_DEVICE_RING", "auto")
    if forced != "auto":
        wanted = forced
    elif os.environ.get("HORORING_CUDA_AWARE") == "1":
        wanted = "cuda-aware"
    else:  # one node: the device-direct ring wherever device memory can be shared (cupy)
        wanted = "direct" if memory_for_device_arrays().can_share else "staged"
    assert current().engine.allreduce.device_transport() == wanted


@pytest.mark.parametrize("kind", ["small", "ring"])
def test_device_allreduce_forced_to_each_algorithm(kind):
    from hororing.context import current
    pipeline = current().engine.allreduce
    inputs = all_inputs(hvd.size(), (1003,), "float32", seed=21)
    mine = device(inputs[hvd.rank()])
    pipeline.force(kind)
    try:
        with pipeline.watch() as seen:
            result = hvd.allreduce(mine, op=hvd.Sum, name=f"dev.f.{kind}")
    finally:
        pipeline.force(None)
    # out of place, the input is read where it lies and left as it was
    np.testing.assert_array_equal(mine.copy_to_host(), inputs[hvd.rank()])
    # float32 sums of values up to 20 in magnitude: a few ulps of 80 absolute
    np.testing.assert_allclose(result.copy_to_host(), reference_allreduce(inputs, hvd.Sum),
                               rtol=1e-5, atol=1e-4)
    assert [seen_kind for seen_kind, _, _ in seen] == [kind]


@pytest.mark.parametrize("copy_bytes", [4, 4096, 8 * 1024 * 1024])
def test_staged_ring_gives_the_same_sums_whatever_its_copy_size(copy_bytes):
    # one copy per element, per few pieces, or all joined, down and back up: the staged ring
    # on its own (not the engine's), with 1 KiB sub-chunks so that a rank's pieces are many
    from mpi4py import MPI
    from hororing.algorithms.ring import Ring
    from hororing.algorithms.staged import StagedRing
    from hororing.gpu.memory import memory_for_device_arrays
    comm = MPI.COMM_WORLD.Dup()
    memory = memory_for_device_arrays()  # cupy on a GPU, numba in the simulator
    try:
        staged = StagedRing(Ring(comm, 1024), copy_bytes, memory)
        inputs = all_inputs(comm.Get_size(), (10007,), "float64", seed=23)
        buffer = memory.view(device(inputs[comm.Get_rank()]))
        staged.allreduce(buffer, "sum")
        memory.synchronize()
        np.testing.assert_allclose(on_host(buffer), reference_allreduce(inputs, hvd.Sum),
                                   rtol=1e-12)
        # out of place: the host copy is taken from the input, the result lands in buffer
        source = memory.view(device(inputs[comm.Get_rank()]))
        buffer = memory.view(device(np.full(10007, 5.0)))
        staged.allreduce(buffer, "sum", source=source)
        memory.synchronize()
        np.testing.assert_allclose(on_host(buffer), reference_allreduce(inputs, hvd.Sum),
                                   rtol=1e-12)
        np.testing.assert_array_equal(on_host(source), inputs[comm.Get_rank()])
    finally:
        comm.Free()


def on_host(array):
    return array.get() if hasattr(array, "get") else array.copy_to_host()


def test_device_adasum_goes_through_the_host_and_matches_the_tree():
    from reference import adasum_tree
    inputs = all_inputs(hvd.size(), (1001,), "float32", seed=31)
    result = hvd.allreduce(device(inputs[hvd.rank()]), op=hvd.Adasum, name="dev.adasum")
    np.testing.assert_allclose(result.copy_to_host(), adasum_tree(inputs), rtol=1e-5, atol=1e-4)
