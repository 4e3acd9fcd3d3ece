"""What workers and parameter servers say to each other: tags, the op and dtype tables, and
the order in which a server combines the pushes of one step.

PS messages travel on a communicator of their own, so their tags never meet the engine's.
Synchronous steps (the engine's allreduces) and asynchronous training (``AsyncPSOptimizer``)
share the servers, each with tags of its own.
"""

import numpy as np

from ...kernels import reduce_into

# synchronous allreduce: a header (sequence, op, dtype, count), the data, the reduced result
TAG_PUSH, TAG_DATA, TAG_RESULT = 301, 302, 303
# a worker leaves: cleanly, or failed (the payload is the message)
TAG_SHUTDOWN, TAG_FAILED = 304, 305
# asynchronous training: registration, gradient push, the server's reply and parameters
TAG_ASYNC_REGISTER, TAG_ASYNC_PUSH, TAG_ASYNC_DATA, TAG_ASYNC_REPLY, TAG_ASYNC_PARAMS = (
    306, 307, 308, 309, 310)

OPS = ("sum", "min", "max", "product")
DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
          "float32", "float64")
# the parameters an asynchronous server can hold and update with SGD
ASYNC_DTYPES = ("float32", "float64")


def push_header(sequence, op, dtype, count):
    """The header of one synchronous push."""
    return np.array([sequence, OPS.index(op), DTYPES.index(np.dtype(dtype).name), count],
                    dtype=np.int64)


def read_push_header(header):
    """``(sequence, op name, dtype name, count)`` of a received push header."""
    sequence, op, dtype, count = header.tolist()
    return sequence, OPS[op], DTYPES[dtype], count


def reduce_in_worker_order(arrived, op):
    """Reduce ``{worker position: data}`` in ascending worker order into a new array, so
    every server and every layout gives the same bits for the same pushes."""
    ordered = [arrived[worker] for worker in sorted(arrived)]
    result = ordered[0].copy()
    for data in ordered[1:]:
        reduce_into(result, data, op)
    return result
