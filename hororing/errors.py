"""Exception types shared by the engine and the bindings."""


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank: a cross-rank mismatch, a stall, or a failed peer.

    Named as in Horovod so that ``except hvd.HorovodInternalError`` keeps working. The library
    stays usable after a mismatch; after a peer failure every later call raises this again.
    """


class PreconditionError(HorovodInternalError):
    """A collective refused on every rank before any data moved: the ranks disagree on its
    shape, dtype, op, root or kind, or it cannot run while ranks are inside ``join()``.

    Horovod reports these with its precondition status (TensorFlow raises them as
    ``tf.errors.FailedPreconditionError``); the job goes on after one.
    """


class NotInitializedError(ValueError):
    """A call needs ``hvd.init()`` first (ValueError, as Horovod raises)."""

    def __init__(self, what="hororing"):
        super().__init__(f"{what} has not been initialized; run hvd.init() first.")


class UnsupportedOpError(ValueError, RuntimeError):
    """A reduction op hororing does not implement (Adasum).

    Both a ValueError (hororing's error for a bad argument) and a RuntimeError (what
    Horovod raises for an op its reducescatter lacks), so either ``except`` catches it.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """The hosts of an elastic job changed: every rank raises it at the same commit.

    ``skip_sync`` is Horovod's hint that only hosts were removed, so the survivors need not
    sync their state again.
    """

    def __init__(self, skip_sync=False):
        super().__init__("the hosts of this elastic job changed")
        self.skip_sync = skip_sync


class RanksFailedError(HorovodInternalError):
    """A peer process died while the MPI kept the job alive (ULFM: Open MPI started with
    ``--with-ft ulfm``): every survivor's pending collectives fail with this error.

    ``ranks``: the ranks of the job this rank knows to have failed (may be empty on a rank
    that only saw a peer revoke the job). ``hvd.elastic.run`` goes on with the survivors;
    outside it the error is the caller's, and the job cannot run collectives again until it
    is re-initialized over the survivors. ``final``: the survivors cannot go on in process
    (too few for ``--min-np``, or state that died with the rank): they stop.
    """

    def __init__(self, message, ranks=(), final=False):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.final = final
