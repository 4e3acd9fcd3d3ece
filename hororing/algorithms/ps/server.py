"""A dedicated parameter server's loop: aggregate the workers' pushes of each step.

For every synchronous step the server reduces the pushes in worker order and sends the result
to every worker, so results are identical on all workers. With ``replicas_to_aggregate`` r
below the number of workers it reduces the first r pushes of a step and drops (and counts)
late ones. The same loop answers asynchronous training (``asynchronous.AsyncShard``) on tags
of its own, and ends when every worker has shut down, or at once when one failed.
"""

import numpy as np

from ..._mpi import MPI
from ... import transport
from .asynchronous import AsyncShard
from .protocol import (TAG_ASYNC_PUSH, TAG_ASYNC_REGISTER, TAG_DATA, TAG_FAILED, TAG_PUSH,
                       TAG_RESULT, TAG_SHUTDOWN, read_push_header, reduce_in_worker_order)


def serve(comm, workers, replicas, index):
    """Run one server until every worker has shut down; return (failure message or None, stats).

    Args:
        comm: the PS communicator (workers and servers).
        workers: the workers' ranks in ``comm``, in worker order.
        replicas: pushes reduced per step (replicas_to_aggregate).
        index: this server's shard index (for reports).
    """
    worker_order = {rank: position for position, rank in enumerate(workers)}
    pending = {}
    completed = -1
    finished = set()
    stats = {"server": index, "steps": 0, "received_bytes": 0, "sent_bytes": 0, "dropped": 0}
    shard = AsyncShard(len(workers))  # used only by workers training asynchronously
    replies = []
    status = MPI.Status()
    while len(finished) < len(workers):
        transport.wait_until(lambda: comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status))
        source, tag = status.Get_source(), status.Get_tag()
        if tag in (TAG_SHUTDOWN, TAG_FAILED):
            message = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            comm.Recv(message, source, tag)
            if tag == TAG_FAILED:
                text = message.tobytes().decode("utf-8", "replace")
                return f"worker {worker_order[source]} failed: {text}", stats
            finished.add(source)
            continue
        if tag == TAG_ASYNC_REGISTER:
            header = np.empty(4, dtype=np.float64)
            comm.Recv(header, source, tag)
            shard.on_register(comm, source, worker_order[source], header)
            continue
        if tag == TAG_ASYNC_PUSH:
            seen = np.empty(1, dtype=np.int64)
            comm.Recv(seen, source, tag)
            moved = shard.on_push(comm, source, int(seen[0]))
            stats["received_bytes"] += moved
            stats["sent_bytes"] += moved
            continue
        header = np.empty(4, dtype=np.int64)
        comm.Recv(header, source, TAG_PUSH)
        sequence, op, dtype, count = read_push_header(header)
        data = np.empty(count, dtype=dtype)
        comm.Recv(data, source, TAG_DATA)
        stats["received_bytes"] += data.nbytes
        if sequence <= completed:
            stats["dropped"] += 1  # a late replica: its step was already aggregated
            continue
        arrived = pending.setdefault(sequence, {})
        arrived[worker_order[source]] = data
        if len(arrived) < replicas:
            continue
        result = reduce_in_worker_order(arrived, op)
        transport.wait_all(replies)
        replies = [comm.Isend(result, worker, TAG_RESULT) for worker in workers]
        stats["sent_bytes"] += result.nbytes * len(workers)
        stats["steps"] += 1
        completed = sequence
        del pending[sequence]
    transport.wait_all(replies)
    stats["async"] = shard.report()
    return None, stats
