"""Door checks: each bad argument gets a clear error naming it and the fix."""

import numpy as np
import pytest

import hororing as hvd
from hororing.validate import (ALLREDUCE_OPS, check_array, check_name, check_root, check_splits,
                               check_writable, resolve_op)


@pytest.mark.parametrize("value,message", [
    ([1.0, 2.0], "tensor must be a numpy array, got list; convert it with numpy.asarray"),
    (None, "tensor must be a numpy array, got None"),
    ("abc", "tensor must be a numpy array, got str"),
    (np.array(["a"]), "tensor has unsupported dtype <U1; supported dtypes: uint8"),
    (np.array([object()]), "tensor has unsupported dtype object"),
    (np.array([1 + 2j]), "tensor has unsupported dtype complex128"),
])
def test_check_array_type_errors(value, message):
    with pytest.raises(TypeError, match=message.replace("(", r"\(")):
        check_array(value)


def test_check_array_ndim():
    with pytest.raises(ValueError, match=r"tensor must have at least 1 dimension.*"
                                         r"e\.g\. tensor\.reshape\(1\)$"):
        check_array(np.array(1.0), min_ndim=1)
    # the suggestion is the shape wanted: a leading 1 per missing dimension
    scalar = np.array(1.0)
    with pytest.raises(ValueError, match=r"reshape\(1\)$"):
        check_array(scalar, min_ndim=1)
    assert scalar.reshape(1).shape == (1,)
    with pytest.raises(ValueError, match=r"reshape\(1, 3\)$"):
        check_array(np.ones(3), min_ndim=2)


def test_read_only_in_place():
    array = np.ones(3)
    array.flags.writeable = False
    with pytest.raises(ValueError, match="tensor is read-only"):
        check_writable(array)


def test_names_roots_ops():
    with pytest.raises(TypeError, match="name must be a str or None, got int"):
        check_name(3)
    with pytest.raises(ValueError, match="name must not be empty"):
        check_name("")
    with pytest.raises(ValueError, match=r"root_rank must be in \[0, 4\) \(the job has 4 ranks\), got 4"):
        check_root(4, 4)
    with pytest.raises(ValueError, match=r"root_rank must be in \[0, 2\).*got -1"):
        check_root(-1, 2)
    with pytest.raises(TypeError, match="root_rank must be an int, got float"):
        check_root(1.0, 2)
    with pytest.raises(ValueError, match="The op parameter supersedes average"):
        resolve_op(hvd.Sum, average=True)
    with pytest.raises(ValueError, match="op=Adasum is supported by allreduce"):
        resolve_op(hvd.Adasum)  # e.g. reducescatter's ops
    assert resolve_op(hvd.Adasum, allowed=ALLREDUCE_OPS) == hvd.Adasum
    with pytest.raises(ValueError, match="op must be one of Average, Sum, Min, Max, Product, got 42"):
        resolve_op(42)
    assert resolve_op(None) == hvd.Average and resolve_op(None, average=False) == hvd.Sum


def test_splits():
    assert check_splits([1, 2], 3, 2) == (1, 2)
    assert check_splits(None, 4, 2) is None
    with pytest.raises(ValueError, match=r"splits must be non-negative, got \[-1, 4\]"):
        check_splits([-1, 4], 3, 2)
    with pytest.raises(ValueError, match=r"splits must add up to the first dimension of the tensor \(3\)"):
        check_splits([1, 1], 3, 2)
    with pytest.raises(ValueError, match=r"splits must have one entry per rank \(2\), got 3"):
        check_splits([1, 1, 1], 3, 2)
    with pytest.raises(TypeError, match="splits must be a 1-d sequence of ints"):
        check_splits([0.5, 2.5], 3, 2)
    with pytest.raises(ValueError, match=r"divisible by the number of ranks \(2\); pass splits="):
        check_splits(None, 3, 2)


def test_calls_before_init_raise():
    assert not hvd.is_initialized()
    for call in (hvd.rank, hvd.size, hvd.local_rank, hvd.barrier,
                 lambda: hvd.allreduce(np.ones(2))):
        with pytest.raises(ValueError, match=r"hororing has not been initialized; run hvd.init\(\) first"):
            call()
