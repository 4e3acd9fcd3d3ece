"""Checkpoints in torch.distributed.checkpoint's (DCP's) format, each rank writing its part.

    hvd.checkpoint.save("ckpt/step100", model, optimizer, step=100, epoch=3)
    extra = hvd.checkpoint.load("ckpt/step100", model, optimizer)   # {"step": 100, "epoch": 3}
    handle = hvd.checkpoint.async_save("ckpt/step200", model, optimizer, step=200)
    ...                                                             # training goes on
    handle.wait()

Every call is collective: every rank calls it with its own model and optimizer. A sharded
optimizer's ranks each write their slice of its state and never hold the whole; what every
rank holds alike (the parameters, an unsharded optimizer's state) is written once. A load
works at any number of ranks: each reads its own slice of the state as the optimizer it is
given divides it. The directory is a DCP checkpoint keyed by parameter names, as
``torch.distributed.checkpoint.state_dict.get_state_dict`` keys a full state dict
(``states.py``); a process with neither MPI nor hororing reads it with ``dcp.load`` or
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``.

DCP plans over a torch.distributed process group: a ``hororing`` group of every rank, made
at the first call (``dist.init_process_group("hororing")`` first, where no default group
exists yet). A save is published whole or not at all (``files.py``).
"""

import copy
import os
import threading

import numpy as np

import torch

from . import direct, files, local_sgd, states
from .boxes import Boxes

__all__ = ["save", "load", "async_save", "AsyncSave", "save_optimizer", "load_optimizer"]

_GROUP = None  # (the default group it was made in, the group)
_PENDING = None  # the AsyncSave in flight
_NICE = 10  # an async save's writing thread's niceness (Linux: per thread)


def _group():
    """The process group DCP plans over: every rank, hororing's backend, used by checkpoints
    alone (an async save's thread runs its collectives there, beside training's)."""
    global _GROUP
    import torch.distributed as dist

    from ... import context
    if not dist.is_initialized():
        dist.init_process_group("hororing")
    if dist.get_world_size() != context.size():
        raise RuntimeError(
            f"torch.distributed's world has {dist.get_world_size()} processes, hororing's "
            f"{context.size()}: checkpoints need both to be the same ranks (start torch's "
            f"with dist.init_process_group('hororing'), or let a checkpoint call start it)")
    world = dist.group.WORLD
    if _GROUP is None or _GROUP[0] is not world:  # (again after a destroy_process_group)
        group = dist.new_group(backend="hororing")
        group.names_repeat = False  # a save's calls differ in size each time: kept uncached
        _GROUP = (world, group)
    return _GROUP[1]


def _to_save(group, model, optimizer, extra, names=None):
    """This rank's part of the checkpoint: its slices (LocalSGD's and DiLoCo's: its own
    entry), and its share of what is replicated."""
    import torch.distributed as dist
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if local_sgd.holds(optimizer):
        return local_sgd.to_save(model, optimizer, extra, rank, size)
    return states.share_replicated(states.to_save(model, optimizer, extra, names), rank, size)


def _check_optimizer(optimizer):
    """Refuse an optimizer of some ranks only, or one whose state differs from rank to rank,
    before any collective."""
    from ... import context
    from ...process_sets import group_of
    process_set = getattr(optimizer, "process_set", None)
    if process_set is not None and group_of(process_set).size != context.size():
        raise ValueError(
            f"a checkpoint holds an optimizer of every rank; this one's process_set has "
            f"{group_of(process_set).size} of the {context.size()} ranks. Save it with the "
            f"optimizer's own state_dict() instead")


def _agreed(group, problems, what):
    """Raise on every rank if any rank has ``problems`` (so no rank goes on alone into the
    collectives that follow)."""
    import torch.distributed as dist
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problems, group=group)
    found = []
    for rank, found_here in enumerate(everyone):
        for problem in found_here:
            if problem not in found:
                found.append(problem)
    if found:
        raise ValueError(f"{what}: " + "; ".join(found))


def _on_rank0(group, action):
    """Run ``action`` on rank 0; raise its error on every rank."""
    import torch.distributed as dist
    problems = []
    if dist.get_rank(group) == 0:
        try:
            problem = action()
            if problem:
                problems.append(problem)
        except OSError as error:
            problems.append(f"{type(error).__name__}: {error}")
    return problems


def _write(state, path, group, problems=()):
    """Write ``state`` at ``path`` (collective); ``problems``: this rank's reasons not to
    (an async save whose state changed before it was staged), raised on every rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from .planners import SavePlanner
    _agreed(group, list(problems) + _on_rank0(group, lambda: files.unwritable(path)),
            f"cannot save a checkpoint at {path}")
    _agreed(group, _on_rank0(group, lambda: files.begin(path)),
            f"cannot save a checkpoint at {path}")
    dcp.save(state, storage_writer=direct.writer(files.saving(path)),
             planner=SavePlanner(), process_group=group)
    _agreed(group, _on_rank0(group, lambda: files.publish(path)),
            f"cannot publish the checkpoint at {path}")
    dist.barrier(group=group)


def save(path, model, optimizer=None, **extra):
    """Write ``model``'s and ``optimizer``'s state and ``extra`` (picklable values, tensors)
    to the directory ``path`` (collective). A sharded optimizer's ranks write their own
    slices of its state. Replaces an earlier checkpoint at ``path`` once the new one is
    complete."""
    _check_optimizer(optimizer)
    wait_pending()
    group = _group()
    _write(_to_save(group, model, optimizer, extra), path, group)


def load(path, model, optimizer=None):
    """Read the checkpoint at ``path`` into ``model`` and ``optimizer`` (collective; any
    number of ranks, whatever number saved it) and return its ``extra`` values. A checkpoint
    of another model, one torn by a rank that stopped while saving, or an optimizer that does
    not fit raises ``ValueError`` naming what differs, on every rank, before anything is
    read."""
    return _load(path, model, optimizer)


def save_optimizer(path, optimizer):
    """``save`` of an optimizer alone, its parameters named by their position over its groups
    (as its own ``state_dict()`` numbers them): what hvd.elastic's ``TorchState`` commits
    of a sharded optimizer. Collective."""
    _check_optimizer(optimizer)
    wait_pending()
    group = _group()
    _write(_to_save(group, None, optimizer, {}, states.positional_names(optimizer)), path,
           group)


def load_optimizer(path, optimizer):
    """Read a ``save_optimizer`` checkpoint into ``optimizer`` (any number of ranks, any
    kind of optimizer over the same parameters in the same order). Collective."""
    _load(path, None, optimizer, states.positional_names(optimizer))


def _load(path, model, optimizer, names=None):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from .planners import LoadPlanner
    wait_pending()
    group = _group()
    problems, destination = [], None
    try:
        metadata = files.read_metadata(path)
        paths, storage = metadata.planner_data, metadata.state_dict_metadata
        if local_sgd.holds(optimizer):
            destination = local_sgd.Destination(model, optimizer, paths, storage,
                                               dist.get_rank(group), dist.get_world_size(group))
        elif local_sgd.saved_with(paths):
            raise ValueError(
                f"it was saved with {local_sgd.saved_with(paths)}, each rank's model and "
                f"optimizer state under its rank: load it with that optimizer, "
                f"hvd.checkpoint.load(path, model, optimizer)")
        else:
            destination = states.Destination(model, optimizer, paths, storage, names)
        problems = destination.problems
    except ValueError as error:
        problems = [str(error)]
    _agreed(group, problems, f"cannot load {path}")
    dcp.load(destination.tree, storage_reader=dcp.FileSystemReader(path),
             planner=LoadPlanner(), process_group=group)
    destination.apply()
    return destination.extra()


class AsyncSave:
    """An ``async_save`` in flight: ``wait()`` returns once it is published (raising what
    went wrong on any rank), ``done()`` says whether it has ended, ``staged()`` whether its
    copy of the state is complete (from then on nothing it saves is read from the model)."""

    def __init__(self, state, path, group, later):
        self.path = path
        self._error = None
        self._staged = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(state, path, group, later),
                                        name=f"hororing checkpoint {path}")
        self._thread.start()

    def _run(self, state, path, group, later):
        try:
            problems = _copy_later(later)
        finally:
            self._staged.set()
        try:  # training's threads come first where they share cores with this one
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
        except (AttributeError, OSError):
            pass
        try:
            _write(state, path, group, problems)
        except BaseException as error:  # raised by wait()
            self._error = error

    def done(self):
        return not self._thread.is_alive()

    def staged(self):
        return self._staged.is_set()

    def wait_staged(self):
        """Return once the state is copied to staging memory (an optimizer's step waits so,
        before it changes the parameters and its state)."""
        self._staged.wait()

    def wait(self):
        global _PENDING
        self._thread.join()
        if _PENDING is self:
            _PENDING = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def wait_pending():
    """Wait for the async save in flight, if any (every save and load does first)."""
    if _PENDING is not None:
        _PENDING.wait()


class _Staging:
    """Host memory an async save copies the state into, kept from save to save (a save of
    the same model reuses it: no fresh pages to fault in)."""

    def __init__(self):
        self.buffers = {}

    def copy(self, key, tensor, later=None):
        """``tensor``'s staging buffer, copied into now; or, where ``later`` (a list) is
        given and the tensor is in CPU memory, only made: (buffer, tensor, its version) is
        appended to ``later`` for ``_copy_later``."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = (torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                  pin_memory=True) if tensor.is_cuda else
                      direct.aligned_empty(tensor.shape, tensor.dtype))  # (written as it is)
            self.buffers[key] = buffer
        source = tensor.detach()
        if not source.is_cuda and source.is_contiguous() and source.layout == torch.strided:
            if later is not None:
                later.append((buffer, source, tensor._version))
            else:
                _memcpy(buffer, source)
        else:
            buffer.copy_(source, non_blocking=tensor.is_cuda)
        return buffer

    def stage(self, value, key=(), later=None, deferred=None):
        """A copy of ``value`` (a checkpoint's tree) in staging memory. ``later``: where
        ``deferred(tensor)`` is true, a CPU tensor's copy is left to ``_copy_later``."""
        if isinstance(value, dict):
            return {name: self.stage(item, key + (name,), later, deferred)
                    for name, item in value.items()}
        if isinstance(value, list):
            return [self.stage(item, key + (index,), later, deferred)
                    for index, item in enumerate(value)]
        if isinstance(value, Boxes):  # a sharded optimizer's state: changed by its step only
            boxes = iter(range(len(value.chunks)))
            return value.staged(lambda view: self.copy(
                key + (next(boxes),), view, later if deferred is not None else None))
        if torch.is_tensor(value):
            return self.copy(key, value, later if deferred is not None and deferred(value)
                             else None)
        return copy.deepcopy(value)


def _memcpy(buffer, source):
    # numpy's copy is a memcpy, without the GIL: a sharded Adam's state at 2 ranks staged at
    # 5.1-5.4 GB/s per rank on this 2-core VM, against 4.8-5.0 through torch's copy_
    np.copyto(_as_bytes(buffer), _as_bytes(source))


def _copy_later(later):
    """Copy what an async save left for its thread; return the problems found: a tensor
    changed in place (its version moved) since the call, which a save of the call's state
    cannot hold."""
    changed = 0
    for buffer, source, version in later:
        _memcpy(buffer, source)
        changed += source._version != version
    if not changed:
        return []
    return [f"{changed} tensor(s) of the model or optimizer changed in place after "
            f"async_save was called and before it had copied them (only the optimizer's "
            f"step() waits for the copy); call handle.wait_staged() before changing the "
            f"parameters or the optimizer's state outside step()"]


def _as_bytes(tensor):
    """A contiguous CPU tensor's memory as a flat uint8 numpy array (any dtype, bfloat16's
    too, which numpy does not have)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


_STAGING = _Staging()


def async_save(path, model, optimizer=None, **extra):
    """``save`` in the background, written by a thread while training goes on. Returns an
    ``AsyncSave``; a later save or load waits for it first. Collective.

    The save holds the state of the call. The model's buffers (a forward pass changes
    BatchNorm's statistics), ``extra``, the hyperparameters and CUDA tensors are copied to
    host staging memory before this returns. Given a torch optimizer, the parameters and its
    state, which its ``step()`` changes, are copied by the thread first, while training goes
    on: every optimizer's ``step()`` waits for that copy before it starts (a global step
    pre-hook). A tensor changed in place otherwise before it was copied fails the save on
    every rank, named; ``handle.wait_staged()`` waits for the copy. Without an optimizer,
    everything is copied in the call."""
    global _PENDING
    _check_optimizer(optimizer)
    wait_pending()
    group = _group()
    state = _to_save(group, model, optimizer, extra)
    parameters = set()
    if isinstance(optimizer, torch.optim.Optimizer):  # its step() runs the hook: deferred
        _hook_steps()
        parameters = {(parameter.data_ptr(), parameter.nbytes)
                      for parameter in (() if model is None else model.parameters())
                      if type(parameter.data) is torch.Tensor}  # (not a tensor subclass's)
    later = []
    deferred = {"model": lambda tensor: (tensor.data_ptr(), tensor.nbytes) in parameters}
    if parameters or isinstance(optimizer, torch.optim.Optimizer):
        deferred["optim"] = lambda tensor: True
    staged = {part: _STAGING.stage(value, (part,), later, deferred.get(part))
              for part, value in state.items()}
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the device-to-host copies into pinned staging
    _PENDING = AsyncSave(staged, path, group, later)
    return _PENDING


_HOOKED = []  # the step pre-hook's handle, once made


def _hook_steps():
    """Make every optimizer's step() wait for the state of an async save in flight to be
    staged (once per process; a step with nothing in flight pays one check)."""
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _HOOKED.append(register_optimizer_step_pre_hook(_wait_staged))


def _wait_staged(optimizer, args, kwargs):
    pending = _PENDING
    if pending is not None:
        pending.wait_staged()
