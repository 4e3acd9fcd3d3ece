"""Reduction operations, with Horovod's values so scripts may compare them directly, and the
dtypes the collectives carry: a leaf every floor may read."""

import ml_dtypes
import numpy as np

# bfloat16 (float32's range, 8 mantissa bits) as a numpy dtype: ml_dtypes registers it, so
# np.dtype("bfloat16") names it from here on
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# what every collective takes (numpy's names; the bindings map their own dtypes onto these)
SUPPORTED_DTYPES = tuple(np.dtype(name) for name in (
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "float32", "float64")) + (BFLOAT16,)
# numpy computes dtype.name in Python on every access; the hot path looks it up here
DTYPE_NAMES = {dtype: dtype.name for dtype in SUPPORTED_DTYPES}

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
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype == BFLOAT16
