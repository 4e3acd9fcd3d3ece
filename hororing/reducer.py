"""Where a gradient bucket's life is decided, for every DistributedOptimizer: numpy's and
torch's, and torch's sharded one (whose buckets are reduce-scattered when ready).

A ``Reducer`` keeps, for one optimizer, what is the same whatever the framework:

- which gradients make a bucket that starts whole (``take_buckets``; a comm hook's buckets,
  a flat bucket reduced as one tensor, every CUDA bucket), and the bucket's name
  (``bucket_name``), index and whether it is the last;
- how many backward passes each gradient has seen since the last step, and whether it is
  ready: alone, or as the bucket it completes (``ready``), refusing a gradient computed
  twice before a step;
- when the buckets are laid out again (``relayout_due``: the first step, and whenever the
  route changes, e.g. the autotuner's fusion threshold), by what size (``bucket_bytes``)
  and in what order (``order``: as the engine reduces them);
- the comm hook, if one is registered: checked against the optimizer's op and compression,
  handed each whole bucket (``dispatch``), its state saved and restored with the
  optimizer's.

The bindings keep only what touches their tensors: making the flat buffers and the views
into them, registering the backward hooks, and starting a bucket or a gradient through the
verbs. Every rank lays out and names its buckets alike, so each is matched by its name.
"""

import numbers

from .comm_hooks import GradBucket, check_hook
from .process_sets import group_of


def check_passes(backward_passes_per_step):
    """The number of backward passes per step, checked: an int >= 1. Returns it."""
    value = backward_passes_per_step
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {value!r}")
    return int(value)


def bucket_name(names):
    """The name a bucket of the gradients ``names`` (in bucket order) is reduced under: the
    same on every rank that lays the bucket out alike, and different for another layout."""
    return f"bucket.{names[0]}..{names[-1]}.{len(names)}"


class Bucket:
    """A bucket that starts whole once all its gradients are in: its ``members`` (the keys
    the binding gave, in bucket order), its ``flat`` buffer, its ``name``, its ``index``
    among the optimizer's buckets, and whether it is the ``last``. Hashed by identity."""

    __slots__ = ("members", "flat", "name", "index", "last")

    def __init__(self, members, flat, name, index, last):
        self.members, self.flat, self.name, self.index, self.last = (
            members, flat, name, index, last)


class Reducer:
    """One optimizer's buckets and ready-counting (see the module's docstring).

    Args:
        name_of: key -> the name its gradient is reduced under (a dict; the binding's keys:
            parameter tensors, or gradient names).
        backward_passes_per_step: passes counted per gradient before it is ready.
        process_set: whose engine lays the buckets out (its route and its reduction order).
    """

    def __init__(self, name_of, backward_passes_per_step=1, process_set=None):
        self.name_of = name_of
        self.passes = check_passes(backward_passes_per_step)
        self.process_set = process_set
        self._counts = {}   # key -> backward passes seen since the last step
        self._whole = {}    # key -> the Bucket it starts with
        self._held = {}     # Bucket -> the keys of it that are in, while some are not
        self.whole_bytes = None  # the bucket size whole buckets were laid out for
        self._laid_out_for = None  # the route version of the last layout (None: none yet)
        self._group = None  # the process set's Group, found at the first use
        self.hook = None  # (state, hook) where a comm hook reduces the buckets

    def _engine(self):
        if self._group is None:
            self._group = group_of(self.process_set)
        return self._group.engine

    def batch(self):
        """``with reducer.batch():`` what this thread starts inside is announced together."""
        return self._engine().batch()

    # ---- the layout -----------------------------------------------------------------------

    def bucket_bytes(self, hooked):
        """The most bytes one bucket holds: smaller where buckets start whole (``hooked``),
        so that the first ones travel while backward goes on."""
        return self._engine().route.bucket_bytes(hooked=hooked)

    def fusion_threshold(self):
        """The fusion threshold in effect: what buckets reduced gradient by gradient hold."""
        return self._engine().route.fusion_threshold

    def order(self, keys):
        """``keys`` in the order a cycle reduces their gradients (by their names)."""
        by_name = {self.name_of[key]: key for key in keys}
        return [by_name[name] for name in self._engine().reduction_order(list(by_name))]

    def relayout_due(self):
        """True when the route has changed since the last ``laid_out`` (or there was none)."""
        return self._laid_out_for != self._engine().route.version

    def laid_out(self):
        """The buckets are laid out for the route in effect now."""
        self._laid_out_for = self._engine().route.version

    def take_buckets(self, buckets, whole, whole_bytes=None, update=False):
        """Take the laid-out ``buckets`` ([(members, flat)], in order); those for which
        ``whole(members)`` is true start whole. ``update``: add to the buckets held (a new
        parameter group, a part laid out again), else replace them all. Returns the Bucket
        of each whole one, in order."""
        if not update:
            self._whole, self._held = {}, {}
        taken = []
        for index, (members, flat) in enumerate(buckets):
            if whole(members):
                names = [self.name_of[key] for key in members]
                bucket = Bucket(tuple(members), flat, bucket_name(names), index,
                                index == len(buckets) - 1)
                self._whole.update(dict.fromkeys(members, bucket))
                taken.append(bucket)
        if taken:
            self.whole_bytes = whole_bytes
        return taken

    def forget(self, keys):
        """Let the buckets of ``keys`` go (they are about to be laid out again)."""
        for key in keys:
            self._whole.pop(key, None)

    def bucket_of(self, key):
        """The whole Bucket ``key`` starts with, or None (it starts alone)."""
        return self._whole.get(key)

    # ---- the comm hook --------------------------------------------------------------------

    def register_hook(self, state, hook, op, uncompressed):
        """Reduce every bucket with ``hook(state, bucket)`` from now on (checked against the
        optimizer's ``op``, and whether it compresses: ``comm_hooks.check_hook``)."""
        check_hook(hook, op, uncompressed)
        self.hook = (state, hook)

    def dispatch(self, bucket, tensor, array, parameters, shapes, reduction, binding):
        """Hand the whole ``bucket`` to the hook as a ``GradBucket`` over its flat ``tensor``
        (``array``: the same memory as the engine takes it) and return what the hook
        returned: something whose ``wait()`` gives the reduced flat vector."""
        state, hook = self.hook
        result = hook(state, GradBucket(bucket.index, bucket.name, tensor, array, shapes,
                                        parameters, reduction, binding, last=bucket.last))
        if not hasattr(result, "wait"):
            raise TypeError(f"a comm_hook returns something with wait() that gives the reduced "
                            f"bucket (hororing.comm_hooks.Pending, a torch.futures.Future); "
                            f"{hook!r} returned {type(result).__name__}")
        return result

    def hook_state(self):
        """The hook's own state (PowerSGD's), where it has one: {"comm_hook": ...}, else {}."""
        hook = self.hook[1] if self.hook is not None else None
        return {"comm_hook": hook.state_dict()} if hasattr(hook, "state_dict") else {}

    def load_hook_state(self, state):
        """Restore what ``hook_state`` gave (ignored where the hook keeps none)."""
        hook = self.hook[1] if self.hook is not None else None
        if "comm_hook" in state and hasattr(hook, "load_state_dict"):
            hook.load_state_dict(state["comm_hook"])

    # ---- a step's passes ------------------------------------------------------------------

    def ready(self, key, started):
        """A backward pass produced ``key``'s gradient. Returns what is ready to start: None
        (more passes to come, or its bucket waits for others), ``key`` itself (it starts
        alone) or its Bucket (now complete). ``started``: the binding has started ``key``
        since the last step (then this is a second gradient: refused)."""
        bucket = self._whole.get(key)
        if started or (bucket is not None and key in self._held.get(bucket, ())):
            raise RuntimeError(
                f"the gradient of '{self.name_of[key]}' was computed more than "
                f"backward_passes_per_step={self.passes} times before step(); call step() "
                f"after that many backward passes, or raise backward_passes_per_step")
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        if count != self.passes:
            return None
        if bucket is None:
            return key
        held = self._held.setdefault(bucket, set())  # tensors hash by identity
        held.add(key)
        if len(held) < len(bucket.members):
            return None
        del self._held[bucket]
        return bucket

    def forget_step(self):
        """A step's collectives failed: nothing counted or held is going on; the process set
        is looked up again at the next use (the job may have been made anew)."""
        self._counts.clear()
        self._held.clear()
        self._group = None

    def step_done(self):
        """Every gradient has been reduced, or the gradients were zeroed: the passes count
        from the next backward pass again."""
        self._counts.clear()
        self._held.clear()
