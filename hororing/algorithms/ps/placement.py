"""Which parameter server holds which tensor (or which part of it): a pure, cached plan.

Every worker sees the same tensors in the same order (negotiation makes the bucket order
identical), so every worker builds the same placement without talking.
"""

from ...config import PLACEMENTS
from ..plan import chunk_bounds


class Placement:
    """Assigns each tensor, the first time it is seen, to servers; remembers the choice.

    Args:
        servers: the number of server shards k.
        strategy: ``round_robin`` (tensor order), ``greedy_bytes`` (each tensor to the server
            holding the fewest bytes so far) or ``partitioned`` (tensors of at least
            ``partition_bytes`` split evenly over all servers, smaller ones greedy by bytes).
        partition_bytes: the size from which ``partitioned`` splits a tensor.
    """

    def __init__(self, servers, strategy="round_robin", partition_bytes=1 << 20):
        if strategy not in PLACEMENTS:
            raise ValueError(f"PS placement must be one of {PLACEMENTS}, got {strategy!r}")
        if servers < 1:
            raise ValueError(f"PS placement needs at least one server, got {servers}")
        self.servers = servers
        self.strategy = strategy
        self.partition_bytes = partition_bytes
        self.held_bytes = [0] * servers
        self._pieces = {}
        self._seen = 0

    def pieces(self, name, count, itemsize):
        """Return ``[(server, start, stop), ...]`` covering elements [0, count) of ``name``."""
        key = (name, count, itemsize)
        pieces = self._pieces.get(key)
        if pieces is None:
            pieces = self._pieces[key] = self._place(count, itemsize)
            for server, start, stop in pieces:
                self.held_bytes[server] += (stop - start) * itemsize
        return pieces

    def _place(self, count, itemsize):
        nbytes = count * itemsize
        index = self._seen
        self._seen += 1
        if self.strategy == "round_robin":
            return [(index % self.servers, 0, count)]
        if self.strategy == "partitioned" and nbytes >= self.partition_bytes and count > 1:
            return [(server, start, stop)
                    for server, (start, stop) in enumerate(chunk_bounds(count, self.servers))
                    if stop > start]
        lightest = min(range(self.servers), key=lambda server: (self.held_bytes[server], server))
        return [(lightest, 0, count)]


def bucket_plan(placement, segments, itemsize):
    """Group a fused bucket's pieces by server.

    Args:
        placement: a Placement.
        segments: ``[(name, start, stop)]``, the tensors of the bucket in buffer elements.
        itemsize: bytes per element.

    Returns:
        ``{server: [(buffer_start, buffer_stop), ...]}`` in buffer order, servers ascending.
    """
    ranges = {}
    for name, start, stop in segments:
        for server, piece_start, piece_stop in placement.pieces(name, stop - start, itemsize):
            ranges.setdefault(server, []).append((start + piece_start, start + piece_stop))
    return {server: _merge(ranges[server]) for server in sorted(ranges)}


def _merge(ranges):
    merged = []
    for start, stop in sorted(ranges):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return merged
