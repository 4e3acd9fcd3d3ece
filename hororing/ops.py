"""Reduction operations, with Horovod's values so scripts may compare them directly, and the
dtypes the collectives carry: a leaf every floor may read."""

import functools
import sys

import numpy as np

# what every collective takes (numpy's names; the bindings map their own dtypes onto these),
# and bfloat16 (float32's range, 8 mantissa bits), which ml_dtypes adds to numpy: see bfloat16()
SUPPORTED_NAMES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
                   "float16", "float32", "float64", "bfloat16")
# numpy computes dtype.name in Python on every access; the hot path looks it up here (bfloat16
# joins it when it is loaded)
DTYPE_NAMES = {np.dtype(name): name for name in SUPPORTED_NAMES[:-1]}
# where MPI has no type for a dtype, the unsigned integers of its width carry it (bfloat16,
# once loaded)
CARRIED_AS = {}
_BFLOAT16 = []


def bfloat16():
    """ml_dtypes' bfloat16 as a numpy dtype. ml_dtypes is imported at the first call, not with
    hororing: its import costs about a second of CPU (it adds its many ufunc loops to numpy's
    one at a time), which every rank of a job without bfloat16 would pay at its start. Once it
    is loaded, ``np.dtype("bfloat16")`` names it, and DTYPE_NAMES and CARRIED_AS hold it."""
    if not _BFLOAT16:
        import ml_dtypes
        dtype = np.dtype(ml_dtypes.bfloat16)
        DTYPE_NAMES[dtype] = "bfloat16"
        CARRIED_AS[dtype] = np.dtype(np.uint16)
        _BFLOAT16.append(dtype)
    return _BFLOAT16[0]


def supported(dtype):
    """Whether the collectives take arrays of the numpy ``dtype`` (bfloat16's answered without
    importing ml_dtypes where nothing has: no array can be of it then)."""
    return dtype in DTYPE_NAMES or is_bfloat16(dtype)


def is_bfloat16(dtype):
    """Whether the numpy ``dtype`` is ml_dtypes' bfloat16; ml_dtypes is not imported for the
    answer where nothing has imported it (no array can be of its bfloat16 then)."""
    return dtype.kind == "V" and "ml_dtypes" in sys.modules and dtype == bfloat16()


@functools.cache  # numpy builds a dtype from its name in Python; the engine asks every call
def numpy_dtype(dtype):
    """``np.dtype(dtype)`` for a dtype or a name, bfloat16's name included before ml_dtypes is
    loaded (a rank that joined, or a server, makes arrays of a dtype it has only been told)."""
    if type(dtype) is str and dtype == "bfloat16":
        return bfloat16()
    return np.dtype(dtype)


@functools.cache
def torch_numpy_dtype(dtype):
    """numpy's dtype for a torch dtype (bfloat16 never gets here on a device: it travels as
    float32)."""
    return np.dtype(str(dtype).rsplit(".", 1)[-1])


def supported_dtypes():
    """Every dtype the collectives take, as numpy dtypes (loads bfloat16's)."""
    return tuple(numpy_dtype(name) for name in SUPPORTED_NAMES)


def __getattr__(name):  # ops.BFLOAT16, loaded where it is asked for
    if name == "BFLOAT16":
        return bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

# What each op reduces with on the wire; Average is a Sum followed by a division by size.
# Adasum is an algorithm of its own (algorithms/adasum.py), not an element-wise kernel.
KERNEL_OP = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "product",
             Adasum: "adasum"}


def op_name(op):
    """Return the Horovod name of ``op`` ("Sum", ...) or repr(op) when unknown."""
    return OP_NAMES.get(op, repr(op))


def is_floating(dtype):
    """Whether ``dtype`` is a floating dtype (numpy's kind "f", or bfloat16, whose kind numpy
    reports as "V")."""
    dtype = numpy_dtype(dtype)
    return dtype.kind == "f" or is_bfloat16(dtype)
