"""Parameter-server allreduce: workers push to the server holding each tensor, servers reduce.

The same interface as the ring (``allreduce(buffer, op, finalize, segments)``), so the engine,
the collectives and DistributedOptimizer never branch on the mode. Two layouts:

- dedicated servers (``ServerClient`` here, ``serve`` on the server ranks): the last k ranks of
  the job hold the shards; every worker pushes its pieces, the server reduces them in worker
  order and sends the result to every worker, so results are identical on all workers. With
  ``replicas_to_aggregate`` r < workers, a server reduces the first r pushes of a step (still
  summed in worker order; an Average then divides by r), and drops and counts late pushes.
- colocated (``Colocated``): every rank is a worker and holds one shard; the push and the
  reply are direct messages between ranks.

Messages go over a communicator of their own; one push is a small header (sequence number,
op, dtype, element count) then the data.
"""

import logging

import numpy as np
from .._mpi import MPI

from .. import transport
from ..kernels import reduce_into
from . import ps_async
from .placement import Placement, bucket_plan

log = logging.getLogger("hororing")

TAG_PUSH, TAG_DATA, TAG_RESULT, TAG_SHUTDOWN, TAG_FAILED = 301, 302, 303, 304, 305
OPS = ("sum", "min", "max", "product")
DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
          "float32", "float64")


class ServerClient:
    """A worker's side of PS mode with dedicated servers (ranks ``servers`` of ``comm``)."""

    def __init__(self, comm, servers, placement, workers, replicas):
        self.comm = comm
        self.servers = list(servers)
        # an Average divides by the pushes a server aggregated
        self.contributors = replicas or workers
        self.placement = placement
        self.pushed_bytes = [0] * len(self.servers)
        self._sequence = [0] * len(self.servers)
        self._scratch = {}

    def allreduce(self, buffer, op, finalize=None, segments=None):
        """Reduce the flat ``buffer`` over all workers in place, through the servers."""
        plan = bucket_plan(self.placement, segments or [("", 0, buffer.size)], buffer.itemsize)
        messages = {server: _gather(buffer, ranges, self._scratch, server)
                    for server, ranges in plan.items()}
        sends = []
        for server, message in messages.items():
            header = np.array([self._sequence[server], OPS.index(op),
                               DTYPES.index(buffer.dtype.name), message.size],
                              dtype=np.int64)
            self._sequence[server] += 1
            self.pushed_bytes[server] += message.nbytes
            destination = self.servers[server]
            sends.append(self.comm.Isend(header, destination, TAG_PUSH))
            sends.append(self.comm.Isend(message, destination, TAG_DATA))
        # the results land in the pushed memory: post the receives once the pushes are out
        transport.wait_all(sends)
        receives = [self.comm.Irecv(message, self.servers[server], TAG_RESULT)
                    for server, message in messages.items()]
        transport.wait_all(receives)
        for server, message in messages.items():
            _scatter(message, buffer, plan[server])
        if finalize is not None:
            finalize(buffer)

    def close(self, failure=None):
        """Tell every server this worker is done (or failed, with the message)."""
        payload = np.frombuffer((failure or "").encode("utf-8", "replace"), dtype=np.uint8)
        tag = TAG_SHUTDOWN if failure is None else TAG_FAILED
        requests = [self.comm.Isend(payload, server, tag) for server in self.servers]
        transport.wait_all(requests)


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
    shard = ps_async.AsyncShard()  # used only by workers training asynchronously
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
        if tag == ps_async.TAG_REGISTER:
            header = np.empty(4, dtype=np.float64)
            comm.Recv(header, source, tag)
            shard.on_register(comm, source, worker_order[source], header)
            continue
        if tag == ps_async.TAG_PUSH:
            seen = np.empty(1, dtype=np.int64)
            comm.Recv(seen, source, tag)
            moved = shard.on_push(comm, source, int(seen[0]))
            stats["received_bytes"] += moved
            stats["sent_bytes"] += moved
            continue
        header = np.empty(4, dtype=np.int64)
        comm.Recv(header, source, TAG_PUSH)
        sequence, op, dtype, count = header.tolist()
        data = np.empty(count, dtype=DTYPES[dtype])
        comm.Recv(data, source, TAG_DATA)
        stats["received_bytes"] += data.nbytes
        if sequence <= completed:
            stats["dropped"] += 1  # a late replica: its step was already aggregated
            continue
        arrived = pending.setdefault(sequence, {})
        arrived[worker_order[source]] = data
        if len(arrived) < replicas:
            continue
        result = _reduce_in_worker_order(arrived, OPS[op])
        transport.wait_all(replies)
        replies = [comm.Isend(result, worker, TAG_RESULT) for worker in workers]
        stats["sent_bytes"] += result.nbytes * len(workers)
        stats["steps"] += 1
        completed = sequence
        del pending[sequence]
    transport.wait_all(replies)
    stats["async"] = shard.report()
    return None, stats


def _reduce_in_worker_order(arrived, op):
    ordered = [arrived[worker] for worker in sorted(arrived)]
    result = ordered[0].copy()
    for data in ordered[1:]:
        reduce_into(result, data, op)
    return result


class Colocated:
    """Every rank a worker and a server shard: pushes and replies are rank-to-rank messages."""

    def __init__(self, comm, placement):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.contributors = self.size
        self.placement = placement
        self.pushed_bytes = [0] * self.size
        self._scratch = {}
        self._incoming = {}

    def allreduce(self, buffer, op, finalize=None, segments=None):
        """Reduce the flat ``buffer`` over all ranks in place; rank s reduces shard s."""
        plan = bucket_plan(self.placement, segments or [("", 0, buffer.size)], buffer.itemsize)
        messages = {server: _gather(buffer, ranges, self._scratch, server)
                    for server, ranges in plan.items()}
        own = messages.get(self.rank)
        requests = []
        for server, message in messages.items():
            if server != self.rank:
                self.pushed_bytes[server] += message.nbytes
                requests.append(self.comm.Isend(message, server, TAG_DATA))
        pushes = []
        if own is not None:
            pushes = [self._incoming_buffer(worker, own) for worker in range(self.size)]
            requests += [self.comm.Irecv(pushes[worker], worker, TAG_DATA)
                         for worker in range(self.size) if worker != self.rank]
        transport.wait_all(requests)
        replies = []
        if own is not None:
            pushes[self.rank] = own
            result = _reduce_in_worker_order(dict(enumerate(pushes)), op)
            own[...] = result
            replies = [self.comm.Isend(own, worker, TAG_RESULT)
                       for worker in range(self.size) if worker != self.rank]
        receives = [self.comm.Irecv(message, server, TAG_RESULT)
                    for server, message in messages.items() if server != self.rank]
        transport.wait_all(receives + replies)
        for server, message in messages.items():
            _scatter(message, buffer, plan[server])
        if finalize is not None:
            finalize(buffer)

    def _incoming_buffer(self, worker, like):
        key = (worker, like.dtype.name)
        held = self._incoming.get(key)
        if held is None or held.size < like.size:
            held = self._incoming[key] = np.empty(like.size, dtype=like.dtype)
        return held[:like.size]

    def close(self, failure=None):
        """Nothing to tell: there are no server processes."""


def _gather(buffer, ranges, scratch, key):
    """Return the elements of ``ranges`` as one array: a view if contiguous, else a packed copy."""
    if len(ranges) == 1:
        start, stop = ranges[0]
        return buffer[start:stop]
    count = sum(stop - start for start, stop in ranges)
    held = scratch.get((key, buffer.dtype.name))
    if held is None or held.size < count:
        held = scratch[(key, buffer.dtype.name)] = np.empty(count, dtype=buffer.dtype)
    packed = held[:count]
    offset = 0
    for start, stop in ranges:
        packed[offset:offset + stop - start] = buffer[start:stop]
        offset += stop - start
    return packed


def _scatter(message, buffer, ranges):
    """Write a server's result back to the buffer's ranges (nothing to do for a view)."""
    if len(ranges) == 1:  # _gather returned a view: the result already landed in place
        return
    offset = 0
    for start, stop in ranges:
        buffer[start:stop] = message[offset:offset + stop - start]
        offset += stop - start


def new_placement(config, servers):
    """The Placement a PS client uses, from the config."""
    return Placement(servers, config.ps_placement, config.ps_partition_bytes)
