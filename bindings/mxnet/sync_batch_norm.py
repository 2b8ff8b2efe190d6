"""SyncBatchNorm for Gluon: batch statistics over every rank's batch (AIACC's cross-process
SyncBN). The forward pass allreduces each channel's (sum, sum of squares) and the batch count
in one fused operation, so ranks with different batch sizes are weighted by their samples; the
backward pass allreduces (sum of dy, sum of dy * x_hat) likewise, so the input gradient flows
through the global statistics. The result equals BatchNorm over the concatenated batch in one
process: outputs, input gradients, parameter gradients summed over ranks, moving statistics."""

import itertools

import mxnet as mx

from horovod.common.process_sets import global_process_set


class _SyncBatchNorm(mx.autograd.Function):
    """One training forward/backward of SyncBatchNorm (`mx.autograd.Function`: its backward is
    written here, through the collectives)."""

    def __init__(self, eps, axis, name, process_set):
        super().__init__()
        self._eps, self._axis, self._name, self._set = eps, axis, name, process_set

    def _shape(self, x, v):
        """`v` (one value per channel) shaped to broadcast over `x`."""
        shape = [1] * len(x.shape)
        shape[self._axis] = x.shape[self._axis]
        return v.reshape(shape)

    def _reduced_axes(self, x):
        return tuple(a for a in range(len(x.shape)) if a != self._axis)

    def forward(self, x, gamma, beta):
        from ferrovod.mxnet import Sum, allreduce

        axes = self._reduced_axes(x)
        channels = x.shape[self._axis]
        count = x.size // channels
        stats = mx.nd.concat(x.sum(axis=axes), (x * x).sum(axis=axes),
                             mx.nd.array([count], dtype=x.dtype), dim=0)
        total = allreduce(stats, op=Sum, name=self._name + ".stats", process_set=self._set)
        n = total[2 * channels:2 * channels + 1]
        mean = total[:channels] / n
        var = total[channels:2 * channels] / n - mean * mean
        inv_std = 1.0 / mx.nd.sqrt(var + self._eps)
        x_hat = (x - self._shape(x, mean)) * self._shape(x, inv_std)
        # a copy of gamma: the backward pass runs inside an engine operation, and reading the
        # parameter there would queue behind the optimizer's update of it, which waits for
        # this backward pass
        self.save_for_backward(x_hat, inv_std, gamma.copy(), n)
        self.mean, self.var = mean, var
        return x_hat * self._shape(x, gamma) + self._shape(x, beta)

    def backward(self, dy):
        from ferrovod.mxnet import Sum, allreduce

        x_hat, inv_std, gamma, n = self.saved_tensors
        axes = self._reduced_axes(dy)
        channels = dy.shape[self._axis]
        dbeta = dy.sum(axis=axes)
        dgamma = (dy * x_hat).sum(axis=axes)
        total = allreduce(mx.nd.concat(dbeta, dgamma, dim=0), op=Sum,
                          name=self._name + ".grads", process_set=self._set)
        mean_dy = self._shape(dy, total[:channels] / n)
        mean_dy_xhat = self._shape(dy, total[channels:] / n)
        dx = self._shape(dy, gamma * inv_std) * (dy - mean_dy - x_hat * mean_dy_xhat)
        # this rank's parameter gradients: the data-parallel trainer sums (averages) them
        return dx, dgamma, dbeta


class SyncBatchNorm(mx.gluon.nn.BatchNorm):
    """BatchNorm whose training statistics cover the batches of every rank of `process_set`.
    Arguments as Gluon's BatchNorm. Imperative only (do not hybridize): the statistics travel
    through ferrovod's engine operations. At inference it is plain BatchNorm on the moving
    statistics."""

    _instances = itertools.count()

    def __init__(self, axis=1, momentum=0.9, epsilon=1e-5, center=True, scale=True,
                 use_global_stats=False, beta_initializer="zeros", gamma_initializer="ones",
                 running_mean_initializer="zeros", running_variance_initializer="ones",
                 in_channels=0, process_set=global_process_set, **kwargs):
        super().__init__(axis=axis, momentum=momentum, epsilon=epsilon, center=center,
                         scale=scale, use_global_stats=use_global_stats,
                         beta_initializer=beta_initializer, gamma_initializer=gamma_initializer,
                         running_mean_initializer=running_mean_initializer,
                         running_variance_initializer=running_variance_initializer,
                         in_channels=in_channels, **kwargs)
        self._process_set = process_set
        # rendezvous names: the same on every rank (layers are built in the same order); a
        # call counter keeps one step's operations apart from the next one's in flight
        self._sync_name = "syncbn.%d" % next(self._instances)
        self._calls = itertools.count()

    def hybrid_forward(self, F, x, gamma, beta, running_mean, running_var):
        if not mx.autograd.is_training() or self._kwargs.get("use_global_stats"):
            return super().hybrid_forward(F, x, gamma, beta, running_mean, running_var)
        if self._kwargs.get("fix_gamma"):
            gamma = mx.nd.ones_like(gamma)
        fn = _SyncBatchNorm(self._kwargs["eps"], self._kwargs["axis"] % len(x.shape),
                            "%s.%d" % (self._sync_name, next(self._calls)), self._process_set)
        y = fn(x, gamma, beta)
        momentum = self._kwargs["momentum"]
        with mx.autograd.pause():
            running_mean[:] = running_mean * momentum + fn.mean * (1 - momentum)
            running_var[:] = running_var * momentum + fn.var * (1 - momentum)
        return y
