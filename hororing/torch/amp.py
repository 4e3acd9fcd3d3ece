"""torch.amp's GradScaler with hvd.DistributedOptimizer: the standard pattern works.

    scaler.scale(loss).backward()
    scaler.step(optimizer)      # the gradients are averaged first, then unscaled and checked
    scaler.update()

A plain optimizer under GradScaler has its gradients unscaled and checked for inf/NaN inside
``scaler.step``, before ``optimizer.step()`` runs. For a DistributedOptimizer that is too early:
the allreduces are still running into the same gradients. Each rank would also decide alone
whether to skip its step, and the scales of the ranks would drift apart. So the wrapper
declares ``_step_supports_amp_scaling``. ``scaler.step`` then hands itself to
``optimizer.step(grad_scaler=...)``, which waits for the averages and only then lets the scaler
unscale and check them. The averaged gradients are the same on every rank, so every rank takes
the same decision and its scale moves alike.

``scaler.unscale_(optimizer)`` before the step (to clip gradients) must come after
``optimizer.synchronize()``, with the step inside ``optimizer.skip_synchronize()``, as in
Horovod. Called before the averages, it is refused at the step with that pattern.

A sharded optimizer (``sharded=True``) unscales only this rank's reduced chunks; the ranks
agree on whether any chunk holds inf or NaN (``all_finite``) before anyone steps.
"""

import warnings

import torch

from .. import ops

# GradScaler warns on every step that it will stop passing itself to optimizers that scale
# for themselves; the wrapper relies on that contract, which torch keeps meanwhile
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself",
                        category=FutureWarning)


def scaled_step(optimizer, grad_scaler, closure, synchronize, should_synchronize,
                synchronized, inner_step):
    """``scaler.step(optimizer)``'s work for a DistributedOptimizer.

    Args:
        grad_scaler: the GradScaler that called.
        synchronize: waits for the averaged gradients.
        should_synchronize: the averages are still to be waited for (False inside
            ``skip_synchronize()``, or after ``optimizer.synchronize()``).
        synchronized: ``optimizer.synchronize()`` ran since the last backward.
        inner_step: the wrapped optimizer's step.

    Returns:
        the inner step's return value, or None where the step was skipped (inf or NaN in
        the averaged gradients: skipped on every rank alike).
    """
    from torch.amp.grad_scaler import OptState

    state = grad_scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.UNSCALED and not synchronized:
        synchronize()  # the allreduces end before the error, so the next step starts clean
        raise RuntimeError(
            "scaler.unscale_(optimizer) ran before the gradients were averaged, so every rank "
            "unscaled and checked its own partial gradients. To unscale before the step (for "
            "gradient clipping), average them first: scaler.scale(loss).backward(); "
            "optimizer.synchronize(); scaler.unscale_(optimizer); clip...; with "
            "optimizer.skip_synchronize(): scaler.step(optimizer); scaler.update(). Without "
            "clipping, scaler.step(optimizer) alone unscales after averaging.")
    if should_synchronize:
        synchronize()
    if state["stage"] is OptState.READY:
        grad_scaler.unscale_(optimizer)  # the averages: the same on every rank
    if sum(found.item() for found in state["found_inf_per_device"].values()):
        return None
    return inner_step(closure)


def all_finite(optimizer, grad_scaler, name, process_set):
    """For a sharded optimizer under ``scaler.step``: unscale this rank's reduced chunks
    and return whether no rank found inf or NaN in its own. The scaler's record of the
    check is set to that agreement, so ``scaler.update()`` moves every rank's scale alike."""
    from torch.amp.grad_scaler import OptState

    from . import mpi_ops

    state = grad_scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.UNSCALED:
        raise RuntimeError(
            "scaler.unscale_(optimizer) before scaler.step(optimizer) is not supported with "
            "DistributedOptimizer(sharded=...): each rank holds only its chunk of the reduced "
            "gradients, which step() unscales itself. Call scaler.step(optimizer) alone; to "
            "clip, use optimizer.clip_grad_norm_(max_norm) after optimizer.synchronize() on "
            "gradients that are not scaled")
    grad_scaler.unscale_(optimizer)
    found = state["found_inf_per_device"]
    local = float(sum(tensor.item() for tensor in found.values()))
    anywhere = float(mpi_ops.allreduce(torch.tensor([local], dtype=torch.float64), op=ops.Max,
                                       name=name, process_set=process_set)[0])
    for tensor in found.values():
        tensor.fill_(1.0 if anywhere else 0.0)
    return not anywhere
