"""What LocalSGD and DiLoCo share in every binding (``hororing.local_sgd`` for numpy arrays,
``hororing.torch.local_sgd`` for torch, ``hororing.tensorflow.keras.local_sgd``'s callbacks):
the checks of their arguments, the cut of the parameters into fragments, and when each
fragment is synced.
"""


def check_every(sync_every):
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1 (the steps between syncs), got "
                         f"{sync_every!r}")


def check_sent(compression, int8, none, fp16, bf16, who="DiLoCo", spelled="Compression"):
    """DiLoCo's changes go in full (``none``), in 16 bits (``fp16``, ``bf16``: the binding's
    own Compression's), or with ``int8`` as int8 rows, uncompressed: a clear error on
    anything else. ``who``: the class the user made; ``spelled``: how its users write the
    binding's Compression. Returns the compression, None taken as ``none``."""
    compression = compression or none
    if compression is not none and compression is not fp16 and compression is not bf16:
        raise ValueError(f"{who} sends its changes with {spelled}.none, .fp16 or .bf16; got "
                         f"{compression!r}")
    if int8 and compression is not none:
        raise ValueError(f"{who}'s int8=True sends int8 rows: leave compression at "
                         f"{spelled}.none")
    return compression


def check_warmup(warmup_steps):
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or \
            warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")


def check_fragments(fragments, parameters):
    """``fragments`` must be an integer from 1 to ``parameters`` (the count of trained ones)."""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or \
            not 1 <= fragments <= parameters:
        raise ValueError(f"fragments must be an integer from 1 to the model's {parameters} "
                         f"trained parameters (a fragment holds whole parameters), got "
                         f"{fragments!r}")


def cut(sizes, count):
    """The positions of parameters of ``sizes`` elements in ``count`` fragments of whole
    parameters (every fragment at least one), balanced: the largest parameter first, each to
    the fragment with the fewest elements so far. No fragment holds more than 1/count of the
    elements plus its largest parameter, so one larger than 1/count of the model fills a
    fragment alone. A fragment mixes parameters of every depth; each is listed in the model's
    order, and the fragments in the order of their first parameter."""
    runs = [[] for _ in range(count)]
    loads = [0] * count
    for position in sorted(range(len(sizes)), key=lambda position: -sizes[position]):
        # an empty fragment before a non-empty one of the same load (parameters of 0 elements)
        target = min(range(count), key=lambda index: (loads[index], len(runs[index]), index))
        runs[target].append(position)
        loads[target] += sizes[position]
    return sorted((sorted(run) for run in runs), key=lambda run: run[0])


class Schedule:
    """When each of ``count`` fragments is synced: fragment f after the steps (1, 2, ...)
    where ``step % every == (f + 1) * every // count % every``, so the syncs are spread over
    the ``every`` steps; and after which step each fragment was last synced (0: not yet),
    with ``sync_now``'s syncs off the schedule counted."""

    def __init__(self, every, count):
        self.every = every
        self.offsets = [(index + 1) * every // count % every for index in range(count)]
        self.synced_at = [0] * count

    def due(self, steps):
        """The fragments synced by the schedule after step ``steps``."""
        return [index for index, offset in enumerate(self.offsets)
                if steps % self.every == offset]

    def synced(self, index, steps):
        self.synced_at[index] = steps

    def unsynced(self, steps):
        """The fragments not synced after step ``steps``."""
        return [index for index, at in enumerate(self.synced_at) if at != steps]

    def restore(self, steps, synced_at=None):
        """Resume after step ``steps``: ``synced_at`` as saved, or where the schedule alone
        put each fragment's last sync (a state saved without it)."""
        if synced_at is None:
            synced_at = []
            for offset in self.offsets:
                step = steps - (steps - offset) % self.every
                synced_at.append(step if step >= 1 else 0)
        if len(synced_at) != len(self.offsets):
            raise ValueError(f"the state was saved with {len(synced_at)} fragments, this "
                             f"optimizer has {len(self.offsets)}")
        self.synced_at = list(synced_at)
