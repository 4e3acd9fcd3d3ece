"""``TorchState``: models, optimizers and samplers committed, restored, synced and saved."""

import copy
import os
import shutil
import uuid

import torch

from ... import context
from ...elastic import commits
from ...elastic.state import HandledState, StateHandler
from .. import checkpoint, functions
from ..sharded import ShardedOptimizer
from .sampler import ElasticSampler


class _StateDictHandler(StateHandler):
    """An object with ``state_dict()``/``load_state_dict()``, saved as a deep copy."""

    def capture(self):
        return copy.deepcopy(self.value.state_dict())

    def apply(self, saved):
        # a copy: torch's Optimizer.load_state_dict keeps the tensors it is given, and its
        # steps would then change the commit a later restore() returns to
        self.value.load_state_dict(copy.deepcopy(saved))


class ModelStateHandler(_StateDictHandler):
    def sync(self):
        functions.broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    def sync(self):
        functions.broadcast_optimizer_state(self.value, root_rank=0)

    def restore(self):
        forget = getattr(self.value, "_forget_step", None)  # DistributedOptimizer's
        if forget is not None:
            forget()
        super().restore()

    def reset(self):
        rejoin = getattr(self.value, "_rejoin", None)
        if rejoin is not None:
            rejoin()


class ShardedOptimizerStateHandler(OptimizerStateHandler):
    """A sharded optimizer (``DistributedOptimizer(sharded=...)``, ``ZeroRedundancyOptimizer``):
    a commit copies this rank's slices of the state, and nothing is gathered.

    Written to disk (hororun's elastic mode), every rank writes its slices into a checkpoint
    (``hvd.checkpoint.save_optimizer``) beside the commit file, and a launch at any size reads
    its own slices back from it. That needs the elastic directory to be one that every rank
    sees; where it is not (each host its own disk), the commit holds the gathered state, as
    a commit of one host's file must."""

    def capture(self):
        inner = self.value._optimizer.state_dict()
        return {"slices": copy.deepcopy(inner), "layout": self._layout()}

    def lost_with_a_rank(self):
        return ("a sharded optimizer's commit holds each rank's slices of its state, and a dead "
                "rank's slices are gone with it")

    def _layout(self):
        group = self.value._group
        return (group.size, group.rank)

    def apply(self, saved):
        if "slices" in saved and saved["layout"] == self._layout():
            self.value._optimizer.load_state_dict(copy.deepcopy(saved["slices"]))
        elif "slices" in saved:
            raise RuntimeError(
                f"a sharded optimizer's commit in memory holds the slices of rank "
                f"{saved['layout'][1]} of {saved['layout'][0]}; this is rank "
                f"{self._layout()[1]} of {self._layout()[0]}. A job at another size resumes "
                f"from the commit on disk (hororun's elastic mode)")
        elif "checkpoint" in saved:
            checkpoint.load_optimizer(saved["checkpoint"], self.value)
            self.saved = self.capture()
        else:  # the gathered state (a commit written where ranks do not share a disk)
            self.value.load_state_dict(copy.deepcopy(saved["full"]))
            self.saved = self.capture()

    def persisted(self, directory, seq, name):
        """What the commit file holds for this optimizer (collective: every rank calls it)."""
        if not _shared(directory):
            return {"full": self.value.state_dict()}
        path = os.path.join(directory, f"commit-{seq:010d}.{name}.shards")
        checkpoint.save_optimizer(path, self.value)
        if context.rank() == 0:  # the shards of commits older than the kept ones
            for entry in os.listdir(directory):
                if entry.endswith(f".{name}.shards") and entry.startswith("commit-"):
                    number = entry[len("commit-"):].split(".")[0]
                    if number.isdigit() and int(number) <= seq - commits.KEEP:
                        shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
        return {"checkpoint": path}


_SHARED = {}  # elastic directory -> whether every rank sees it as one


def _shared(directory):
    """Whether every rank sees ``directory`` as one (a file rank 0 writes there is read by
    every rank), asked once per directory. Collective."""
    if directory not in _SHARED:
        token = f"{os.getpid()}-{uuid.uuid4().hex}"
        marker = os.path.join(directory, ".hororing-shared")
        if context.rank() == 0:
            os.makedirs(directory, exist_ok=True)
            with open(marker + ".tmp", "w") as file:
                file.write(token)
            os.replace(marker + ".tmp", marker)
        token = functions.broadcast_object(token, root_rank=0, name="elastic.shared_token")
        try:
            with open(marker) as file:
                seen = file.read() == token
        except OSError:
            seen = False
        everyone = functions.allgather_object(seen, name="elastic.shared_seen")
        _SHARED[directory] = all(everyone)
    return _SHARED[directory]


class SamplerStateHandler(_StateDictHandler):
    def sync(self):
        self.value.load_state_dict(functions.broadcast_object(self.value.state_dict(),
                                                              name="elastic.sampler"))


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (ShardedOptimizer, ShardedOptimizerStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry():
    """The (type, handler class) pairs ``TorchState`` tries in order."""
    return _handler_registry


def set_handler_registry(registry):
    global _handler_registry
    _handler_registry = registry


class TorchState(HandledState):
    """State of a torch training process (Horovod's ``hvd.elastic.TorchState``).

    Args:
        model: a ``torch.nn.Module`` (optional).
        optimizer: a ``torch.optim.Optimizer`` or hororing's ``DistributedOptimizer``
            (optional).
        **kwargs: more state: modules, optimizers and ``ElasticSampler``s get their handlers;
            anything else is a plain Python object, exposed as an attribute.

    Example:
        >>> state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        super().__init__(handlers, functions.broadcast_object, None, **plain)


def _handler_for(value):
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None
