"""What the allreduce pipeline asks of every allreduce algorithm (``engine/allreduce.py``).

An algorithm reduces a flat buffer in place: ``allreduce(buffer, op, finalize=None,
segments=None[, source=None])``, where ``op`` is a kernel op name, ``finalize`` is applied
to each reduced piece, ``segments`` are the bucket's (name, start, stop) for algorithms that
go by tensor, and ``source`` (only where ``out_of_place``) is an input the algorithm reads
instead of first copying it into ``buffer``. ``contributors`` is the number of ranks whose
data a result holds (what Average divides by).
"""


class Algorithm:
    """Defaults for an allreduce algorithm."""

    out_of_place = False  # allreduce() takes source=

    def free(self, clean=True):
        """Release what it holds (communicators); after its last allreduce. ``clean`` False
        after a failure: nothing that waits for peers (a collective free) may run."""


def read_at_each_call(setting):
    """``setting`` (a value, or a function returning the value in effect) as a function: an
    algorithm reads its tunables (the sub-chunk) at each call, never holding one of its own."""
    return setting if callable(setting) else (lambda: setting)
