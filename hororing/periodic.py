"""What LocalSGD and DiLoCo share in every binding (``hororing.local_sgd`` for numpy arrays,
``hororing.torch.local_sgd`` for torch): the checks of their arguments, the cut of the
parameters into fragments, and when each fragment is synced.
"""


def check_every(sync_every):
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1 (the steps between syncs), got "
                         f"{sync_every!r}")


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
    """The positions of parameters of ``sizes`` elements in ``count`` runs of whole
    parameters, each about 1/count of the elements (every run at least one parameter)."""
    total = sum(sizes)
    runs, run, done = [], [], 0
    for position, size in enumerate(sizes):
        run.append(position)
        done += size
        left_runs = count - len(runs) - 1  # runs still to make after this one
        left_parameters = len(sizes) - position - 1
        if left_runs and (done >= total * (len(runs) + 1) / count
                          or left_parameters == left_runs):
            runs.append(run)
            run = []
    runs.append(run)
    return runs


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
