"""Reduction operations, with Horovod's values so scripts may compare them directly."""

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
