"""``TorchState``: models, optimizers and samplers committed, restored, synced and saved."""

import copy

import torch

from ...elastic.state import HandledState, StateHandler
from .. import functions
from .sampler import ElasticSampler


class _StateDictHandler(StateHandler):
    """An object with ``state_dict()``/``load_state_dict()``, saved as a deep copy."""

    def capture(self):
        return copy.deepcopy(self.value.state_dict())

    def apply(self, saved):
        self.value.load_state_dict(saved)


class ModelStateHandler(_StateDictHandler):
    def sync(self):
        functions.broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    def sync(self):
        functions.broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(_StateDictHandler):
    def sync(self):
        self.value.load_state_dict(functions.broadcast_object(self.value.state_dict(),
                                                              name="elastic.sampler"))


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
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
