"""What every optimizer wrapper of this binding shares: it is a ``torch.optim.Optimizer`` whose
groups, state, defaults and step hooks are the wrapped optimizer's own, not copies, so LR
schedulers, checkpoints and hooks see one optimizer. ``Optimizer.__init__`` is not called:
nothing is rebuilt."""

import torch


class WrappingOptimizer(torch.optim.Optimizer):
    """Delegates to ``self._optimizer`` (set by the subclass through ``_wrap``)."""

    def _wrap(self, optimizer):
        self._optimizer = optimizer
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks

    # the wrapped optimizer's own: load_state_dict replaces its param_groups list
    @property
    def param_groups(self):
        return self._optimizer.param_groups

    @property
    def state(self):
        return self._optimizer.state

    @property
    def defaults(self):
        return self._optimizer.defaults
