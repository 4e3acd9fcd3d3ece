"""The workers' side of parameter-server allreduce: push to the server of each tensor.

Both classes have the ring's interface (``allreduce(buffer, op, finalize, segments)`` and
``contributors``), so the engine, the collectives and DistributedOptimizer never branch on
the mode. Two layouts:

- dedicated servers (``ServerClient``; ``server.serve`` runs on the server ranks): the last k
  ranks of the job hold the shards; every worker pushes its pieces, the server reduces them in
  worker order and sends the result to every worker, so results are identical on all workers.
  With ``replicas_to_aggregate`` r < workers, a server reduces the first r pushes of a step
  (an Average then divides by r).
- colocated (``Colocated``): every rank is a worker and holds one shard; the push and the
  reply are direct messages between ranks.

Each owns its communicator (the PS one) and frees it in ``close``.
"""

import numpy as np

from ... import transport
from ..base import Algorithm
from .asynchronous import AsyncClient
from .placement import Placement, bucket_plan
from .protocol import (TAG_DATA, TAG_FAILED, TAG_PUSH, TAG_RESULT, TAG_SHUTDOWN, push_header,
                       reduce_in_worker_order)


class ServerClient(Algorithm):
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
            header = push_header(self._sequence[server], op, buffer.dtype, message.size)
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

    def async_client(self, worker):
        """The client of asynchronous training through these servers, for worker ``worker``."""
        return AsyncClient(self.comm, self.servers, worker)

    def stats(self):
        return _stats(self)

    def close(self, failure=None):
        """Tell every server this worker is done (or failed, with the message); free the
        communicator."""
        payload = np.frombuffer((failure or "").encode("utf-8", "replace"), dtype=np.uint8)
        tag = TAG_SHUTDOWN if failure is None else TAG_FAILED
        requests = [self.comm.Isend(payload, server, tag) for server in self.servers]
        transport.wait_all(requests)
        self.comm.Free()


class Colocated(Algorithm):
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
            result = reduce_in_worker_order(dict(enumerate(pushes)), op)
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

    def async_client(self, worker):
        raise ValueError("asynchronous PS needs dedicated parameter servers, but this job's "
                         "shards are colocated: run with HORORING_PS_SERVERS=k (k >= 1), or "
                         "hvd.init(mode='ps', num_servers=k)")

    def stats(self):
        return _stats(self)

    def close(self, failure=None):
        """Free the communicator; there are no server processes to tell."""
        self.comm.Free()


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


def _stats(client):
    placement = client.placement
    return {"servers": len(placement.held_bytes), "placement": placement.strategy,
            "held_bytes": list(placement.held_bytes), "pushed_bytes": list(client.pushed_bytes),
            "contributors": client.contributors}


def new_placement(config, servers):
    """The Placement a PS client uses, from the config."""
    return Placement(servers, config.ps_placement, config.ps_partition_bytes)
