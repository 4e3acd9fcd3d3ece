"""A sharded optimizer's checkpoints: its full state gathered from every rank's chunks, and a
full state cut back into this rank's chunks (``ShardedOptimizer.state_dict`` and
``load_state_dict``). Both number parameters as the wrapped optimizer's ``state_dict()``
does, so a full state moves between sharded and unsharded optimizers of any rank count."""

import torch

from . import mpi_ops


def _sliced(key, value):
    """State kept per element (sliced with the parameters), not a per-tensor scalar such as
    Adam's ``step``."""
    return torch.is_tensor(value) and key != "step"


def gather(optimizer):
    """The full state of a ``DistributedOptimizer(sharded=...)``, as the wrapped optimizer's
    own ``state_dict()`` gives it, on every rank (collective)."""
    inner = optimizer._optimizer.state_dict()
    full_state = {}
    index_of = {parameter: index for index, parameter in enumerate(optimizer._originals)}
    position = 0  # the inner optimizer's parameter index, as state_dict numbers them
    for group_index, vectors in enumerate(optimizer._vectors):
        for vector in vectors:
            states = [inner["state"].get(position + index, {})
                      for index in range(len(vector.leaves))]
            position += len(vector.leaves)
            gathered = _gather_state(optimizer, group_index, vector, states)
            for offset, parameter in enumerate(vector.parameters):
                # a per-tensor value gets a copy per parameter: Adam counts its step in
                # place, so a tensor shared by several would count once for each of them
                full_state[index_of[parameter]] = {
                    key: (value[offset] if isinstance(value, list) else _own(value))
                    for key, value in gathered.items()}
    groups = []
    for group, original in zip(inner["param_groups"], optimizer._original.param_groups):
        groups.append({**{key: value for key, value in group.items() if key != "params"},
                       "params": [index_of[parameter] for parameter in original["params"]]})
    return {"state": full_state, "param_groups": groups}


def _gather_state(optimizer, group_index, vector, states):
    """key -> per-parameter full tensors (list) for sliced state, the value itself for
    scalars (the same on every rank). ``states``: the state of each of the group vector's
    leaves, in order."""
    gathered = {}
    for key in sorted(states[0]):
        value = states[0][key]
        if _sliced(key, value) and value.dim() == 1:
            mine = torch.cat([state[key].detach() for state in states])
            full = mpi_ops.allgather(mine, name=optimizer._label(
                group_index, vector, f"state.{key}"), process_set=optimizer.process_set)
            gathered[key] = vector.split(vector.in_vector_order(full, optimizer._group.size))
        else:
            gathered[key] = value
    return gathered


def load(optimizer, state_dict):
    """Give a sharded optimizer a full state (its own ``state_dict()``'s, or an unsharded
    optimizer's): it keeps this rank's chunks of it."""
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer._vectors):
        raise ValueError(f"the state has {len(groups)} parameter groups, this optimizer "
                         f"{len(optimizer._vectors)}")
    # both number the parameters by their position over the groups, frozen ones included
    index_of = {parameter: index for index, parameter in enumerate(optimizer._originals)}
    state = state_dict["state"]
    inner_state, position = {}, 0
    for group_index, vectors in enumerate(optimizer._vectors):
        for vector in vectors:
            per_parameter = []
            for parameter in vector.parameters:
                per_parameter.append(state.get(index_of[parameter]) or {})
            keys = set().union(*per_parameter) if per_parameter else set()
            entries = [{} for _ in vector.leaves]
            for key in keys:
                values = [saved.get(key) for saved in per_parameter]
                present = [value for value in values if value is not None]
                if all(_sliced(key, value) and value.shape == parameter.shape
                       for value, parameter in zip(values, vector.parameters)
                       if value is not None):
                    # a parameter without state (it had no gradient yet where the state
                    # was saved: a plain optimizer, or Horovod's on one rank) starts from
                    # zeros, as its elements of the flat state would have
                    flat = torch.cat([
                        (value if value is not None else
                         torch.zeros(parameter.shape, dtype=present[0].dtype,
                                     device=present[0].device)).reshape(-1)
                        for value, parameter in zip(values, vector.parameters)])
                    for entry, (low, high) in zip(entries, vector.leaf_bounds):
                        entry[key] = flat[low:high].clone()
                else:  # a per-tensor value (Adam's step, which it counts up in place)
                    for entry in entries:
                        entry[key] = _own(present[0])
            for entry in entries:
                if entry:
                    inner_state[position] = entry
                position += 1
    inner_groups = []
    for group, vectors, inner in zip(groups, optimizer._vectors,
                                    optimizer._optimizer.state_dict()["param_groups"]):
        inner_groups.append({**{key: value for key, value in group.items()
                                if key != "params"}, "params": inner["params"]})
    optimizer._optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})


def _own(value):
    """A copy of ``value`` where it is a tensor (one parameter's own state)."""
    return value.detach().clone() if torch.is_tensor(value) else value
