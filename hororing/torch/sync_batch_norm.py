"""Batch normalization with statistics over the whole global batch (every rank's samples)."""

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .. import ops
from ..context import current
from . import mpi_ops


class SyncBatchNorm(_BatchNorm):
    """Drop-in for torch.nn.BatchNorm{1,2,3}d whose training statistics span all ranks.

    Each rank's mean and variance come from the sum, sum of squares and count of every
    rank's batch (one allreduce forward, one backward). Evaluation uses running statistics.
    """

    @classmethod
    def convert_sync_batchnorm(cls, module):
        """``module`` with every BatchNorm1d/2d/3d layer in it replaced by a SyncBatchNorm
        holding the same weights and running statistics, as torch.nn.SyncBatchNorm's
        ``convert_sync_batchnorm`` (which torch runs on CUDA only); on CPU and GPU alike."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, (cls, torch.nn.SyncBatchNorm)):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child))
        return converted

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D")

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training or current().size == 1:
            return super().forward(input)
        if self.momentum is None:
            raise ValueError("SyncBatchNorm needs a numeric momentum (momentum=None is not supported)")
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean,
                                    self.running_var, self.eps, self.momentum)


def _sum_over_ranks(tensor):
    return mpi_ops.synchronize(mpi_ops.allreduce_async(tensor, op=ops.Sum))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum):
        channels = input.shape[1]
        flat = input.transpose(0, 1).reshape(channels, -1)
        local = torch.cat([flat.sum(1), (flat * flat).sum(1),
                           flat.new_full((1,), float(flat.shape[1]))])  # input's dtype and device
        total = _sum_over_ranks(local.detach())
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels:2 * channels] / count - mean * mean
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(momentum * mean)
            running_var.mul_(1 - momentum).add_(momentum * var * count / max(count - 1, 1))
        invstd = torch.rsqrt(var + eps)
        shape = [1, channels] + [1] * (input.dim() - 2)
        normalized = (input - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(normalized, invstd, weight)
        ctx.count = count
        output = normalized
        if weight is not None:
            output = output * weight.view(shape) + bias.view(shape)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        normalized, invstd, weight = ctx.saved_tensors
        channels = grad_output.shape[1]
        shape = [1, channels] + [1] * (grad_output.dim() - 2)
        dims = [0] + list(range(2, grad_output.dim()))
        grad_bias = grad_output.sum(dims)
        grad_weight = (grad_output * normalized).sum(dims)
        total = _sum_over_ranks(torch.cat([grad_bias, grad_weight]).detach())
        mean_dy = (total[:channels] / ctx.count).view(shape)
        mean_dy_xhat = (total[channels:] / ctx.count).view(shape)
        scale = invstd.view(shape) if weight is None else (weight * invstd).view(shape)
        grad_input = scale * (grad_output - mean_dy - normalized * mean_dy_xhat)
        if weight is None:
            return grad_input, None, None, None, None, None, None
        return grad_input, grad_weight, grad_bias, None, None, None, None
