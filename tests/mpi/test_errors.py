"""Errors: cross-rank mismatches fail on every rank before data moves; bad input at the door."""

import numpy as np
import pytest
from mpi4py import MPI

import hororing as hvd

# decided at collection, before the session fixture has called hvd.init()
SINGLE = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="a mismatch needs two ranks")


@SINGLE
def test_mismatched_shapes_fail_on_every_rank_then_the_library_goes_on():
    shape = 5 if hvd.rank() == 0 else 6
    # refused before data moved: PreconditionError, a HorovodInternalError as Horovod's is
    assert issubclass(hvd.PreconditionError, hvd.HorovodInternalError)
    with pytest.raises(hvd.PreconditionError,
                       match=r"Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape "
                             r"\[5\], but another rank sent a tensor of shape \[6\]\. "
                             r"\(tensor 'shapes': rank 0 vs rank 1\)"):
        hvd.allreduce(np.ones(shape), name="shapes")
    np.testing.assert_array_equal(hvd.allreduce(np.ones(4), name="shapes", op=hvd.Sum),
                                  np.full(4, float(hvd.size())))


@SINGLE
def test_mismatched_compression_fails_on_every_rank():
    from hororing.collectives import compressed_allreduce_async_
    values = np.ones(3, dtype=np.float16)
    with pytest.raises(hvd.HorovodInternalError,
                       match="Mismatched ALLREDUCE compression: One rank sent float16 on the "
                             "wire, but another rank sent float32"):
        if hvd.rank() == 0:
            hvd.synchronize(compressed_allreduce_async_(values, hvd.Compression.fp16,
                                                        name="compression"))
        else:
            hvd.allreduce(values, name="compression")


@SINGLE
def test_mismatched_dtypes_ops_roots_and_kinds():
    dtype = np.float32 if hvd.rank() == 0 else np.float64
    with pytest.raises(RuntimeError, match="Mismatched data types: One rank had type float32, "
                                           "but another rank had type float64"):
        hvd.allreduce(np.ones(3, dtype=dtype), name="dtypes")
    op = hvd.Sum if hvd.rank() == 0 else hvd.Max
    with pytest.raises(RuntimeError, match="Mismatched ALLREDUCE reduction operations: One rank "
                                           "specified Sum, but another rank specified Max"):
        hvd.allreduce(np.ones(3), name="ops", op=op)
    with pytest.raises(RuntimeError, match="Mismatched BROADCAST root ranks: One rank specified "
                                           "root rank 0, but another rank specified root rank 1"):
        hvd.broadcast(np.ones(3), root_rank=min(hvd.rank(), 1), name="roots")
    with pytest.raises(RuntimeError, match="Mismatched MPI operations: One rank did an ALLREDUCE, "
                                           "but another rank did an ALLGATHER"):
        if hvd.rank() == 0:
            hvd.allreduce(np.ones(3), name="kinds")
        else:
            hvd.allgather(np.ones(3), name="kinds")
    with pytest.raises(RuntimeError, match=r"Mismatched ALLGATHER tensor shapes: One rank sent a "
                                           r"tensor with dimension 1 equal to 2"):
        hvd.allgather(np.ones((1, 2 + min(hvd.rank(), 1))), name="gather-dims")
    assert hvd.allreduce(np.array([2]), op=hvd.Sum, name="after")[0] == 2 * hvd.size()


def test_name_in_flight_is_refused_at_once():
    handle = hvd.allreduce_async(np.ones(2), name="busy")
    with pytest.raises(ValueError, match="a collective named 'busy' is already in flight"):
        hvd.allreduce_async(np.ones(2), name="busy")
    hvd.synchronize(handle)
    hvd.synchronize(hvd.allreduce_async(np.ones(2), name="busy"))


@SINGLE
def test_a_name_in_flight_is_refused_before_the_input_is_looked_at():
    """The name is checked first: the input's conversion can release the GIL, and a
    collective just submitted under that name could finish meanwhile. Rank 0's calls stay
    in flight until the others submit theirs, after the barrier."""
    if hvd.rank() == 0:
        handle = hvd.allreduce_async(np.ones(2), name="first")
        with pytest.raises(ValueError, match="a collective named 'first' is already in flight"):
            hvd.allreduce_async([1.0, 2.0], name="first")  # a list: else a TypeError
        group = hvd.grouped_allgather_async([np.ones(1)], name="together")
        with pytest.raises(ValueError, match="'together.0' is already in flight"):
            hvd.grouped_allgather_async(["not an array"], name="together")
    hvd.barrier()
    if hvd.rank() != 0:
        handle = hvd.allreduce_async(np.ones(2), name="first")
        group = hvd.grouped_allgather_async([np.ones(1)], name="together")
    hvd.synchronize(handle)
    hvd.synchronize(group)


@pytest.mark.parametrize("call,error,message", [
    (lambda: hvd.allreduce([1.0, 2.0]), TypeError, "tensor must be a numpy array, got list"),
    (lambda: hvd.allreduce(None), TypeError, "tensor must be a numpy array, got None"),
    (lambda: hvd.allgather("text"), TypeError, "tensor must be a numpy array, got str"),
    (lambda: hvd.allreduce(np.array([None])), TypeError, "unsupported dtype object"),
    (lambda: hvd.broadcast(np.ones(2), root_rank=hvd.size()), ValueError,
     r"root_rank must be in \[0, "),
    (lambda: hvd.broadcast(np.ones(2), root_rank=-1), ValueError, r"root_rank must be in \[0, "),
    (lambda: hvd.alltoall(np.ones(3), splits=[-1] + [0] * (hvd.size() - 2) + [4]), ValueError,
     "splits must"),
    (lambda: hvd.alltoall(np.ones(2), splits=[1] * (hvd.size() + 1)), ValueError,
     "splits must have one entry per rank"),
    (lambda: hvd.allgather(np.array(3.0)), ValueError, "at least 1 dimension"),
    (lambda: hvd.reducescatter(np.ones(4), op=hvd.Max), ValueError, "op must be one of Average, Sum"),
    (lambda: hvd.allreduce(np.ones(2), name=7), TypeError, "name must be a str or None"),
    (lambda: hvd.allreduce(np.ones(2), prescale_factor="2"), TypeError, "prescale_factor must be"),
    (lambda: hvd.synchronize(3), TypeError, "synchronize takes a handle"),
    (lambda: hvd.grouped_allreduce(np.ones(2)), TypeError, "grouped_allreduce takes a list"),
])
def test_bad_input_raises_on_the_calling_rank(call, error, message):
    with pytest.raises(error, match=message):
        call()
    # nothing was queued: the next collective pairs up normally on every rank
    assert hvd.allreduce(np.array([1]), op=hvd.Sum, name="after-bad")[0] == hvd.size()


def test_read_only_array_in_place():
    array = np.ones(2)
    array.flags.writeable = False
    with pytest.raises(ValueError, match="tensor is read-only"):
        hvd.allreduce_(array)
    np.testing.assert_array_equal(hvd.allreduce(array), np.ones(2))
