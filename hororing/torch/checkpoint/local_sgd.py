"""Checkpoints of ``LocalSGD`` and ``DiLoCo`` (``hororing/torch/local_sgd.py``).

Between syncs every rank holds parameters of its own, and always an inner optimizer state of
its own, so each rank writes those under its rank; what the ranks hold alike (DiLoCo's global
parameters and outer optimizer, the step count and the schedule) is written once:

    {"extra": {...},
     "periodic": {"kind": "DiLoCo", "ranks": n, "steps": s, "synced_at": [...]},
     "global": {parameter name: tensor},               (DiLoCo)
     "outer": {"state": ..., "param_groups": ...},     (DiLoCo)
     "ranks": {"0": {"model": ..., "optim": ...,
                     "residuals": {parameter name: tensor}},   (DiLoCo with int8)
               ..., "n-1": ...}}

A load at the size that saved gives each rank its own entry back, and training goes on as if
it had not stopped. At another size rank r reads the entry of saved rank ``r % n``; DiLoCo's
parameters then start from the global ones (each rank's progress since its fragments' last
sync is dropped rather than counted twice, and so is what int8's rounding kept back from
it), LocalSGD's from that rank's parameters.
"""

import torch

from . import states


def holds(optimizer):
    """Whether ``optimizer`` is a LocalSGD or a DiLoCo (its ranks' states differ)."""
    from ..local_sgd import DiLoCo, LocalSGD
    return isinstance(optimizer, (DiLoCo, LocalSGD))


def _diloco(optimizer):
    from ..local_sgd import DiLoCo
    return isinstance(optimizer, DiLoCo)


def _global(optimizer, names):
    return {names[parameter]: value
            for parameter, value in zip(optimizer._parameters, optimizer._global)}


def _residuals(optimizer, names):
    """DiLoCo's int8 error feedback, by parameter name (empty without int8)."""
    feedback = getattr(optimizer, "_int8", None)
    if feedback is None:
        return {}
    return {names[parameter]: torch.from_numpy(feedback.residuals[index])
            for index, parameter in enumerate(optimizer._parameters)
            if index in feedback.residuals}


def to_save(model, optimizer, extra, rank, size):
    """This rank's part of the checkpoint: its own entry, and its share of what the ranks
    hold alike (views of the live tensors, as ``states.to_save``)."""
    if model is None:
        raise ValueError(f"a checkpoint of {type(optimizer).__name__} holds each rank's model "
                         f"beside its optimizer state: save it with "
                         f"hvd.checkpoint.save(path, model, optimizer)")
    names = states.parameter_names(model, optimizer._optimizer)
    schedule = {"kind": type(optimizer).__name__, "ranks": size, "steps": optimizer.steps}
    tree = {"extra": dict(extra), "periodic": schedule}
    if _diloco(optimizer):
        optimizer.synchronize()  # the syncs in flight (overlap=True) land first
        schedule["synced_at"] = list(optimizer.schedule.synced_at)
        tree["global"] = _global(optimizer, names)
        tree["outer"] = states.to_save(None, optimizer.outer_optimizer, {}, names)["optim"]
    else:
        schedule["averaged_at"] = optimizer._averaged_at
    tree = states.share_replicated(tree, rank, size)
    own = states.to_save(model, optimizer._optimizer, {}, names)
    tree["ranks"] = {str(rank): {"model": own["model"], "optim": own["optim"]}}
    residuals = _residuals(optimizer, names) if _diloco(optimizer) else {}
    if residuals:  # int8's rounding kept back: this rank's own
        tree["ranks"][str(rank)]["residuals"] = residuals
    return tree


def saved_with(paths):
    """The kind of optimizer a checkpoint's paths show it was saved with: "DiLoCo",
    "LocalSGD", or None (neither)."""
    tops = {path[0] for path in paths.values()}
    if "ranks" not in tops:
        return None
    return "DiLoCo" if "global" in tops else "LocalSGD"


class Destination:
    """What a load of a LocalSGD or DiLoCo checkpoint reads into (``paths``, ``storage``: as
    ``states.Destination`` takes them), and how the result reaches the optimizer
    (``apply``)."""

    def __init__(self, model, optimizer, paths, storage, rank, size):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        self.model, self.optimizer, self.size = model, optimizer, size
        kind = "DiLoCo" if _diloco(optimizer) else "LocalSGD"
        saved = saved_with(paths)
        self.problems = []
        self.tree = {"extra": {}, "periodic": {}}
        if model is None:
            self.problems.append(f"a {kind} checkpoint is loaded with its model: "
                                 f"hvd.checkpoint.load(path, model, optimizer)")
            return
        if saved != kind:
            self.problems.append(
                f"it was saved with {saved or 'neither LocalSGD nor DiLoCo (no rank entries)'}"
                f", and {kind} reads only its own kind of checkpoint"
                + ("" if saved else "; load the model alone (optimizer=None) and start the "
                                    "optimizer afresh"))
            return
        entries = {path[1] for path in paths.values() if path[0] == "ranks"}
        self.saved_size = len(entries)
        self.source = str(rank % self.saved_size)
        self.names = states.parameter_names(model, optimizer._optimizer)
        own = {flat: path[2:] for flat, path in paths.items()
               if path[:2] == ("ranks", self.source) and path[2] != "residuals"}
        self._own = states.Destination(model, optimizer._optimizer, own, storage, self.names)
        self.problems += self._own.problems
        self.tree["ranks"] = {self.source: {key: self._own.tree[key]
                                            for key in ("model", "optim") if key in
                                            self._own.tree}}
        self._outer = None
        if _diloco(optimizer):
            outer = {flat: ("optim",) + path[1:] for flat, path in paths.items()
                     if path[0] == "outer"}
            self._outer = states.Destination(None, optimizer.outer_optimizer, outer, storage,
                                             self.names)
            self.problems += self._outer.problems
            self.tree["outer"] = self._outer.tree.get("optim", {})
            self.tree["global"] = self._global_slots(paths, storage)
            if getattr(optimizer, "_int8", None) is not None and self.saved_size == size:
                self.tree["ranks"][self.source]["residuals"] = {
                    path[3]: torch.empty(storage[flat].size,
                                         dtype=storage[flat].properties.dtype)
                    for flat, path in paths.items()
                    if path[:3] == ("ranks", self.source, "residuals")}
        for flat, path in paths.items():
            if path[0] in ("extra", "periodic"):
                meta = storage[flat]
                self._place(path, states.Destination._placeholder(
                    meta, isinstance(meta, TensorStorageMetadata)))

    _place = states.Destination._place  # (a value at its path in ``self.tree``)

    def _global_slots(self, paths, storage):
        """DiLoCo's global parameters: a tensor of each saved one's size, checked against
        the model's trained parameters by name and shape."""
        wanted = _global(self.optimizer, self.names)
        slots = {}
        for flat, path in paths.items():
            if path[0] != "global":
                continue
            meta = storage[flat]
            slots[path[1]] = torch.empty(meta.size, dtype=meta.properties.dtype)
            if path[1] in wanted and tuple(meta.size) != tuple(wanted[path[1]].shape):
                self.problems.append(f"the global copy of {path[1]}: saved "
                                     f"{tuple(meta.size)}, this model's "
                                     f"{tuple(wanted[path[1]].shape)}")
        if set(slots) != set(wanted):
            self.problems.append(
                f"the global parameters saved are {sorted(slots)}, this model trains "
                f"{sorted(wanted)}")
        return slots

    def extra(self):
        return self.tree.get("extra", {})

    def apply(self):
        """Give the optimizers what was read (the model's tensors were read in place)."""
        optimizer, schedule = self.optimizer, self.tree["periodic"]
        self._own.apply()
        optimizer.steps = schedule["steps"]
        if self._outer is None:
            optimizer._averaged_at = schedule["averaged_at"]
            return
        self._outer.apply()
        wanted = _global(optimizer, self.names)
        with torch.no_grad():
            for name, value in wanted.items():
                value.copy_(self.tree["global"][name])
            if schedule["ranks"] != self.size:
                for parameter, value in zip(optimizer._parameters, optimizer._global):
                    parameter.copy_(value)
        optimizer._pending = []
        optimizer.schedule.restore(optimizer.steps, schedule["synced_at"])
        if optimizer._int8 is not None:  # at another size, none: the progress was dropped
            saved = self.tree["ranks"][self.source].get("residuals", {})
            index = {self.names[parameter]: position
                     for position, parameter in enumerate(optimizer._parameters)}
            optimizer._int8.load_state_dict({index[name]: value.numpy()
                                             for name, value in saved.items()})
