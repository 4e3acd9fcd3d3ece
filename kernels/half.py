"""float16 arithmetic on host arrays through torch's kernels, where the process has imported
torch.

numpy computes float16 elementwise in scalar code, converting each element through float32,
and takes a slow path for subnormal values, which gradients are once divided by the ranks
(float16's smallest normal value is 6.1e-5): multiplying 16.8 M such float16 values took
561 ms here, normal ones 60 ms; torch's vectorized kernels take 4 ms either way. Both compute
each operation in float32 and round the result to float16, so the results are the same bits
(a factor is rounded to float16 first, as numpy does). bfloat16 (ml_dtypes) arrays take the
same route where asked. Only additions and multiplications go through torch: its division by a scalar multiplies by the reciprocal, which is not always
the correctly rounded quotient. torch is never imported here: a process
that has not imported it keeps numpy's kernels.
"""

import sys

import numpy as np

_HALF = np.dtype(np.float16)
_BFLOAT16 = "bfloat16"  # ml_dtypes' name; it has no numpy type of its own to compare to


def tensor(array, bfloat16=False):
    """A torch tensor over a float16 numpy ``array``'s memory, or None where there is none to
    use (another dtype or kind of array, or torch not imported). ``bfloat16``: ml_dtypes'
    bfloat16 arrays too, for additions (torch and ml_dtypes both add in float32 and round to
    nearest even, the same bits except a NaN's sign; numpy's loop for them is scalar, 5x
    slower here)."""
    if type(array) is not np.ndarray:
        return None
    dtype = array.dtype
    if dtype.itemsize != 2:  # before the name: numpy computes a dtype's name in Python (~2 us)
        return None
    is_bf16 = bfloat16 and dtype.kind == "V" and dtype.name == _BFLOAT16
    if dtype != _HALF and not is_bf16:
        return None
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "from_numpy"):
        return None
    if is_bf16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


_FLOAT32 = np.dtype(np.float32)
CASTS = (_HALF, _FLOAT32)  # the dtypes cast_into converts between


def cast_into(target, source):
    """Copy float32 ``source`` into float16 ``target`` or the reverse (numpy arrays of one
    shape) through torch's vectorized casts; False where it cannot (other dtypes or kinds
    of array, negative strides, torch not imported): numpy's cast is left to the caller.
    Both round to nearest even, subnormals and overflow included (numpy's casts between
    them are scalar here: 15-30 ms per 12.6 M elements, torch's 3-6)."""
    if type(target) is not np.ndarray or type(source) is not np.ndarray:
        return False
    if {target.dtype, source.dtype} != {_HALF, _FLOAT32} or target.shape != source.shape:
        return False
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "from_numpy") or not target.flags.writeable:
        return False
    if min(target.strides + source.strides, default=0) < 0:
        return False
    torch.from_numpy(target).copy_(torch.from_numpy(source))
    return True


def factor(value, dtype=_HALF):
    """``value`` as numpy applies it to an array of ``dtype``: rounded to that dtype."""
    return float(dtype.type(value))
