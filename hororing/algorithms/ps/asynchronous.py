"""Asynchronous parameter servers: servers hold the parameters and apply each gradient on arrival.

The flat parameter vector is split into one contiguous shard per server. A worker pushes its
gradient shard to each server together with the server version it last pulled; the server
applies it at once with SGD (``lr``, optional ``momentum``), counts one server step, and
replies with the new parameters and the update's staleness: how many other updates reached
that server since this worker's copy was pulled. Workers never wait for each other, except
once: a server answers the registrations only when every worker has registered, so every
worker starts from worker 0's values and not from values that a faster worker's first pushes
have already moved.

Messages use tags of their own (``protocol``), so they never mix with the synchronous pushes
that the engine's allreduces (for example, the epoch metrics) send to the same servers; the
server's loop (``server.serve``) hands them to an ``AsyncShard``.
"""

import numpy as np

from ... import transport
from ..plan import chunk_bounds
from .protocol import (ASYNC_DTYPES, DTYPES, TAG_ASYNC_DATA, TAG_ASYNC_PARAMS, TAG_ASYNC_PUSH,
                       TAG_ASYNC_REGISTER, TAG_ASYNC_REPLY)


class AsyncClient:
    """A worker's side: ``register`` once, then ``push`` a gradient and get fresh parameters."""

    def __init__(self, comm, servers, worker):
        self.comm = comm
        self.servers = list(servers)
        self.worker = worker
        self.bounds = None
        self.versions = [0] * len(self.servers)
        self.staleness = []

    def register(self, params, lr, momentum):
        """Send the hyper-parameters (and worker 0's initial values); ``params`` gets the
        servers' values in place."""
        if params.dtype.name not in ASYNC_DTYPES:
            raise TypeError(f"asynchronous PS holds float32 or float64 parameters, got {params.dtype}")
        self.bounds = chunk_bounds(params.size, len(self.servers))
        sends = []
        for server, (start, stop) in zip(self.servers, self.bounds):
            header = np.array([stop - start, DTYPES.index(params.dtype.name), lr, momentum],
                              dtype=np.float64)
            sends += [self.comm.Isend(header, server, TAG_ASYNC_REGISTER),
                      self.comm.Isend(params[start:stop], server, TAG_ASYNC_DATA)]
        transport.wait_all(sends)
        # answered once every worker has registered: a stall here is a worker that never
        # made its optimizer
        with transport.activity("the asynchronous PS registration (the servers answer once "
                                "every worker has made its AsyncPSOptimizer)"):
            self._pull(params)

    def push(self, gradient, params):
        """Push ``gradient`` to every server; write the updated parameters into ``params``."""
        sends = []
        for index, (server, (start, stop)) in enumerate(zip(self.servers, self.bounds)):
            seen = np.array([self.versions[index]], np.int64)
            sends += [self.comm.Isend(seen, server, TAG_ASYNC_PUSH),
                      self.comm.Isend(gradient[start:stop], server, TAG_ASYNC_DATA)]
        transport.wait_all(sends)
        self._pull(params)

    def _pull(self, params):
        replies = [np.empty(2, dtype=np.int64) for _ in self.servers]
        requests = []
        for server, reply, (start, stop) in zip(self.servers, replies, self.bounds):
            requests += [self.comm.Irecv(reply, server, TAG_ASYNC_REPLY),
                         self.comm.Irecv(params[start:stop], server, TAG_ASYNC_PARAMS)]
        transport.wait_all(requests)
        stalest = -1
        for index, (version, staleness) in enumerate(reply.tolist() for reply in replies):
            self.versions[index] = version
            stalest = max(stalest, staleness)
        if stalest >= 0:  # one update, as stale as its stalest shard (-1: a registration)
            self.staleness.append(stalest)


class AsyncShard:
    """A server's side: its shard of the parameters and the SGD state, for ``workers``
    workers."""

    def __init__(self, workers):
        self.workers = workers
        self.params = None
        self.velocity = None
        self.lr = self.momentum = 0.0
        self.version = 0
        self.staleness = []
        self._waiting = []  # workers registered and not answered yet (until all have)
        self._incoming = None  # receive buffer for pushed gradients, reused

    def on_register(self, comm, source, worker, header):
        count, dtype, lr, momentum = header.tolist()
        values = np.empty(int(count), dtype=DTYPES[int(dtype)])
        comm.Recv(values, source, TAG_ASYNC_DATA)
        if worker == 0:
            self.params, self.velocity = values, np.zeros_like(values)
            self.lr, self.momentum = lr, momentum
        self._waiting.append(source)
        if self.params is not None and len(set(self._waiting)) >= self.workers:
            for waiting in self._waiting:
                self._reply(comm, waiting, -1)
            self._waiting = []

    def on_push(self, comm, source, seen_version):
        if self._incoming is None:
            self._incoming = np.empty_like(self.params)
        gradient = self._incoming
        comm.Recv(gradient, source, TAG_ASYNC_DATA)
        staleness = self.version - seen_version
        self.staleness.append(staleness)
        if self.momentum:
            self.velocity *= self.momentum
            self.velocity += gradient
            gradient = self.velocity
        self.params -= self.params.dtype.type(self.lr) * gradient
        self.version += 1
        self._reply(comm, source, staleness)
        return gradient.nbytes

    def _reply(self, comm, worker, staleness):
        # blocking sends: the next update must not change the values while they are in flight
        comm.Send(np.array([self.version, staleness], dtype=np.int64), worker, TAG_ASYNC_REPLY)
        comm.Send(self.params, worker, TAG_ASYNC_PARAMS)

    def report(self):
        if not self.staleness:
            return None
        values = np.array(self.staleness)
        return {"updates": self.version, "mean_staleness": float(values.mean()),
                "max_staleness": int(values.max())}
