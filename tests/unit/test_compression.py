"""Compressors: each kind against an independent reference, on numpy, device (CUDA simulator)
and torch tensors; the wire dtype each one declares."""

import os

import numpy as np
import pytest

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from hororing.compression import (BF16Compressor, Compression, Compressor, FP16Compressor,  # noqa: E402
                                  NoneCompressor, wire_of)
from hororing.ops import BFLOAT16  # noqa: E402

# 70000 overflows float16: the casts warn, as numpy's own does
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

VALUES = np.array([0.0, -1.5, 3.14159, 65504.0, 1e-8, np.inf, -np.inf, 1 / 3, 70000.0],
                  dtype=np.float32)


def test_fp16_round_trip_is_numpys_cast():
    payload, ctx = FP16Compressor.compress(VALUES)
    assert payload.dtype == np.float16 and ctx == np.float32
    np.testing.assert_array_equal(payload, VALUES.astype(np.float16))
    restored = FP16Compressor.decompress(payload, ctx)
    assert restored.dtype == np.float32
    np.testing.assert_array_equal(restored, VALUES.astype(np.float16).astype(np.float32))


def test_bf16_rounds_as_torch_does():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    values = np.concatenate([VALUES, rng.normal(scale=1e3, size=1000).astype(np.float32)])
    payload, ctx = BF16Compressor.compress(values)
    assert payload.dtype == BFLOAT16 and payload.nbytes * 2 == values.nbytes  # half the bytes
    expected = torch.from_numpy(values).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(payload.astype(np.float32), expected)
    assert BF16Compressor.decompress(payload, ctx).dtype == np.float32


def test_float64_is_rounded_and_restored_to_float64():
    values = VALUES[:5].astype(np.float64)
    for kind in (FP16Compressor, BF16Compressor):
        payload, ctx = kind.compress(values)
        restored = kind.decompress(payload, ctx)
        assert restored.dtype == np.float64
        np.testing.assert_allclose(restored, values, rtol=1e-2, atol=1e-7)


@pytest.mark.parametrize("kind", [NoneCompressor, FP16Compressor, BF16Compressor])
def test_integers_travel_as_they_are(kind):
    values = np.arange(-5, 5, dtype=np.int32)
    payload, ctx = kind.compress(values)
    assert payload is values and ctx is None
    assert kind.decompress(payload, ctx) is values


def test_wire_dtypes():
    class Mine(Compressor):
        pass

    class DuckTyped:
        @staticmethod
        def compress(tensor):
            return tensor, None

    assert wire_of(Compression.fp16) == "float16"
    assert wire_of(Compression.bf16) == "bfloat16"
    assert wire_of(Compression.none) == ""
    assert wire_of(Mine) == "" and wire_of(DuckTyped) == ""


def test_fp16_on_a_device_array_stays_on_the_device():
    from numba import cuda
    device = cuda.to_device(VALUES)
    payload, ctx = FP16Compressor.compress(device)
    assert type(payload).__module__.startswith("numba") and payload.dtype == np.float16
    np.testing.assert_array_equal(payload.copy_to_host(), VALUES.astype(np.float16))
    restored = FP16Compressor.decompress(payload, ctx)
    np.testing.assert_array_equal(restored.copy_to_host(),
                                  VALUES.astype(np.float16).astype(np.float32))


def test_torch_kinds_match_the_numpy_kinds():
    torch = pytest.importorskip("torch")
    from hororing.torch.compression import Compression as TorchCompression
    tensor = torch.from_numpy(VALUES.copy())
    for name in ("fp16", "bf16"):
        torch_kind, numpy_kind = getattr(TorchCompression, name), getattr(Compression, name)
        assert issubclass(torch_kind, numpy_kind) and wire_of(torch_kind) == wire_of(numpy_kind)
        payload, ctx = torch_kind.compress(tensor)
        restored = torch_kind.decompress(payload, ctx)
        assert restored.dtype == torch.float32
        np.testing.assert_array_equal(
            restored.numpy(), numpy_kind.decompress(*numpy_kind.compress(VALUES)))
