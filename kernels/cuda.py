"""numba.cuda kernels: reduce, scale, fp16/bf16 conversion, fusion pack and unpack.

Every kernel walks its arrays with a grid-stride loop, so any launch size covers any length,
and takes the stream to run on (0: the default stream). bfloat16 is carried as uint16 bit
patterns; the float32 side of a conversion is passed as a uint32 view, so the kernels only
shift and round integers. Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the same
kernels run on the CPU, one Python thread per GPU thread, so launches there are kept small.
"""

import math

import numpy as np
from numba import cuda

SUM, MIN, MAX, PRODUCT = 0, 1, 2, 3
OP_CODES = {"sum": SUM, "min": MIN, "max": MAX, "product": PRODUCT}
_SIMULATED = bool(cuda.config.ENABLE_CUDASIM)
_THREADS = 32 if _SIMULATED else 256
_MAX_BLOCKS = 1 if _SIMULATED else 4096
GROUP = 32  # arrays per pack/unpack launch


def launch(count):
    """(blocks, threads) for ``count`` elements."""
    return max(1, min(_MAX_BLOCKS, math.ceil(count / _THREADS))), _THREADS


@cuda.jit
def _reduce(target, source, op):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, target.size, stride):
        a, b = target[i], source[i]
        if op == SUM:
            target[i] = a + b
        elif op == PRODUCT:
            target[i] = a * b
        elif op == MIN:
            if b < a or b != b:  # NaN wins, as in numpy.minimum
                target[i] = b
        elif b > a or b != b:
            target[i] = b


@cuda.jit
def _scale_float(buffer, factor):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, buffer.size, stride):
        buffer[i] = buffer[i] * factor


@cuda.jit
def _divide_float(buffer, divisor):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, buffer.size, stride):
        buffer[i] = buffer[i] / divisor


@cuda.jit
def _scale_integer(buffer, factor):
    # Horovod's integer scaling: in float64, truncated toward zero
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, buffer.size, stride):
        buffer[i] = math.trunc(buffer[i] * factor)


@cuda.jit
def _divide_trunc(buffer, divisor):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, buffer.size, stride):
        value = buffer[i]
        quotient = abs(value) // divisor
        buffer[i] = -quotient if value < 0 else quotient


@cuda.jit
def _scaled_cast(output, source, factor):
    # the store converts to output's dtype (float32 <-> float16)
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, output.size, stride):
        output[i] = source[i] * factor


@cuda.jit
def _to_bf16_bits(output, bits):
    # round to nearest even on the upper 16 bits; every NaN becomes the quiet NaN 0x7FC0
    # (compress.BF16_NAN, written out: this module is compiled apart from the host code)
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, output.size, stride):
        value = bits[i]
        if (value & 0x7F800000) == 0x7F800000 and (value & 0x007FFFFF) != 0:
            output[i] = 0x7FC0
        else:
            output[i] = (value + 0x7FFF + ((value >> 16) & 1)) >> 16


@cuda.jit
def _from_bf16_bits(bits, source):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, bits.size, stride):
        bits[i] = np.uint32(source[i]) << 16


@cuda.jit
def _pack(buffer, arrays, offsets):
    # block row y copies arrays[y] to buffer[offsets[y]:]
    which = cuda.blockIdx.y
    source, base = arrays[which], offsets[which]
    step = cuda.gridDim.x * cuda.blockDim.x
    for i in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, source.size, step):
        buffer[base + i] = source[i]


@cuda.jit
def _unpack(buffer, arrays, offsets):
    which = cuda.blockIdx.y
    target, base = arrays[which], offsets[which]
    step = cuda.gridDim.x * cuda.blockDim.x
    for i in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, target.size, step):
        target[i] = buffer[base + i]


def reduce_into(target, source, op_code, stream=0):
    _reduce[launch(target.size) + (stream,)](target, source, op_code)


def scale_into(buffer, factor, stream=0):
    if buffer.dtype.kind == "f":
        _scale_float[launch(buffer.size) + (stream,)](buffer, buffer.dtype.type(factor))
    else:
        _scale_integer[launch(buffer.size) + (stream,)](buffer, np.float64(factor))


def divide_into(buffer, divisor, stream=0):
    _divide_float[launch(buffer.size) + (stream,)](buffer, buffer.dtype.type(divisor))


def divide_trunc(buffer, divisor, stream=0):
    _divide_trunc[launch(buffer.size) + (stream,)](buffer, buffer.dtype.type(divisor))


def scaled_cast(output, source, factor, stream=0):
    """``output[...] = source * factor`` in the wider of the two dtypes, stored as output's."""
    wide = np.promote_types(output.dtype, source.dtype).type
    _scaled_cast[launch(output.size) + (stream,)](output, source, wide(factor))


def to_bf16_bits(output, bits, stream=0):
    _to_bf16_bits[launch(output.size) + (stream,)](output, bits)


def from_bf16_bits(bits, source, stream=0):
    _from_bf16_bits[launch(bits.size) + (stream,)](bits, source)


def pack(buffer, arrays, offsets, stream=0):
    """Copy 1-D ``arrays`` into ``buffer`` at element ``offsets``: one launch per GROUP arrays."""
    _grouped(_pack, buffer, arrays, offsets, stream)


def unpack(buffer, arrays, offsets, stream=0):
    """Copy ``buffer`` at element ``offsets`` back into the 1-D ``arrays``."""
    _grouped(_unpack, buffer, arrays, offsets, stream)


def _grouped(kernel, buffer, arrays, offsets, stream):
    # At most GROUP arrays per launch: kernel parameters stay far under CUDA's limit and
    # numba compiles at most GROUP variants per dtype; offsets go by value (no
    # host-to-device copy). numba marshals every array argument of every launch, which costs
    # tens of microseconds per array: docs/gpu.md has the measurement.
    for first in range(0, len(arrays), GROUP):
        group = tuple(arrays[first:first + GROUP])
        starts = tuple(offsets[first:first + GROUP])
        longest = max(array.size for array in group)
        blocks = max(1, min(_MAX_BLOCKS // len(group), math.ceil(longest / _THREADS)))
        kernel[(blocks, len(group)), _THREADS, stream](buffer, group, starts)
