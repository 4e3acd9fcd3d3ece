"""The numba.cuda kernels against the numpy kernels (which test_kernels checks against numpy).

Runs in numba's CUDA simulator here (see conftest.py) and on a real GPU where
NUMBA_ENABLE_CUDASIM=0 and one is present. Arrays are small: the simulator runs every GPU
thread as a Python thread. Sizes are chosen not to be multiples of the launch width.
"""

import numpy as np
import pytest

numba_cuda = pytest.importorskip("numba.cuda")
from hororing import kernels  # noqa: E402

if not numba_cuda.is_available():
    pytest.skip("numba.cuda has neither a GPU nor the simulator", allow_module_level=True)

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]


def device(array):
    return numba_cuda.to_device(array)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "min", "max", "product"])
def test_device_reduce_matches_host(dtype, op):
    rng = np.random.default_rng(hash((dtype, op)) % 2**32)
    a = rng.integers(-3 if dtype[0] != "u" else 0, 4, 77).astype(dtype)
    b = rng.integers(-3 if dtype[0] != "u" else 0, 4, 77).astype(dtype)
    target = device(a)
    kernels.reduce_into(target, device(b), op)
    kernels.reduce_into(a, b, op)
    np.testing.assert_array_equal(target.copy_to_host(), a)


def test_device_min_max_propagate_nan_like_numpy():
    a = np.array([1.0, np.nan, 3.0, 2.0], dtype=np.float32)
    b = np.array([np.nan, 1.0, 2.0, 5.0], dtype=np.float32)
    for op in ("min", "max"):
        target = device(a)
        kernels.reduce_into(target, device(b), op)
        expected = a.copy()
        kernels.reduce_into(expected, b, op)
        np.testing.assert_array_equal(target.copy_to_host(), expected)


@pytest.mark.parametrize("dtype,factor", [("float32", 0.25), ("float64", 1 / 3), ("int32", 0.5),
                                          ("int64", 1.5)])
def test_device_scale_matches_host(dtype, factor):
    values = (np.arange(-20, 21) * 3).astype(dtype)
    target = device(values)
    kernels.scale_into(target, factor)
    kernels.scale_into(values, factor)
    np.testing.assert_array_equal(target.copy_to_host(), values)


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint16"])
def test_device_divide_trunc_matches_host(dtype):
    values = np.arange(-40 if dtype[0] != "u" else 0, 41).astype(dtype)
    target = device(values)
    kernels.divide_trunc(target, 3)
    kernels.divide_trunc(values, 3)
    np.testing.assert_array_equal(target.copy_to_host(), values)


def test_device_fp16_roundtrip_matches_host():
    source = np.linspace(-70000, 70000, 45, dtype=np.float32)
    wire, host_wire = numba_cuda.device_array(45, np.float16), np.empty(45, np.float16)
    kernels.to_fp16(device(source), wire, prescale=0.5)
    kernels.to_fp16(source, host_wire, prescale=0.5)
    np.testing.assert_array_equal(wire.copy_to_host(), host_wire)
    back, host_back = numba_cuda.device_array(45, np.float32), np.empty(45, np.float32)
    kernels.from_fp16(wire, back, postscale=2.0)
    kernels.from_fp16(host_wire, host_back, postscale=2.0)
    np.testing.assert_array_equal(back.copy_to_host(), host_back)


def test_every_nan_becomes_one_bf16_nan_on_host_and_device():
    # NVIDIA GPUs give NaN * x the pattern 0x7FFFFFFF; numpy keeps the input's payload and sign
    patterns = np.array([0x7FC00000, 0x7FFFFFFF, 0xFFC00001, 0x7F800001], dtype=np.uint32)
    source = patterns.view(np.float32)
    host_bits = np.empty(4, np.uint16)
    with np.errstate(invalid="ignore"):  # the signalling NaN
        kernels.to_bf16(source, host_bits, prescale=0.25)
    np.testing.assert_array_equal(host_bits, 0x7FC0)
    bits = numba_cuda.device_array(4, np.uint16)
    kernels.to_bf16(device(source), bits)
    np.testing.assert_array_equal(bits.copy_to_host(), 0x7FC0)


def test_device_bf16_roundtrip_matches_host():
    source = np.concatenate([np.linspace(-3e5, 3e5, 40, dtype=np.float32),
                             np.array([np.nan, np.inf, -0.0, 1.00390625], dtype=np.float32)])
    for prescale in (1.0, 0.25):
        bits, host_bits = numba_cuda.device_array(source.size, np.uint16), np.empty(source.size, np.uint16)
        kernels.to_bf16(device(source), bits, prescale=prescale)
        kernels.to_bf16(source, host_bits, prescale=prescale)
        np.testing.assert_array_equal(bits.copy_to_host(), host_bits)
    back, host_back = numba_cuda.device_array(source.size, np.float32), np.empty(source.size, np.float32)
    kernels.from_bf16(bits, back, postscale=4.0)
    kernels.from_bf16(host_bits, host_back, postscale=4.0)
    np.testing.assert_array_equal(back.copy_to_host(), host_back)


def test_device_pack_unpack_more_arrays_than_one_launch_takes():
    # 70 arrays: three launches of 32 (the last one padded), uneven and empty lengths
    arrays = [np.arange(n % 9, dtype=np.float64) + 10 * n for n in range(70)]
    total = sum(array.size for array in arrays)
    buffer = numba_cuda.to_device(np.full(total + 3, -1.0))
    ranges = kernels.pack([device(array) for array in arrays], buffer)
    host = buffer.copy_to_host()
    np.testing.assert_array_equal(host[:total], np.concatenate(arrays))
    np.testing.assert_array_equal(host[total:], -1.0)  # nothing written past the last range
    outputs = [numba_cuda.to_device(np.full(array.size, -2.0)) for array in arrays]
    kernels.unpack(buffer, ranges, outputs)
    for array, output in zip(arrays, outputs):
        np.testing.assert_array_equal(output.copy_to_host(), array)


def test_device_pack_unpack_in_one_launch_roundtrip():
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((0, 4), np.float32),
              np.array([9.0], np.float32), np.arange(40, dtype=np.float32) + 100]
    buffer = numba_cuda.device_array(50, np.float32)
    ranges = kernels.pack([device(array) for array in arrays], buffer)
    assert ranges == [(0, 6), (6, 6), (6, 7), (7, 47)]
    np.testing.assert_array_equal(buffer.copy_to_host()[:47],
                                  np.concatenate([array.reshape(-1) for array in arrays]))
    outputs = [numba_cuda.device_array(array.shape, np.float32) for array in arrays]
    kernels.unpack(buffer, ranges, outputs)
    for array, output in zip(arrays, outputs):
        np.testing.assert_array_equal(output.copy_to_host(), array)


def test_device_round_to_fp16_matches_host():
    values = np.random.default_rng(7).uniform(-70000, 70000, 33).astype(np.float32)
    on_device = device(values)
    kernels.round_to_fp16(on_device)
    host = values.copy()
    kernels.round_to_fp16(host)
    np.testing.assert_array_equal(on_device.copy_to_host(), host)
