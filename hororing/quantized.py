"""Changes sent as int8 with error feedback: what ``DiLoCo(int8=True)`` puts on the wire.

Each rank sends each tensor's change as one row of bytes: the float32 scale (the largest
magnitude over 127), then the change divided by it, rounded to int8: one byte per element,
a quarter of float32's. Summing int8 rows would overflow, so the rows are gathered, not
reduced: every rank turns every rank's row back into numbers and averages them in rank
order, so every rank gets the same bits. What rounding took from a change stays with its
rank and is added to that tensor's next change (error feedback): nothing is lost over the
syncs, only sent later.

A gathered row costs each rank (ranks - 1) bytes per element received, where a ring
allreduce of 16-bit values costs 4 (ranks - 1) / ranks: int8 halves 16-bit's bytes at 2
ranks, matches them at 4 and costs more beyond.
"""

import numpy as np

from . import collectives, ops

SCALE_BYTES = 4
LEVELS = 127


def _working(dtype):
    """The dtype a change is quantized and averaged in: float64 stays, the rest float32."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


class Int8Feedback:
    """One rank's rows and error feedback; ``residuals`` (key -> flat array) is its state."""

    def __init__(self):
        self.residuals = {}

    def encode(self, key, change):
        """``change`` (a numpy array) plus what rounding took from ``key``'s earlier
        changes, as one int8 row: the scale's 4 bytes, then the rounded values."""
        working = _working(change.dtype)
        wanted = np.asarray(change, dtype=working).reshape(-1)
        residual = self.residuals.get(key)
        if residual is not None and residual.shape == wanted.shape:
            wanted = wanted + residual
        peak = float(np.max(np.abs(wanted))) if wanted.size else 0.0
        scale = np.float32(peak / LEVELS) if peak > 0 else np.float32(1.0)
        rounded = np.clip(np.rint(wanted / working(scale)), -LEVELS, LEVELS)
        self.residuals[key] = wanted - rounded * working(scale)
        row = np.empty(SCALE_BYTES + wanted.size, dtype=np.int8)
        row[:SCALE_BYTES] = np.frombuffer(scale.tobytes(), dtype=np.int8)
        row[SCALE_BYTES:] = rounded
        return row

    @staticmethod
    def average(rows, shape, dtype):
        """The average of every rank's change from the gathered ``rows`` ((ranks, 4 + n)
        int8, in rank order), in ``shape`` and ``dtype``."""
        rows = np.asarray(rows).reshape(len(rows), -1)
        working = _working(dtype)
        scales = rows[:, :SCALE_BYTES].copy().view(np.float32).reshape(-1)
        total = np.zeros(rows.shape[1] - SCALE_BYTES, dtype=working)
        for row, scale in zip(rows, scales):
            total += row[SCALE_BYTES:].astype(working) * working(scale)
        total /= len(rows)
        return total.astype(dtype, copy=False).reshape(shape)

    def state_dict(self):
        return {key: value.copy() for key, value in self.residuals.items()}

    def load_state_dict(self, residuals):
        self.residuals = {key: np.array(value, copy=True) for key, value in residuals.items()}


def start_average(change, tag, compression, int8=None, key=None):
    """Start averaging this rank's ``change`` (a numpy array) over the ranks, as the
    collective ``tag``: its int8 row gathered where ``int8`` (an ``Int8Feedback``; ``key``
    names the residual the change adds to), else allreduced under ``compression``. Returns
    the handle and what ``finish_average`` needs with it."""
    if int8 is not None:
        row = int8.encode(key, change)
        return collectives.allgather_async(row[None], name=tag), (None, (change.shape,
                                                                         change.dtype))
    payload, context = compression.compress(change)
    return collectives.compressed_allreduce_async_(payload, compression, name=tag,
                                                   op=ops.Average), (compression, context)


def finish_average(handle, how):
    """The averaged change a ``start_average`` handle brings (``how``: what it returned with
    the handle)."""
    compression, context = how
    if compression is None:
        return Int8Feedback.average(collectives.synchronize(handle), *context)
    return compression.decompress(collectives.synchronize(handle), context)
