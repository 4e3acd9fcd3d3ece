"""A lone small allreduce that repeats, folded into the negotiation exchange.

A loop of blocking small allreduces runs one per cycle. Once the last two cycles that ran
anything each ran one lone allreduce of the same size on the latency path, the next cycle
starts with an allgather of rows (fields, data) instead of the vote: each rank's fields say
"folded" and the cache id of the one allreduce it has waiting, and its data is that
allreduce's contribution. When every rank's fields agree, the allreduce is complete in that
one exchange (the executor reduces the rows in rank order, as the latency path would);
otherwise the rows are discarded and the cycle goes on to the vote. Whether to fold is
decided from the responses alone, so every rank decides alike.
"""

import numpy as np

FIELDS = 2  # all ones (or 0: not this time), the cache id (or -1)
_HEAD = FIELDS * 8


class Fold:
    """The fold's state on one rank: whether the next cycle folds, and its buffers."""

    def __init__(self, exchange, executor):
        self._exchange_with = exchange  # the negotiation's (exchange.py)
        self.size = exchange.size
        self._executor = executor
        self.bytes = None  # the data bytes of the next cycle's rows (None: no fold)
        self._last_lone = None
        self._rows = None  # uint8 (size, head + bytes): every rank's row, gathered
        self._row = self._fields = None  # this rank's row, and its fields
        self._exchange = None  # the repeated allgather of the rows

    def predict(self, responses):
        """Fold the next cycle when this one and the last that ran anything each ran one
        lone allreduce of the same size that the latency path would take."""
        lone = None
        if len(responses) == 1:
            lone = self._executor.inline_bytes(responses[0])
        self.bytes = lone if lone is not None and lone == self._last_lone else None
        self._last_lone = lone

    def rows(self, waiting):
        """Fill this rank's row for the next exchange; return the array every rank's row is
        gathered into. ``waiting``: the one cached request this rank has waiting and may
        fold (None: this rank's row says "not this time"). The same cycle on every rank."""
        if self._rows is None or self._rows.shape[1] != _HEAD + self.bytes:
            self.free()  # rows of another size: a new exchange, made on every rank alike
            self._rows = np.empty((self.size, _HEAD + self.bytes), dtype=np.uint8)
            self._row = np.zeros(_HEAD + self.bytes, dtype=np.uint8)
            self._fields = self._row[:_HEAD].view(np.int64)
            self._exchange = self._exchange_with.repeated("allgather", self._row, self._rows)
        fields = self._fields
        if waiting is not None and self._executor.inline_contribution(waiting,
                                                                        self._row[_HEAD:]):
            fields[0], fields[1] = -1, waiting.cache_id
        else:
            fields[0], fields[1] = 0, -1  # a row of zeros is never agreed on
        return self._rows

    def exchange(self):
        """Start the allgather of the rows filled by ``rows``; the request to wait on."""
        return self._exchange.start()

    def free(self):
        if self._exchange is not None:
            self._exchange.free()
            self._exchange = None

    def agreed(self):
        """The cache id every rank folded in the gathered rows, or None if they did not all
        fold the same one (then the cycle goes on to the vote)."""
        if self._fields[0] != -1 or \
                self._rows[:, :_HEAD].tobytes() != self._row[:_HEAD].tobytes() * self.size:
            return None
        return int(self._fields[1])

    def data(self):
        """Every rank's contribution: (size, bytes) uint8."""
        return self._rows[:, _HEAD:]
