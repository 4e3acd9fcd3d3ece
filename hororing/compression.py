"""Gradient compression: one interface, one implementation per kind, for every binding.

A compressor has ``compress(tensor) -> (payload, ctx)``, ``decompress(payload, ctx) ->
tensor`` and ``wire``: the dtype name its payload travels and is summed in between ranks
("" leaves the engine's own rule, under which float16 is summed in float32). The kinds here
work on numpy arrays and device arrays through ``kernels.compress``; the torch and
TensorFlow bindings subclass them with their framework's dtype test and casts (``floating``,
``is_target``, ``cast_to_target``, ``cast_back``), so each kind's rule is written once.

Example:
    >>> optimizer = hvd.DistributedOptimizer(hvd.SGD(params, lr=0.1),
    ...                                      compression=hvd.Compression.fp16)
"""

import numpy as np

from .kernels import from_bf16, from_fp16, to_bf16, to_fp16
from .ops import bfloat16, is_bfloat16, is_floating, numpy_dtype


class Compressor:
    """The interface; subclass it for a compressor of your own (its payload then travels as
    it is, unless it sets ``wire``)."""

    wire = ""

    @classmethod
    def compress(cls, tensor):
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """Send tensors as they are."""


class CastCompressor(Compressor):
    """Send floating tensors cast to ``target``; integers as they are. Each kind defines
    ``cast_to_target(tensor)`` and ``cast_back(tensor, dtype)``; a framework's subclass
    overrides those and ``floating(tensor)`` and ``is_target(tensor)``."""

    target = None  # the dtype name floating tensors are cast to

    @classmethod
    def compress(cls, tensor):
        if cls.floating(tensor) and not cls.is_target(tensor):
            return cls.cast_to_target(tensor), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else cls.cast_back(tensor, ctx)

    # in place, for a caller that keeps one payload per tensor across steps (the comm hooks):
    # the same bits as compress/decompress, without allocating the payload and the result
    @classmethod
    def payload_for(cls, tensor):
        """An uninitialized payload for ``tensor`` (None: this kind of tensor has no
        in-place path; use compress)."""
        if not isinstance(tensor, np.ndarray):
            return None
        return np.empty(tensor.shape, numpy_dtype(cls.target))

    @classmethod
    def compress_into(cls, tensor, payload):
        payload[...] = tensor

    @classmethod
    def decompress_into(cls, payload, tensor):
        tensor[...] = payload

    # numpy and device arrays (cupy, numba.cuda); bindings override these
    @staticmethod
    def floating(tensor):
        return is_floating(tensor.dtype)

    @classmethod
    def is_target(cls, tensor):
        return np.dtype(tensor.dtype) == np.dtype(cls.target)


class FP16Compressor(CastCompressor):
    """Send floating tensors as float16: half the bytes of float32 move between ranks.

    Each addition is computed in float32 and rounded to float16 between ranks; Average
    divides before summing, so the sum cannot overflow where the average would not. (Device
    arrays are summed in float32 on the device path.)
    """

    target = "float16"
    wire = "float16"

    @staticmethod
    def cast_to_target(tensor):
        payload = _empty_like(tensor, np.float16)
        to_fp16(tensor, payload)
        return payload

    @staticmethod
    def cast_back(tensor, dtype):
        output = _empty_like(tensor, dtype)
        from_fp16(tensor, output)
        return output

    @classmethod
    def compress_into(cls, tensor, payload):
        to_fp16(tensor, payload)

    @classmethod
    def decompress_into(cls, payload, tensor):
        from_fp16(payload, tensor)


class BF16Compressor(CastCompressor):
    """Send floating tensors as bfloat16 (float32's range, 8 mantissa bits): half the bytes
    of float32 move between ranks.

    As with fp16, each addition is computed in float32 and rounded to bfloat16 between
    ranks, and Average divides before summing. numpy arrays become ml_dtypes' bfloat16;
    device arrays (cupy and numba have no bfloat16) are rounded to bfloat16 values and
    travel as float32: on the device path this saves no bytes.
    """

    target = "bfloat16"
    wire = "bfloat16"

    @classmethod
    def is_target(cls, tensor):
        return is_bfloat16(np.dtype(tensor.dtype))

    @staticmethod
    def cast_to_target(tensor):
        if isinstance(tensor, np.ndarray):
            return tensor.astype(bfloat16())
        single = tensor if np.dtype(tensor.dtype) == np.float32 else tensor.astype(np.float32)
        bits = _empty_like(single, np.uint16)
        to_bf16(single, bits)
        rounded = _empty_like(single, np.float32)
        from_bf16(bits, rounded)
        return rounded

    @staticmethod
    def cast_back(tensor, dtype):
        return tensor if np.dtype(dtype) == np.dtype(tensor.dtype) else tensor.astype(dtype)


class Compression:
    """Horovod's names: ``Compression.none``, ``Compression.fp16``; plus ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


class FrameworkCasts:
    """How a framework's tensors meet the cast kinds: a subclass gives ``dtype_of(name)``
    (the framework's dtype of a numpy name), ``is_floating(dtype)`` and ``cast(tensor,
    dtype)``, and where its tensors can be written in place ``empty_like(tensor, dtype)``
    and ``copy_into(target, source)`` (a cast); ``framework_kinds`` mixes it into fp16 and
    bf16."""

    @classmethod
    def floating(cls, tensor):
        return cls.is_floating(tensor.dtype)

    @classmethod
    def is_target(cls, tensor):
        return tensor.dtype == cls.dtype_of(cls.target)

    @classmethod
    def cast_to_target(cls, tensor):
        return cls.cast(tensor, cls.dtype_of(cls.target))

    @classmethod
    def cast_back(cls, tensor, dtype):
        return cls.cast(tensor, dtype)

    empty_like = None  # empty_like(tensor, dtype), where the framework's tensors are mutable

    @classmethod
    def payload_for(cls, tensor):
        if cls.empty_like is None:
            return None
        return cls.empty_like(tensor, cls.dtype_of(cls.target))

    @classmethod
    def compress_into(cls, tensor, payload):
        cls.copy_into(payload, tensor)

    @classmethod
    def decompress_into(cls, payload, tensor):
        cls.copy_into(tensor, payload)


def framework_kinds(casts):
    """A framework's ``FP16Compressor``, ``BF16Compressor`` and ``Compression``: the kinds
    here, each rule written once, with ``casts`` (a ``FrameworkCasts``) for its tensors; named
    as in the framework's module, so they pickle by reference."""
    def kind(base):
        return type(base.__name__, (casts, base), {"__doc__": base.__doc__,
                                                    "__module__": casts.__module__,
                                                    "__qualname__": base.__name__})
    fp16, bf16 = kind(FP16Compressor), kind(BF16Compressor)
    namespace = type("Compression", (), {"__doc__": Compression.__doc__, "none": NoneCompressor,
                                         "fp16": fp16, "bf16": bf16,
                                         "__module__": casts.__module__})
    return fp16, bf16, namespace


def wire_of(compressor):
    """The wire dtype name of ``compressor``'s payloads ("" for a compressor that does not
    derive from ``Compressor``: its payload travels as it is)."""
    if isinstance(compressor, type) and issubclass(compressor, Compressor):
        return compressor.wire
    return compressor.wire if isinstance(compressor, Compressor) else ""


def _empty_like(array, dtype):
    """An uninitialized array of ``array``'s shape, library and device, in ``dtype``."""
    if isinstance(array, np.ndarray):
        return np.empty(array.shape, dtype=dtype)
    module = type(array).__module__
    if module.startswith("cupy"):
        import cupy

        return cupy.empty(array.shape, dtype=dtype)
    from numba import cuda

    return cuda.device_array(array.shape, dtype=dtype)
