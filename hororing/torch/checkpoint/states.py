"""What a checkpoint holds, keyed as ``torch.distributed.checkpoint.state_dict.get_state_dict(
model, optimizer, options=StateDictOptions(full_state_dict=True))`` keys it:

    {"model": {name: tensor},
     "optim": {"state": {parameter name: {"exp_avg": ..., "step": ...}},
               "param_groups": [{"lr": ..., "params": [parameter names]}]},
     "extra": {...}}

Replicated values (the parameters, an unsharded optimizer's state, the hyperparameters) are
plain tensors and objects: DCP writes each once. A sharded optimizer's per-element state is
each rank's ``Boxes`` of it; nothing is gathered. ``to_save`` builds the dict a save writes,
``Destination`` the dict a load reads into (this rank's share, for a sharded optimizer of
any size) and what it then gives the optimizer.
"""

import torch

from .boxes import Boxes


def unwrapped(model):
    """The module whose names a checkpoint uses: DDP's ``module`` and ``torch.compile``'s
    original, as torch's own state_dict helpers name them."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def parameter_names(model, optimizer):
    """parameter -> its name in the model, for every parameter ``optimizer`` holds."""
    names = {}
    for name, parameter in unwrapped(model).named_parameters(remove_duplicate=False):
        names.setdefault(parameter, name)
    for group in _original_groups(optimizer):
        for parameter in group["params"]:
            if parameter not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(parameter.shape)} that "
                    f"is not in the model: a checkpoint names optimizer state by the model's "
                    f"parameter names, so pass the model the optimizer trains")
    return names


def sharded(optimizer):
    return getattr(optimizer, "shards_state", False)


def _original_groups(optimizer):
    """The optimizer's groups over the model's parameters (a sharded optimizer's rebuilt
    groups hold its chunks)."""
    return optimizer._original.param_groups if sharded(optimizer) else optimizer.param_groups


def _per_element(key, value):
    """State kept per element of the parameter (sliced by a sharded optimizer), not a
    per-tensor value such as Adam's ``step``."""
    return torch.is_tensor(value) and key != "step" and value.dim() >= 1


def _groups(optimizer, names):
    hyper_groups = optimizer.param_groups  # a sharded optimizer's carry its current values
    return [{**{key: value for key, value in hyper.items() if key != "params"},
             "params": [names[parameter] for parameter in group["params"]]}
            for hyper, group in zip(hyper_groups, _original_groups(optimizer))]


def positional_names(optimizer):
    """parameter -> its position over the optimizer's groups (as its own state_dict numbers
    them), for a checkpoint of an optimizer alone."""
    return {parameter: str(index) for index, parameter in enumerate(
        parameter for group in _original_groups(optimizer) for parameter in group["params"])}


def to_save(model, optimizer, extra, names=None):
    """The nested dict a save writes (views of the live tensors: write or stage it before
    the next step). ``model`` None: the optimizer alone, its parameters named by ``names``."""
    state = {"extra": dict(extra)}
    if model is not None:
        state["model"] = unwrapped(model).state_dict()
    if optimizer is not None:
        names = names or parameter_names(model, optimizer)
        per_parameter = _sharded_state(optimizer, names) if sharded(optimizer) else {
            names[parameter]: dict(optimizer.state[parameter])
            for group in optimizer.param_groups for parameter in group["params"]
            if optimizer.state.get(parameter)}
        state["optim"] = {"state": per_parameter, "param_groups": _groups(optimizer, names)}
    return state


def share_replicated(tree, rank, size):
    """Keep, of the tensors every rank holds alike (everything but ``Boxes``), only those this
    rank writes: each goes to one rank, the largest first to the rank with the fewest bytes
    so far. Every rank decides alike from the same sizes, so each tensor is written once and
    the writing is spread (an async save stages this rank's share only)."""
    found = []

    def visit(node, path):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(value, (dict, list)):
                visit(value, path + (key,))
            elif torch.is_tensor(value) and isinstance(node, dict):  # (in a list: DCP's
                found.append((value.nbytes, path + (key,), node, key))  # dedup writes it)
    visit(tree, ())
    load = [0] * size
    drop = []
    for nbytes, path, node, key in sorted(found, key=lambda item: (-item[0], str(item[1]))):
        writer = min(range(size), key=lambda candidate: (load[candidate], candidate))
        load[writer] += nbytes
        if writer != rank:
            drop.append((node, key))
    for node, key in drop:
        del node[key]
    return tree


def _sharded_state(optimizer, names):
    """parameter name -> {key: this rank's Boxes of per-element state, or the per-tensor
    value (the same on every rank)}."""
    inner = optimizer._optimizer
    state = {}
    for vectors in optimizer._vectors:
        for vector in vectors:
            leaf_states = [inner.state.get(leaf, {}) for leaf in vector.leaves]
            keys = sorted(set().union(*leaf_states))
            offset = 0
            for parameter in vector.parameters:
                count, entry = parameter.numel(), {}
                for key in keys:
                    sample = next(leaf[key] for leaf in leaf_states if key in leaf)
                    if not _per_element(key, sample):
                        entry[key] = sample
                    elif count == 0:
                        entry[key] = torch.zeros(parameter.shape, dtype=sample.dtype)
                    else:
                        entry[key] = Boxes(parameter.shape, sample.dtype, [
                            (max(low, offset) - offset,
                             leaf[key][max(low, offset) - low:min(high, offset + count) - low])
                            for (low, high), leaf in zip(vector.leaf_bounds, leaf_states)
                            if max(low, offset) < min(high, offset + count) and key in leaf])
                if entry:
                    state[names[parameter]] = entry
                offset += count
    return state


class Destination:
    """What a load reads into, built from the checkpoint's metadata (``paths``: DCP's flat key
    -> its path in the nested dict; ``storage``: flat key -> its storage metadata), and how
    the result reaches the model (in place) and the optimizer (``apply``)."""

    def __init__(self, model, optimizer, paths, storage, names=None):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        self.model, self.optimizer = model, optimizer
        self.problems = []
        own = unwrapped(model).state_dict() if model is not None else {}
        self.names = names or (parameter_names(model, optimizer) if optimizer is not None
                               else {})
        by_name = {name: parameter for parameter, name in self.names.items()}
        self.tree = {"model": {}, "extra": {}}
        self._leaf_state = {}  # (group vector, key) -> the leaves' tensors (sharded)
        self._full_state = {}  # (parameter name, key) -> a full tensor (unsharded)
        saved_model = set()
        for flat, path in paths.items():
            meta = storage[flat]
            tensor = isinstance(meta, TensorStorageMetadata)
            if path[0] == "model" and len(path) == 2 and model is not None:
                name = path[1]
                saved_model.add(name)
                if name not in own:
                    continue  # named below, with every other unexpected key
                if not tensor or tuple(meta.size) != tuple(own[name].shape):
                    saved = tuple(meta.size) if tensor else "not a tensor"
                    self.problems.append(f"{name}: saved {saved}, this model's "
                                         f"{tuple(own[name].shape)}")
                    continue
                self._place(path, own[name])
            elif path[:2] == ("optim", "state") and len(path) == 4 and optimizer is not None:
                name, key = path[2], path[3]
                parameter = by_name.get(name)
                if parameter is None:
                    self.problems.append(f"optimizer state for {name}, which is not a "
                                         f"parameter this optimizer trains")
                    continue
                if tensor and tuple(meta.size) == tuple(parameter.shape) and \
                        len(meta.size) >= 1 and key != "step":
                    self._place(path, self._per_element(parameter, key, meta.properties.dtype))
                else:
                    self._place(path, self._placeholder(meta, tensor))
            elif path[0] == "optim" and optimizer is not None and path[1] != "state":
                self._place(path, self._placeholder(meta, tensor))
            elif path[0] == "extra":
                self._place(path, self._placeholder(meta, tensor))
        missing = sorted(set(own) - saved_model)
        unexpected = sorted(saved_model - set(own))
        if missing:
            self.problems.insert(0, f"missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            self.problems.insert(0, f"in the checkpoint, not in this model: "
                                    f"{', '.join(unexpected)}")
        if optimizer is not None and "optim" not in self.tree:
            self.problems.append("the checkpoint holds no optimizer state (saved without an "
                                 "optimizer): load it with optimizer=None")

    @staticmethod
    def _placeholder(meta, tensor):
        """Where a replicated value lands: a tensor of its size, or a slot DCP fills."""
        return torch.empty(meta.size, dtype=meta.properties.dtype) if tensor else None

    def _place(self, path, value):
        def slot(node, step):  # a list grows to hold index ``step``
            if isinstance(node, list) and len(node) <= step:
                node.extend([None] * (step + 1 - len(node)))
            return node[step] if isinstance(node, list) else node.get(step)

        node = self.tree
        for step, following in zip(path[:-1], path[1:]):
            child = slot(node, step)
            if child is None:
                child = node[step] = [] if isinstance(following, int) else {}
            node = child
        slot(node, path[-1])
        node[path[-1]] = value

    def _per_element(self, parameter, key, dtype):
        """Per-element state of ``parameter``: a full tensor, or (sharded) this rank's Boxes
        over the leaves' tensors, zeros where the checkpoint has none."""
        if not sharded(self.optimizer) or parameter.numel() == 0:
            full = torch.zeros(parameter.shape, dtype=dtype)
            self._full_state[(self.names[parameter], key)] = full
            return full
        for vectors in self.optimizer._vectors:
            for vector in vectors:
                if any(parameter is member for member in vector.parameters):
                    break
            else:
                continue
            break
        else:
            raise ValueError(f"{self.names[parameter]} is not trained by this optimizer "
                             f"(it does not require a gradient), yet the checkpoint has "
                             f"optimizer state for it")
        leaves = self._leaf_state.get((vector, key))
        if leaves is None:  # once per vector and key: the leaves every parameter's views share
            leaves = self._leaf_state[(vector, key)] = [
                torch.zeros(high - low, dtype=dtype) for low, high in vector.leaf_bounds]
        offset = 0
        for member in vector.parameters:
            if member is parameter:
                break
            offset += member.numel()
        count = parameter.numel()
        return Boxes(parameter.shape, dtype, [
            (max(low, offset) - offset,
             leaf[max(low, offset) - low:min(high, offset + count) - low])
            for (low, high), leaf in zip(vector.leaf_bounds, leaves)
            if max(low, offset) < min(high, offset + count)])

    def extra(self):
        return self.tree.get("extra", {})

    def apply(self):
        """Give the optimizer what was read (the model's tensors were read in place)."""
        if self.optimizer is None:
            return
        loaded = self.tree["optim"]
        saved_groups = loaded.get("param_groups") or []
        own_groups = _original_groups(self.optimizer)
        if len(saved_groups) != len(own_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} parameter "
                             f"groups, this one {len(own_groups)}")
        for index, (saved, group) in enumerate(zip(saved_groups, own_groups)):
            own_names = [self.names[parameter] for parameter in group["params"]]
            if list(saved["params"]) != own_names:
                raise ValueError(f"parameter group {index} holds {saved['params']} in the "
                                 f"checkpoint, {own_names} here")
        per_parameter = loaded.get("state", {})
        if sharded(self.optimizer):
            self._apply_sharded(per_parameter, saved_groups)
            return
        index_of, state = {}, {}
        for group in own_groups:
            for parameter in group["params"]:
                index_of[self.names[parameter]] = len(index_of)
        for name, entry in per_parameter.items():
            state[index_of[name]] = dict(entry)
        self.optimizer.load_state_dict({"state": state, "param_groups": [
            {**saved, "params": [index_of[name] for name in saved["params"]]}
            for saved in saved_groups]})

    def _apply_sharded(self, per_parameter, saved_groups):
        inner = self.optimizer._optimizer
        inner_state, position = {}, 0
        for vectors in self.optimizer._vectors:
            for vector in vectors:
                leaves = {key: tensors for (owner, key), tensors in self._leaf_state.items()
                          if owner is vector}
                # per-tensor values (Adam's step): the first of the vector's parameters
                # that has one, each leaf its own copy (Adam counts it up in place)
                scalars = {}
                for parameter in vector.parameters:
                    for key, value in per_parameter.get(self.names[parameter], {}).items():
                        if key not in leaves:
                            scalars.setdefault(key, value)
                for index in range(len(vector.leaves)):
                    entry = {key: tensors[index] for key, tensors in leaves.items()}
                    entry.update({key: value.clone() if torch.is_tensor(value) else value
                                  for key, value in scalars.items()})
                    if entry:
                        inner_state[position] = entry
                    position += 1
        inner_groups = inner.state_dict()["param_groups"]
        inner.load_state_dict({"state": inner_state, "param_groups": [
            {**{key: value for key, value in saved.items() if key != "params"},
             "params": own["params"]} for saved, own in zip(saved_groups, inner_groups)]})
