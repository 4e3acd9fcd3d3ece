"""16-bit gradient compression: float32 to float16 or bfloat16 and back.

``prescale`` divides before the cast (pass 1/size so a sum of fp16 values cannot overflow);
``postscale`` multiplies after widening. bfloat16, which numpy and cupy lack, is carried as
uint16 bit patterns (the upper half of a float32, rounded to nearest even).
"""

import numpy as np

from ._xp import NUMBA, array_module, backend, device_kernels


def to_fp16(source, output, prescale=1.0, stream=0):
    """``output[...] = float16(source * prescale)``; ``output`` is a float16 array."""
    _check(output, np.float16, "to_fp16 output")
    _scaled_cast(source, output, source.dtype.type(prescale), stream)


def from_fp16(source, output, postscale=1.0, stream=0):
    """``output[...] = widen(source) * postscale``."""
    _check(source, np.float16, "from_fp16 source")
    _scaled_cast(source, output, output.dtype.type(postscale), stream)


# Every NaN becomes this one quiet bfloat16 NaN: NVIDIA GPUs give arithmetic NaNs their own
# bit pattern (0x7FFFFFFF) where numpy keeps the input's, and the wire bits must not depend
# on where they were computed.
BF16_NAN = 0x7FC0


def to_bf16(source, output, prescale=1.0, stream=0):
    """Round float32 ``source * prescale`` to bfloat16 bits in the uint16 array ``output``."""
    _check(source, np.float32, "to_bf16 source")
    _check(output, np.uint16, "to_bf16 output (bfloat16 bits)")
    if backend(source) == NUMBA:
        kernels = device_kernels()
        if prescale != 1.0:
            from numba import cuda

            scaled = cuda.device_array(source.shape, np.float32, stream=stream)
            scaled.copy_to_device(source, stream=stream)
            kernels.scale_into(scaled, prescale, stream)
            source = scaled
        kernels.to_bf16_bits(output, source.view(np.uint32), stream)
        return
    xp = array_module(source)
    scaled = source * np.float32(prescale) if prescale != 1.0 else source
    bits = scaled.view(xp.uint32).astype(xp.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(xp.uint16)
    rounded[xp.isnan(scaled)] = BF16_NAN
    output[...] = rounded


def from_bf16(source, output, postscale=1.0, stream=0):
    """Widen bfloat16 bits (uint16 ``source``) into the float32 array ``output``."""
    _check(source, np.uint16, "from_bf16 source (bfloat16 bits)")
    _check(output, np.float32, "from_bf16 output")
    if backend(source) == NUMBA:
        kernels = device_kernels()
        kernels.from_bf16_bits(output.view(np.uint32), source, stream)
        kernels.scale_into(output, postscale, stream)
        return
    xp = array_module(source)
    output.view(xp.uint32)[...] = source.astype(xp.uint32) << 16
    if postscale != 1.0:
        xp.multiply(output, np.float32(postscale), out=output)


def round_to_fp16(buffer, stream=0):
    """Round the float32 ``buffer``'s values to float16 precision, in place (float16 tensors
    reduced in float32 pass through float16 where Horovod rounds them: after a prescale,
    before a postscale)."""
    _check(buffer, np.float32, "round_to_fp16 buffer")
    if backend(buffer) == NUMBA:
        from numba import cuda

        halves = cuda.device_array(buffer.shape, np.float16, stream=stream)
        device_kernels().scaled_cast(halves, buffer, np.float32(1.0), stream)
        device_kernels().scaled_cast(buffer, halves, np.float32(1.0), stream)
        return
    buffer[...] = buffer.astype(array_module(buffer).float16)


def _scaled_cast(source, output, factor, stream):
    """``output[...] = source * factor``, computed in ``factor``'s dtype, stored as output's."""
    if backend(source) == NUMBA:
        device_kernels().scaled_cast(output, source, factor, stream)
        return
    array_module(source).multiply(source, factor, out=output, casting="unsafe")


def _check(array, dtype, what):
    if array.dtype != dtype:
        raise TypeError(f"{what} must be {np.dtype(dtype).name}, got {array.dtype}")
