"""Training that talks every ``sync_every`` steps, for optimizers of numpy arrays
(``hororing.optim``'s protocol): ``LocalSGD`` and ``DiLoCo``, as ``hororing.torch`` has them.

Both are used as ``DistributedOptimizer`` is (write ``grads``, then ``step()``), but between
syncs every rank steps its own optimizer on its own gradients and nothing crosses the
network:

- ``LocalSGD``: every ``sync_every`` steps the parameters are averaged over the ranks (the
  gradients averaged every step during the first ``warmup_steps``).
- ``DiLoCo``: every ``sync_every`` steps the change each rank made since the last sync (the
  global parameters less its own) is averaged, and the outer optimizer steps the global
  parameters with it as the gradient; every rank goes on from the result. ``fragments=k``
  cuts the parameters into k fragments synced at staggered steps (``hororing.periodic``).

Every rank starts from rank 0's parameters; the optimizers' own states are each rank's, as
built (start them fresh). ``sync_now()`` after the last step leaves every rank with the same
parameters.
"""

import itertools

import numpy as np

from . import collectives, ops
from .compression import Compression
from .optim import check_protocol
from .periodic import Schedule, check_every, check_fragments, check_sent, check_warmup, cut
from .quantized import Int8Feedback, finish_average, start_average

_INSTANCES = itertools.count()  # constructed in one order on every rank: names agree


class _Periodic:
    """The wrapped (inner) optimizer, the step count, the start from rank 0's parameters."""

    def __init__(self, optimizer, sync_every, what):
        check_every(sync_every)
        check_protocol(optimizer, what)
        self.optimizer = optimizer
        self.sync_every = sync_every
        self.steps = 0
        self._prefix = f"{type(self).__name__.lower()}{next(_INSTANCES)}"
        self._names = list(optimizer.params)
        handles = [collectives.broadcast_async_(optimizer.params[name], 0,
                                                name=f"{self._prefix}.start.{name}")
                   for name in self._names]
        for handle in handles:
            collectives.synchronize(handle)

    @property
    def params(self):
        return self.optimizer.params

    @property
    def grads(self):
        return self.optimizer.grads

    def _average_(self, arrays, name):
        """Average ``arrays`` over the ranks, in place."""
        collectives.grouped_allreduce_(arrays, name=f"{self._prefix}.{name}", op=ops.Average)


class LocalSGD(_Periodic):
    """``optimizer`` steps on this rank's gradients; the parameters are averaged over the
    ranks every ``sync_every`` steps, after ``warmup_steps`` steps with the gradients averaged
    every step.

    Args:
        optimizer: an optimizer of numpy arrays (``hororing.optim``'s protocol).
        sync_every: steps between averages (1: every step).
        warmup_steps: steps with the gradients averaged every step first.
    """

    def __init__(self, optimizer, sync_every, warmup_steps=0):
        check_warmup(warmup_steps)
        super().__init__(optimizer, sync_every, "LocalSGD's optimizer")
        self.warmup_steps = warmup_steps
        self._averaged_at = None  # the step after which the parameters were last averaged

    def step(self):
        if self.steps < self.warmup_steps:
            self._average_([self.grads[name] for name in self._names], "gradients")
        self.optimizer.step()
        self.steps += 1
        local = self.steps - self.warmup_steps
        if local > 0 and local % self.sync_every == 0:
            self._average_parameters()
        return True

    def sync_now(self):
        """Average the parameters now, unless they were at this step: every rank then holds
        the same ones. Training may go on after it, on the same schedule."""
        if self.steps > self.warmup_steps and self._averaged_at != self.steps:
            self._average_parameters()

    def _average_parameters(self):
        self._average_([self.params[name] for name in self._names], "parameters")
        self._averaged_at = self.steps

    def state_dict(self):
        return {"steps": self.steps, "averaged_at": self._averaged_at}

    def load_state_dict(self, state):
        self.steps, self._averaged_at = state["steps"], state.get("averaged_at")


class DiLoCo(_Periodic):
    """``inner_optimizer`` steps on this rank's gradients; every ``sync_every`` steps (per
    fragment, staggered) the averaged change since the last sync is the gradient of
    ``outer_optimizer``, which steps the global parameters every rank then goes on from.

    Args:
        inner_optimizer: an optimizer of numpy arrays (``hororing.optim``'s protocol).
        outer_optimizer: one over the same arrays (``hororing.optim.SGD(params, lr=0.8,
            momentum=0.5, nesterov=True)``, say). With ``fragments`` > 1 its ``step()`` must
            step only the entries of its ``params`` (``hororing.optim.SGD``'s does): a
            fragment's outer step narrows ``params`` and ``grads`` to the fragment's names.
        sync_every: inner steps between two syncs of a fragment (H).
        fragments: how many fragments the parameters are cut into (whole parameters,
            balanced by size: ``hororing.periodic.cut``), each synced at its own step.
        compression: ``Compression.none``, ``.fp16`` or ``.bf16``: the averaged changes in
            16 bits on the wire.
        overlap: a sync's allreduce runs during the following inner step, and its outer step
            is applied after it, with that step's progress kept on top.
        int8: send each change as int8 with one scale per tensor, gathered and averaged in
            rank order, what rounding took added to the next change (``hororing.quantized``);
            not with ``compression``.
    """

    def __init__(self, inner_optimizer, outer_optimizer, sync_every, fragments=1,
                 compression=Compression.none, overlap=False, int8=False):
        check_protocol(outer_optimizer, "DiLoCo's outer optimizer")
        check_protocol(inner_optimizer, "DiLoCo's inner optimizer")
        inner, outer = inner_optimizer.params, outer_optimizer.params
        if list(inner) != list(outer) or any(outer[name] is not inner[name] for name in inner):
            raise ValueError("DiLoCo's outer optimizer must be over the inner optimizer's "
                             "parameter arrays (the same dict's arrays, the same names): "
                             "build both over one params dict")
        check_fragments(fragments, len(inner))
        compression = check_sent(compression, int8, Compression.none, Compression.fp16,
                                 Compression.bf16)
        super().__init__(inner_optimizer, sync_every, "DiLoCo's inner optimizer")
        self.outer_optimizer = outer_optimizer
        self.compression = compression
        self._int8 = Int8Feedback() if int8 else None
        self.overlap = bool(overlap)
        self.fragments = [[self._names[position] for position in run] for run in
                          cut([inner[name].size for name in self._names], fragments)]
        self.schedule = Schedule(sync_every, len(self.fragments))
        # the global parameters: what every rank held at its fragment's last sync
        self._global = {name: np.array(inner[name], copy=True) for name in self._names}
        # (fragment, handles, compression contexts, its parameters when the changes were sent)
        self._pending = []

    def step(self):
        self.optimizer.step()
        self.steps += 1
        self.synchronize()  # what was sent at the step before (overlap=True)
        for index in self.schedule.due(self.steps):
            self._sync(index, self.overlap)
        return True

    def synchronize(self):
        """Finish the syncs in flight (``overlap=True``: sent at the last step), keeping the
        inner progress made since on top of their outer steps."""
        pending, self._pending = self._pending, []
        for index, handles, contexts, sent in pending:
            averaged = [finish_average(handle, ctx) for handle, ctx in zip(handles, contexts)]
            names = self.fragments[index]
            progress = [self.params[name] - before for name, before in zip(names, sent)]
            self._outer_step(index, averaged)
            for name, gained in zip(names, progress):
                self.params[name] += gained

    def sync_now(self):
        """Sync every fragment not synced at this step, now and blocking, after finishing
        what is in flight: every rank then holds the same (global) parameters. Call it after
        the last step, before evaluating or saving; training may go on after it."""
        self.synchronize()
        for index in self.schedule.unsynced(self.steps):
            self._sync(index, overlap=False)

    def _sync(self, index, overlap):
        self.schedule.synced(index, self.steps)
        names = self.fragments[index]
        handles, contexts = [], []
        for name in names:
            handle, ctx = start_average(self._global[name] - self.params[name],
                                        f"{self._prefix}.fragment{index}.{name}",
                                        self.compression, self._int8, name)
            handles.append(handle)
            contexts.append(ctx)
        if overlap:  # finished at the next step, after its inner step
            self._pending.append((index, handles, contexts,
                                  [self.params[name].copy() for name in names]))
            return
        self._outer_step(index, [finish_average(handle, ctx)
                                 for handle, ctx in zip(handles, contexts)])

    def _outer_step(self, index, averaged):
        """The outer optimizer's step of fragment ``index`` from its global parameters, with
        the averaged change as the gradient; the result is the new global copy."""
        names = self.fragments[index]
        outer = self.outer_optimizer
        params, grads = outer.params, outer.grads
        for name, change in zip(names, averaged):
            params[name][...] = self._global[name]
            grads[name][...] = change
        if len(names) < len(params):  # the other fragments' entries stay as they are
            outer.params = {name: params[name] for name in names}
            outer.grads = {name: grads[name] for name in names}
            try:
                outer.step()
            finally:
                outer.params, outer.grads = params, grads
        else:
            outer.step()
        for name in names:
            self._global[name][...] = params[name]

    def state_dict(self):
        """The global parameters, the step count, the fragments' last syncs and with int8
        what rounding took (the optimizers' own states are theirs to save)."""
        self.synchronize()
        state = {"global": {name: value.copy() for name, value in self._global.items()},
                 "steps": self.steps, "synced_at": list(self.schedule.synced_at)}
        if self._int8 is not None:  # what rounding took, still to be sent
            state["residuals"] = self._int8.state_dict()
        return state

    def load_state_dict(self, state):
        if sorted(state["global"]) != sorted(self._global):
            raise ValueError(f"the state holds the global parameters {sorted(state['global'])}, "
                             f"this optimizer {sorted(self._global)}")
        for name, value in state["global"].items():
            self._global[name][...] = value
        self.steps = state["steps"]
        self.schedule.restore(self.steps, state.get("synced_at"))
        if self._int8 is not None:
            self._int8.load_state_dict(state.get("residuals", {}))
