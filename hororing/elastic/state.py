"""Training state that can be committed, rolled back, synced, and carried across a relaunch.

``commit()`` copies the state aside (``save``) and, under hororun's elastic mode, writes that
copy to disk on every host (local rank 0 writes) before it checks for host updates, so the
newest commit outlives any rank. ``restore()`` rolls back to the last commit; ``sync()`` makes
every rank's state rank 0's.

A state that should outlive a relaunch says what a commit holds: ``snapshot()`` returns it (a
picklable object) and ``load_snapshot()`` takes it back. ``ObjectState`` and every binding's
state do; a custom ``State`` subclass defines both to be used under hororun's elastic mode.
"""

import copy
import sys

import numpy as np

from .. import collectives, context, objects, ops
from ..errors import HostsUpdatedInterrupt
from . import commits, job


class State:
    """Base of every elastic state (Horovod's ``horovod.common.elastic.State``).

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (default: hororing's).
        get_rank: returns this rank (default: hororing's).
    """

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object or objects.broadcast_object
        self._rank = get_rank or context.rank
        self._reset_callbacks = []
        self._notices_seen = 0
        self._commits = 0

    def register_reset_callbacks(self, callbacks):
        """Call each of ``callbacks`` (no arguments) after the job resumes at a new size."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Save the state, write it to disk under hororun's elastic mode, check for new hosts.

        Raises:
            HostsUpdatedInterrupt: on every rank at once, when hororun reported a host change.
        """
        self.save()
        self._commits += 1
        self._persist()
        self.check_host_updates()

    def check_host_updates(self):
        """Raise ``HostsUpdatedInterrupt`` on every rank if hororun reported a host change.

        Under hororun's elastic mode this is one small allreduce (every rank must call it);
        elsewhere the hosts cannot change and it returns at once.
        """
        if not job.supervised():
            return
        seen = np.array([job.notices()], dtype=np.int64)
        agreed = int(collectives.allreduce(seen, op=ops.Max, name="elastic.host_updates")[0])
        if agreed > self._notices_seen:
            self._notices_seen = agreed
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self):
        """Copy the state aside, to be restored by ``restore()``."""
        raise NotImplementedError(f"{type(self).__name__} must define save()")

    def restore(self):
        """Roll back to the last saved state."""
        raise NotImplementedError(f"{type(self).__name__} must define restore()")

    def sync(self):
        """Make every rank's state rank 0's."""
        raise NotImplementedError(f"{type(self).__name__} must define sync()")

    def reset(self):
        """Adjust to a new job size before the reset callbacks run (default: nothing)."""

    def lost_with_a_rank(self):
        """Why the last commit cannot be restored from the survivors' memory after a rank
        died, or None (default: every rank holds the whole state)."""
        return None

    def snapshot(self):
        """The last saved state as one picklable object (what a commit writes to disk)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot be written to disk: define snapshot() and "
            f"load_snapshot() to use it under hororun's elastic mode")

    def load_snapshot(self, snapshot):
        """Make ``snapshot`` (from ``snapshot()``) the saved state and restore it."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot be read from disk: define snapshot() and "
            f"load_snapshot() to use it under hororun's elastic mode")

    # -- across relaunches ------------------------------------------------------------------

    def _persist(self):
        """Write the last saved state to this host's disk (local rank 0 writes the commit
        file; every rank takes part in ``persisted_snapshot``)."""
        directory = job.directory()
        if directory is None:
            return
        snapshot = self.persisted_snapshot(directory, self._commits)
        if context.local_rank() == 0:
            commits.write(directory, self._commits, {"commits": self._commits,
                                                     "state": snapshot})

    def persisted_snapshot(self, directory, seq):
        """What commit ``seq``'s file holds (every rank calls it): ``snapshot()``, unless a
        part of the state writes itself beside the file in ``directory`` (collective)."""
        return self.snapshot()

    def _resume(self):
        """Load the newest commit that any host kept, on every rank. Collective.

        Returns the commit number, or -1 when no host has one (a fresh job).
        """
        directory = job.directory()
        if directory is None:
            return -1
        found, record = -1, None
        if context.local_rank() == 0:
            for name, size in commits.remove_temporaries(directory):
                sys.stderr.write(f"hororing.elastic: rank {context.rank()} dropped {name}, a "
                                 f"commit half-written when its writer died ({size} bytes)\n")
            found, record = commits.newest(directory, report=_skipped_commit)
        seqs = collectives.allgather(np.array([found], dtype=np.int64),
                                     name="elastic.newest_commit")
        newest = int(seqs.max())
        if newest < 0:
            return -1
        owner = int(np.flatnonzero(seqs == newest)[0])
        record = objects.broadcast_object(record if context.rank() == owner else None,
                                          root_rank=owner, name="elastic.commit")
        self.load_snapshot(record["state"])
        self._commits = record["commits"]
        if context.rank() == 0:
            sys.stderr.write(f"hororing.elastic: launch {job.launch()} with {context.size()} "
                             f"ranks resumed from commit {newest}, kept by rank {owner}'s "
                             f"host\n")
            sys.stderr.flush()
        return newest


class ObjectState(State):
    """State of plain Python objects, each a keyword argument exposed as an attribute.

    ``save()`` keeps deep copies, so a list appended to after a commit is rolled back too.
    """

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        super().__init__(bcast_object, get_rank)
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()

    def save(self):
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def snapshot(self):
        return dict(self._saved_state)

    def load_snapshot(self, snapshot):
        self._saved_state = dict(snapshot)
        self.restore()

    def _set_attrs(self):
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))


class StateHandler:
    """Saves, restores and syncs one framework object (a model, an optimizer, a sampler).

    Subclasses define ``capture()`` (a copy of the value's state), ``apply(saved)`` and
    ``sync()``.
    """

    def __init__(self, value):
        self.value = value
        self.saved = self.capture()

    def save(self):
        self.saved = self.capture()

    def restore(self):
        self.apply(self.saved)

    def set_value(self, value):
        self.value = value
        self.save()

    def capture(self):
        raise NotImplementedError

    def apply(self, saved):
        raise NotImplementedError

    def reset(self):
        """The job was made anew (another size): adjust the value (default: nothing)."""

    def lost_with_a_rank(self):
        """Why this value's commit does not survive a rank's death in the survivors' memory
        (each rank held only its part), or None (default: every rank holds it whole)."""
        return None

    def persisted(self, directory, seq, name):
        """What a commit file holds for this value (default: the saved copy). Every rank
        calls it, in the same order: a handler may write its own part beside the file."""
        return self.saved

    def sync(self):
        raise NotImplementedError


class HandledState(ObjectState):
    """An ``ObjectState`` whose framework objects have handlers (the bindings' states)."""

    def __init__(self, handlers, bcast_object=None, get_rank=None, **kwargs):
        object.__setattr__(self, "_handlers", dict(handlers))
        for name, handler in self._handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object, get_rank, **kwargs)

    def save(self):
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def reset(self):
        for handler in self._handlers.values():
            handler.reset()
        super().reset()

    def lost_with_a_rank(self):
        for name, handler in self._handlers.items():
            reason = handler.lost_with_a_rank()
            if reason is not None:
                return f"{name}: {reason}"
        return None

    def sync(self):
        for handler in self._handlers.values():
            handler.sync()
            handler.save()  # a restore() after the sync gives the synced values
        super().sync()

    def snapshot(self):
        return {"handlers": {name: handler.saved for name, handler in self._handlers.items()},
                "objects": super().snapshot()}

    def persisted_snapshot(self, directory, seq):
        return {"handlers": {name: handler.persisted(directory, seq, name)
                             for name, handler in self._handlers.items()},
                "objects": super().snapshot()}

    def load_snapshot(self, snapshot):
        for name, saved in snapshot["handlers"].items():
            if name in self._handlers:
                self._handlers[name].saved = saved
        super().load_snapshot(snapshot["objects"])  # restores the handlers' values too

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        object.__setattr__(self, name, value)


def _skipped_commit(path, problem):
    sys.stderr.write(f"hororing.elastic: warning: rank {context.rank()} skips commit file {path}: "
                     f"{problem}; resuming from the commit before it\n")
