"""DCP's default planners, taught to find chunks in ``Boxes`` (a sharded optimizer's share of a
state tensor). Everything else (flattening nested dicts, writing a replicated tensor once,
resharding at load) is DCP's own. Imported when a checkpoint is saved or loaded, not with
``hororing.torch`` (DCP's import costs half a second)."""

from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from .boxes import Boxes


class SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index):
        value = self.state_dict[index.fqn]
        if isinstance(value, Boxes):
            return value.shard(index.offset)
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        # the default's, less its pass that makes meta tensors real (there are none here),
        # which sets every value it does not know, a Boxes, to None
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index):
        value = self.state_dict[index.fqn]
        if isinstance(value, Boxes):
            return value.shard(index.offset)
        return super().lookup_tensor(index)
