"""Training that talks every ``sync_every`` steps instead of every step: ``LocalSGD`` and
``DiLoCo``.

Both are used as ``DistributedOptimizer`` is (``zero_grad()``, backward, ``step()``), but
between syncs every rank steps its own optimizer on its own gradients, and nothing crosses
the network:

- ``LocalSGD``: every ``sync_every`` steps the parameters are averaged over the ranks
  (synchronous data parallel, gradients averaged every step, for the first ``warmup_steps``).
- ``DiLoCo`` (Douillard et al., 2023): every ``sync_every`` steps the change each rank made
  since the last sync (the global parameters less its own) is averaged, and an outer
  optimizer (Nesterov SGD in the paper) steps the global parameters with it as the gradient.
  With ``fragments=k`` the parameters are cut into k fragments of whole parameters balanced by
  size, synced at staggered steps (fragment f when ``step % sync_every == (f + 1) * sync_every
  // k``), so a sync carries about 1/k of the model (a parameter larger than that, alone).
  ``compression`` (``hvd.Compression.fp16``, ``.bf16``) sends the averaged changes in 16 bits;
  ``int8=True`` sends them as int8 with error feedback (``hororing.quantized``).

Every rank starts from rank 0's parameters and optimizer state.
"""

import itertools

import numpy as np
import torch

from .. import ops
from ..periodic import (Schedule, check_every, check_fragments, check_sent, check_warmup,
                        cut)
from ..quantized import Int8Feedback
from ..process_sets import global_process_set
from . import mpi_ops
from .async_ops import compressed_allreduce_async_, member_handles
from .compression import Compression
from .functions import allgather_object, broadcast_optimizer_state, broadcast_parameters
from .wrapping import WrappingOptimizer

_INSTANCES = itertools.count()  # constructed in one order on every rank: names agree


def _broadcast_state(optimizer, name):
    """Rank 0's optimizer state on every rank, where any rank has state: a fresh optimizer
    is left fresh (``broadcast_optimizer_state`` would give it Horovod's zero-gradient first
    step, which counts in Adam's bias correction)."""
    if any(allgather_object(bool(optimizer.state), name=name)):
        broadcast_optimizer_state(optimizer, root_rank=0)


def _trained(model):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the first argument is the model (a torch.nn.Module), got "
                        f"{type(model).__name__}")
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def _check_over(optimizer, parameters, what):
    """``optimizer`` must train exactly ``parameters`` (the model's trained ones)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what} must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    held = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    own = {id(parameter) for parameter in parameters}
    strangers = sum(1 for parameter in held if id(parameter) not in own)
    missing = len(own - {id(parameter) for parameter in held})
    if strangers or missing:
        raise ValueError(
            f"{what} must be over the model's trained parameters: it holds {strangers} that "
            f"are not the model's and lacks {missing} of the model's {len(parameters)}")


class _Periodic(WrappingOptimizer):
    """What both share: the wrapped (inner) optimizer, the step count, the start from rank
    0's parameters and state."""

    def __init__(self, model, optimizer, sync_every, what):
        check_every(sync_every)
        self._parameters = _trained(model)
        _check_over(optimizer, self._parameters, what)
        self._wrap(optimizer)
        self.sync_every = sync_every
        self.steps = 0
        self._prefix = f"{type(self).__name__.lower()}{next(_INSTANCES)}"
        broadcast_parameters(model.state_dict(), root_rank=0)
        _broadcast_state(optimizer, f"{self._prefix}.has_state")

    def zero_grad(self, set_to_none=True):
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def _average(self, tensors, name, compression=Compression.none):
        return mpi_ops.grouped_allreduce(tensors, name=f"{self._prefix}.{name}",
                                         compression=compression, op=ops.Average)


class LocalSGD(_Periodic):
    """``optimizer`` steps on this rank's gradients; the parameters are averaged over the
    ranks every ``sync_every`` steps, after ``warmup_steps`` steps of synchronous data
    parallel training (gradients averaged every step).

    Args:
        model: the ``torch.nn.Module`` trained (its parameters that require gradients are
            averaged).
        optimizer: a torch optimizer over those parameters.
        sync_every: steps between averages (1: every step).
        warmup_steps: steps with gradients averaged every step first.
    """

    def __init__(self, model, optimizer, sync_every, warmup_steps=0):
        check_warmup(warmup_steps)
        super().__init__(model, optimizer, sync_every, "LocalSGD's optimizer")
        self.warmup_steps = warmup_steps
        self._averaged_at = None  # the step after which the parameters were last averaged

    def sync_now(self):
        """Average the parameters now, unless they were at this step: every rank then holds
        the same model (call it after the last step, before evaluating or saving a model that
        must be the ranks' consensus). Training may go on after it, on the same schedule."""
        if self.steps <= self.warmup_steps or self._averaged_at == self.steps:
            return  # warm-up steps leave every rank with the same parameters
        self._average_parameters()

    def _average_parameters(self):
        with torch.no_grad():
            averaged = self._average([parameter.detach() for parameter in self._parameters],
                                     "parameters")
            for parameter, value in zip(self._parameters, averaged):
                parameter.copy_(value)
        self._averaged_at = self.steps

    def step(self, closure=None):
        if self.steps < self.warmup_steps:  # every rank gives a gradient, zeros if it has none
            grads = [parameter.grad if parameter.grad is not None else
                     torch.zeros_like(parameter) for parameter in self._parameters]
            for parameter, grad in zip(self._parameters,
                                       self._average(grads, "gradients")):
                parameter.grad = grad
        loss = self._optimizer.step(closure)
        self.steps += 1
        local = self.steps - self.warmup_steps
        if local > 0 and local % self.sync_every == 0:
            self._average_parameters()
        return loss

    def state_dict(self):
        return {**self._optimizer.state_dict(), "local_sgd_steps": self.steps,
                "local_sgd_averaged_at": self._averaged_at}

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        self.steps = state_dict.pop("local_sgd_steps", 0)
        self._averaged_at = state_dict.pop("local_sgd_averaged_at", None)
        self._optimizer.load_state_dict(state_dict)


class DiLoCo(_Periodic):
    """``inner_optimizer`` steps on this rank's gradients; every ``sync_every`` steps (per
    fragment, staggered) the averaged change since the last sync is the gradient of
    ``outer_optimizer``, which steps the global parameters every rank then continues from.

    Args:
        model: the ``torch.nn.Module`` trained.
        inner_optimizer: a torch optimizer over the model's trained parameters (AdamW in
            the paper).
        outer_optimizer: a torch optimizer over the same parameters (the paper's: SGD with
            lr=0.7, momentum=0.9, nesterov=True).
        sync_every: inner steps between two syncs of a fragment (H).
        fragments: how many fragments the parameters are cut into (whole parameters,
            balanced by size: ``hororing.periodic.cut``), each synced at its own step.
        compression: ``hvd.Compression.none``, ``.fp16`` or ``.bf16``: the averaged changes
            in 16 bits on the wire.
        overlap: a sync's allreduce runs during the following inner step, and its outer step
            is applied after it, with that step's progress kept on top (Streaming DiLoCo's
            overlap of one step). ``synchronize()`` finishes what is in flight.
        int8: send each change as int8 with one scale per tensor, gathered and averaged in
            rank order, what rounding took added to the next change (``hororing.quantized``;
            through host memory); not with ``compression``.

    ``sync_now()`` syncs every fragment at once, leaving every rank with the same model.
    """

    def __init__(self, model, inner_optimizer, outer_optimizer, sync_every, fragments=1,
                 compression=Compression.none, overlap=False, int8=False):
        parameters = _trained(model)
        _check_over(outer_optimizer, parameters, "DiLoCo's outer optimizer")
        check_fragments(fragments, len(parameters))
        compression = check_sent(compression, int8, Compression.none, Compression.fp16,
                                 Compression.bf16, spelled="hvd.Compression")
        super().__init__(model, inner_optimizer, sync_every, "DiLoCo's inner optimizer")
        _broadcast_state(outer_optimizer, f"{self._prefix}.outer_has_state")
        self.outer_optimizer = outer_optimizer
        self.compression = compression
        self._int8 = Int8Feedback() if int8 else None
        self.fragments = [[parameters[position] for position in run] for run in
                          cut([parameter.numel() for parameter in parameters], fragments)]
        # the global parameters: what every rank held at its fragment's last sync
        self._global = [parameter.detach().clone() for parameter in parameters]
        self._index = {id(parameter): index for index, parameter in enumerate(parameters)}
        self.overlap = bool(overlap)
        # (fragment, handle, compression contexts, the fragment's parameters when it was sent)
        self._pending = []
        self.schedule = Schedule(sync_every, len(self.fragments))

    def step(self, closure=None):
        loss = self._optimizer.step(closure)
        self.steps += 1
        self.synchronize()  # what was sent at the step before (overlap=True)
        for index in self.schedule.due(self.steps):
            self._sync(index)
        return loss

    def synchronize(self):
        """Finish the syncs in flight (``overlap=True``: sent at the last step): their outer
        steps, with the inner progress made since kept on top. ``step()`` calls it; call it
        after the last step, before evaluating or saving."""
        pending, self._pending = self._pending, []
        for index, handles, contexts, sent in pending:
            averaged = [self._received(handle, ctx) for handle, ctx in zip(handles, contexts)]
            members = self.fragments[index]
            with torch.no_grad():
                progress = [parameter.detach() - before for parameter, before in
                            zip(members, sent)]
            self._outer_step(index, averaged)
            with torch.no_grad():
                for parameter, gained in zip(members, progress):
                    parameter.add_(gained)

    def sync_now(self):
        """Sync every fragment not synced at this step, now and blocking (an outer step each),
        after finishing what is in flight: every rank then holds the same parameters, the
        global ones. Call it after the last step, before evaluating or saving a model that
        must be the ranks' consensus (with ``fragments`` > 1 the ranks' models differ at any
        step in the fragments not synced at it). Training may go on after it, on the same
        schedule."""
        self.synchronize()
        for index in self.schedule.unsynced(self.steps):
            self._sync(index, overlap=False)

    def _sync(self, index, overlap=True):
        self.schedule.synced(index, self.steps)
        members = self.fragments[index]
        held = [self._global[self._index[id(parameter)]] for parameter in members]
        with torch.no_grad():
            changes = [before - parameter.detach() for before, parameter in zip(held, members)]
        later = self.overlap and overlap  # finished at the next step, after its inner step
        if self._int8 is not None:
            handles, contexts = self._send_int8(index, members, changes)
        elif later:
            payloads, contexts = zip(*(self.compression.compress(change) for change in changes))
            # each payload in the compressor's wire dtype (16 bits), in place
            handles = member_handles(
                list(payloads), f"{self._prefix}.fragment{index}", global_process_set,
                lambda payload, member: compressed_allreduce_async_(
                    payload, self.compression, member, ops.Average))
        else:
            self._outer_step(index, self._average(changes, f"fragment{index}",
                                                  self.compression))
            return
        if later:
            with torch.no_grad():
                self._pending.append((index, handles, contexts,
                                      [parameter.detach().clone() for parameter in members]))
            return
        self._outer_step(index, [self._received(handle, ctx)
                                 for handle, ctx in zip(handles, contexts)])

    def _send_int8(self, index, members, changes):
        """Start gathering each change's int8 row (``quantized.Int8Feedback``); the handles
        and what ``_received`` needs with them."""
        handles, contexts = [], []
        for number, (parameter, change) in enumerate(zip(members, changes)):
            working = torch.float64 if change.dtype == torch.float64 else torch.float32
            row = self._int8.encode(self._index[id(parameter)],
                                    change.to("cpu", working).numpy())
            handles.append(mpi_ops.allgather_async(
                torch.from_numpy(row[None]), name=f"{self._prefix}.fragment{index}.{number}"))
            contexts.append((change.shape, change.dtype, change.device))
        return handles, contexts

    def _received(self, handle, ctx):
        """The averaged change a sync's handle brings."""
        if self._int8 is None:
            return self.compression.decompress(mpi_ops.synchronize(handle), ctx)
        shape, dtype, device = ctx
        working = np.float64 if dtype == torch.float64 else np.float32
        averaged = self._int8.average(mpi_ops.synchronize(handle).numpy(), tuple(shape),
                                      working)
        return torch.from_numpy(averaged).to(device=device, dtype=dtype)

    def _outer_step(self, index, averaged):
        """The outer optimizer's step of fragment ``index`` from its global parameters, with
        the averaged change as the gradient; the result is the new global copy."""
        members = self.fragments[index]
        held = [self._global[self._index[id(parameter)]] for parameter in members]
        # the outer step moves the global parameters of this fragment only: the others'
        # gradients are set aside meanwhile (an optimizer skips a parameter without one)
        aside = {}
        for parameter in self._parameters:
            aside[id(parameter)] = parameter.grad
            parameter.grad = None
        with torch.no_grad():
            for parameter, before, change in zip(members, held, averaged):
                parameter.copy_(before)
                parameter.grad = change.to(parameter.dtype)
        self.outer_optimizer.step()
        with torch.no_grad():
            for parameter, before in zip(members, held):
                before.copy_(parameter)
        for parameter in self._parameters:
            parameter.grad = aside[id(parameter)]

    def state_dict(self):
        self.synchronize()
        return {"inner": self._optimizer.state_dict(),
                "outer": self.outer_optimizer.state_dict(),
                "global": [tensor.clone() for tensor in self._global], "steps": self.steps,
                "synced_at": list(self.schedule.synced_at),
                **({} if self._int8 is None else {"residuals": self._int8.state_dict()})}

    def load_state_dict(self, state_dict):
        self._optimizer.load_state_dict(state_dict["inner"])
        self.outer_optimizer.load_state_dict(state_dict["outer"])
        if len(state_dict["global"]) != len(self._global):
            raise ValueError(f"the state holds {len(state_dict['global'])} global "
                             f"parameters, this model {len(self._global)}")
        with torch.no_grad():
            for mine, saved in zip(self._global, state_dict["global"]):
                mine.copy_(saved)
        self.steps = state_dict["steps"]
        self.schedule.restore(self.steps, state_dict.get("synced_at"))
        if self._int8 is not None:
            self._int8.load_state_dict(state_dict.get("residuals", {}))
