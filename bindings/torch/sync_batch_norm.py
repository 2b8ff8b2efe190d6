"""`SyncBatchNorm`: batch normalisation whose statistics cover the batch of every rank.

Training forward allreduces (count, sum, sum of squares) per channel, in float64, in one
operation; backward allreduces (sum of dy, sum of dy * x_hat) per channel likewise. The result
equals BatchNorm over the concatenated batch: outputs, input gradients and running statistics;
the weight and bias gradients are this rank's parts, summed (averaged) by the optimizer as
for any parameter."""

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ferrovod.torch import mpi_ops
from horovod.common.process_sets import global_process_set


def _channel_view(t, ndim):
    """A per-channel vector shaped to broadcast against (N, C, ...) inputs."""
    return t.view((1, -1) + (1,) * (ndim - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        dims = [0] + list(range(2, x.dim()))
        x64 = x.detach().to(torch.float64)
        count = x.numel() // x.shape[1]
        local = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device),
                           x64.sum(dims), (x64 * x64).sum(dims)])
        total = mpi_ops.allreduce(local, op=mpi_ops.Sum, name=None, process_set=process_set)
        n = float(total[0])
        c = x.shape[1]
        mean = total[1:1 + c] / n
        var = (total[1 + c:] / n - mean * mean).clamp_min(0)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * (n / (n - 1)) if n > 1 else var
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        invstd = torch.rsqrt(var + eps)
        xhat = (x64 - _channel_view(mean, x.dim())) * _channel_view(invstd, x.dim())
        y = xhat
        if weight is not None:
            y = y * _channel_view(weight.detach().to(torch.float64), x.dim())
        if bias is not None:
            y = y + _channel_view(bias.detach().to(torch.float64), x.dim())
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.n = n
        ctx.process_set = process_set
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, invstd, weight = ctx.saved_tensors
        ndim = xhat.dim()
        dims = [0] + list(range(2, ndim))
        dy64 = dy.to(torch.float64)
        sum_dy = dy64.sum(dims)
        sum_dy_xhat = (dy64 * xhat).sum(dims)
        c = sum_dy.numel()
        total = mpi_ops.allreduce(torch.cat([sum_dy, sum_dy_xhat]), op=mpi_ops.Sum,
                                  process_set=ctx.process_set)
        mean_dy = total[:c] / ctx.n
        mean_dy_xhat = total[c:] / ctx.n
        scale = invstd if weight is None else invstd * weight.detach().to(torch.float64)
        dx = _channel_view(scale, ndim) * (dy64 - _channel_view(mean_dy, ndim)
                                           - xhat * _channel_view(mean_dy_xhat, ndim))
        dweight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        dbias = sum_dy.to(weight.dtype if weight is not None else dy.dtype) if ctx.has_bias else None
        return dx.to(dy.dtype), dweight, dbias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the batches of every rank of `process_set` (Horovod's
    `hvd.SyncBatchNorm`). Outside training, or on a set of one rank, it is plain BatchNorm."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got {}D input)".format(input.dim()))

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training or self.process_set.size() == 1:
            return super().forward(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        running = self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean if running else None,
            self.running_var if running else None, self.eps, momentum, self.process_set)
