"""A flat buffer made of separate flat arrays, for algorithms that reduce it piece by piece.

The engine lays a bucket out this way where copying its large members into one fusion
buffer would cost more than it saves (``engine/segments.py``); the ring cuts its pieces at
``cuts``, so every piece it sends, receives or reduces is a view of one array.
"""

import bisect

import numpy as np


class Segmented:
    """A flat array made of separate flat arrays (one per segment, in order), sliced as one:
    ``buffer[start:stop]`` is a view of the one segment holding [start, stop), which must not
    cross a segment's end. ``cuts``: where segments meet."""

    def __init__(self, parts):
        self.parts = list(parts)
        self.dtype = self.parts[0].dtype
        self.itemsize = self.dtype.itemsize
        self._starts = np.cumsum([0] + [part.size for part in self.parts]).tolist()
        self.size = self._starts[-1]
        self.nbytes = self.size * self.itemsize
        self.cuts = tuple(self._starts[1:-1])

    def __getitem__(self, key):
        start, stop = key.start, key.stop
        index = bisect.bisect_right(self._starts, start) - 1
        offset = self._starts[index]
        if stop > self._starts[index + 1]:
            raise IndexError(f"elements [{start}, {stop}) cross the end of a segment at "
                             f"{self._starts[index + 1]}")
        return self.parts[index][start - offset:stop - offset]

    def map(self, function):
        """The same segments through ``function`` (e.g. MPI's view of each)."""
        return Segmented(function(part) for part in self.parts)
