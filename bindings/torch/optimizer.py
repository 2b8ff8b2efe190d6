"""`DistributedOptimizer`: Horovod's PyTorch optimizer wrapper on ferrovod.

A hook on each parameter's gradient accumulation starts the allreduce as soon as backward has
produced the gradient (by default that of its bucket, once the bucket's last gradient is
there), so communication overlaps the rest of the backward pass; `step()` (or
`synchronize()`) waits for them and writes the averages into `.grad`."""

import os
import warnings
from contextlib import contextmanager

import torch

from ferrovod import _core
from ferrovod.compression import core_codec
from ferrovod.torch import mpi_ops
from ferrovod.torch.mpi_ops import Average, Compression
from horovod.common.process_sets import global_process_set
from horovod.common.util import split_list


def _bucket_bytes():
    """FERROVOD_TORCH_BUCKET_BYTES: the size of the gradient buckets (default 25 MiB, as DDP's;
    0: one allreduce per gradient, Horovod's way)."""
    raw = os.environ.get("FERROVOD_TORCH_BUCKET_BYTES", "").strip()
    if not raw:
        return 25 << 20
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError("FERROVOD_TORCH_BUCKET_BYTES=%r is not a number of bytes" % raw)
    return value


# Horovod's error for a gradient computed again before step()
_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")

# the first bucket (the gradients backward produces first) is small, as DDP's, so that
# communication starts early in the backward pass
_FIRST_BUCKET_BYTES = 1 << 20


class _Bucket:
    """Gradients that travel as one allreduce: their `.grad` become views of one flat buffer
    (from the first step: backward then accumulates into them in place), so the hook of each
    only counts it ready, and the buffer's allreduce starts when the last of them is (one
    enqueue and one wait per bucket instead of per gradient). A parameter whose gradient comes
    sparse keeps it and is reduced alone; its place in the buffer stays zero."""

    __slots__ = ("params", "buffer", "views", "adopted", "sparse", "label", "ready", "started")

    def __init__(self, params, label):
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.views, at = [], 0
        for p in params:
            self.views.append(self.buffer[at:at + p.numel()].view_as(p))
            at += p.numel()
        self.adopted = set()  # indices of parameters whose gradient is its view
        self.sparse = set()  # indices of parameters with sparse gradients
        self.label = label
        self.ready = 0
        self.started = False

    def adopt(self, index):
        """The parameter's gradient into its view (one it had, or None: zeros, as Horovod
        sends for a gradient a rank lacks)."""
        p, view = self.params[index], self.views[index]
        g = p.grad
        if g is not view:
            if g is not None:
                view.copy_(g)
            p.grad = view
        self.adopted.add(index)


def _buckets_of(params, names, cap):
    """`params` (in the order backward usually produces their gradients: the reverse of the
    model's) cut into buckets of one device and dtype, at most `cap` bytes each (the first
    `_FIRST_BUCKET_BYTES`), a parameter larger than the cap alone. The same parameters give the
    same buckets and names on every rank."""
    buckets, current, size = [], [], 0
    limit = min(cap, _FIRST_BUCKET_BYTES)

    def close():
        nonlocal current, size, limit
        if current:
            label = "allreduce.bucket.%d.%s" % (len(current), names[current[0]])
            buckets.append(_Bucket(current, label))
            limit = cap
        current, size = [], 0

    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (p.dtype != current[0].dtype or p.device != current[0].device
                        or size + nbytes > limit):
            close()
        current.append(p)
        size += nbytes
    close()
    return buckets


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's own class by `DistributedOptimizer` (as Horovod does),
    so that `isinstance(opt, torch.optim.SGD)` and the wrapped class's `step` keep working."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        if named_parameters is None:
            named_parameters = [("allreduce.noname.%d.%d" % (i, j), v)
                                for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        named_parameters = list(named_parameters)
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        seen, dups = set(), set()
        for name, _ in named_parameters:
            (dups if name in seen else seen).add(name)
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found "
                             "duplicates: %s" % ", ".join(sorted(dups)))
        named_ids = {id(v) for _, v in named_parameters}
        unnamed = [id(v) for group in self.param_groups for v in group["params"]
                   if id(v) not in named_ids]
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters "
                             "were not named. Python object ids: %s"
                             % ", ".join(str(i) for i in unnamed))
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named_parameters}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        # parameter (or group tuple) -> (handle or None, compression context)
        self._handles = {}
        self._hook_handles = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True
        if groups is not None:
            if not (isinstance(groups, list) or groups > 0):
                raise ValueError("groups should be a non-negative integer or a list of list of "
                                 "torch.Tensor.")
            if isinstance(groups, list):
                grouped = set()
                for group in groups:
                    for p in group:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("groups must consist of torch.Tensor.")
                        if id(p) in grouped:
                            raise ValueError("A parameter can only appear once in groups.")
                        grouped.add(id(p))
        self._groups = groups
        self._p_to_group = {}
        self._group_counts = {}
        self._buckets = []
        if process_set.included() and (_core.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._register_hooks()

    def load_state_dict(self, *args, **kwargs):
        self._handles.clear()  # (the hooks hold this dict)
        for bucket in self._buckets:
            bucket.ready, bucket.started = 0, False
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _register_hooks(self):
        trained = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self._groups is not None:
            # the same order (hence the same groups) on every rank: rank 0's
            from ferrovod.torch.functions import broadcast_object

            names = broadcast_object(
                [self._parameter_names.get(p) for p in trained], root_rank=0,
                process_set=self.process_set)
            order = {n: i for i, n in enumerate(names)}
            trained = sorted(trained, key=lambda p: order[self._parameter_names.get(p)])
            if isinstance(self._groups, list):
                wanted = {id(p) for p in trained}
                groups = [[p for p in g if id(p) in wanted] for g in self._groups]
                in_group = {id(p) for g in groups for p in g}
                groups += [[p] for p in trained if id(p) not in in_group]
            else:
                groups = split_list(trained, self._groups)
            for group in (tuple(g) for g in groups if g):
                for p in group:
                    self._p_to_group[p] = group
                self._group_counts[group] = 0
        for p in trained:
            self._requires_update.add(p)
        cap = _bucket_bytes()
        if cap > 0 and self._bucketable(trained):
            names = {p: self._parameter_names.get(p) for p in trained}
            self._buckets = _buckets_of(list(reversed(trained)), names, cap)
            for bucket in self._buckets:
                for i, p in enumerate(bucket.params):
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(
                        self._make_bucket_hook(p, i, bucket)))
            return
        for p in trained:
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _bucketable(self, trained):
        """Whether the gradients can travel in buckets: no `groups` (Horovod's grouping
        stands), and no compressor that must run in Python on each gradient (the core's codecs
        take float32 buffers whole) or that needs each gradient's shape (PowerSGD)."""
        if self._groups is not None or not trained:
            return False
        if self._compression is None or self._compression is Compression.none:
            return True
        return (all(p.dtype == torch.float32 for p in trained)
                and core_codec(self._compression, True, self.op) is not None
                and not getattr(self._compression, "keeps_shapes", False))

    def _scales(self):
        if self.op == Average:
            # the core divides by the set's size after the sum, on top of the postscale
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            # another rank may have a gradient for it (a branch not taken here): send zeros
            p.grad = p.data.new(p.size()).zero_()
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return mpi_ops.sparse_allreduce_async(tensor, name=name, op=self.op,
                                                      process_set=self.process_set), None
            tensor = tensor.to_dense()
        return self._reduce_async([tensor], [name])

    def _reduce_async(self, tensors, names, label=None):
        """Starts the in-place allreduce of `tensors` (one grouped operation if several);
        returns (handle, contexts): the core compresses float32 gradients itself. `label`: the
        operation's name for one tensor, when the caller has it already."""
        pre, post = self._scales()
        sent, ctxs, codec = mpi_ops._compressed(tensors, self._compression, self.op)
        if len(sent) == 1 and sent[0].is_contiguous():
            # the hot path: one gradient, its C structs reused from the last step
            return mpi_ops._allreduce_one_(sent[0], label or mpi_ops._name("allreduce", names[0]),
                                           self.op, pre, post, self.process_set, codec), ctxs
        labels = ([mpi_ops._name("allreduce", names[0])] if len(sent) == 1
                  else mpi_ops._grouped("allreduce", names[0], sent))
        handle = mpi_ops._allreduce_async(sent, sent, labels, self.op, pre, post,
                                          self.process_set, list, codec)
        return handle, ctxs

    def _make_hook(self, p):
        # what every call needs, looked up once (the hook runs per gradient per step)
        handles, delays = self._handles, self._allreduce_delay
        name = self._parameter_names.get(p)
        label = mpi_ops._name("allreduce", name) if name is not None else None

        def hook(*_):
            delay = delays[p]
            if delay <= 0 and handles.get(p, (None,))[0] is not None:
                raise AssertionError(_TOO_MANY_PASSES)
            grad = p.grad
            assert not grad.requires_grad
            assert delay > 0
            delay -= 1
            delays[p] = delay
            handle = ctx = None
            if delay == 0:
                if self._groups is None and not grad.is_sparse:
                    handles[p] = self._reduce_async([grad], [name], label)
                    return
                if self._groups is not None:
                    group = self._p_to_group[p]
                    self._group_counts[group] += 1
                    if self._group_counts[group] == len(group):
                        self._handles[group] = self._reduce_async(
                            [g.grad for g in group], [self._parameter_names.get(group[0])])
                        for g in group:
                            self._handles.pop(g, None)
                        self._group_counts[group] = 0
                        return
                else:
                    handle, ctx = self._allreduce_grad_async(p)
            handles[p] = (handle, ctx)

        return hook

    def _start_bucket(self, bucket):
        bucket.started = True
        pre, post = self._scales()
        _, _, codec = mpi_ops._compressed([bucket.buffer], self._compression, self.op)
        self._handles[bucket] = (mpi_ops._allreduce_one_(
            bucket.buffer, bucket.label, self.op, pre, post, self.process_set, codec), None)

    def _make_bucket_hook(self, p, index, bucket):
        # the per-gradient work of bucketed mode: count the gradient ready, start the bucket
        # with its last one (a sparse gradient goes alone, its view in the bucket left at zero)
        delays, view = self._allreduce_delay, bucket.views[index]

        def hook(*_):
            delay = delays[p]
            if delay <= 0:
                raise AssertionError(_TOO_MANY_PASSES)
            delay -= 1
            delays[p] = delay
            if delay:
                return
            if p.grad is not view:
                if p.grad.is_sparse:
                    bucket.sparse.add(index)
                    self._handles[p] = self._allreduce_grad_async(p)
                else:
                    bucket.adopt(index)
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._start_bucket(bucket)

        return hook

    def synchronize(self):
        """Waits for every gradient's allreduce (starting those whose hook did not fire) and
        writes the results into `.grad`."""
        if not self.process_set.included():
            self._synchronized = True
            return
        if self._buckets:
            return self._synchronize_buckets()
        if self._groups is not None or len(self._handles) != len(self._requires_update):
            started = set()
            for key in self._handles:
                started.update(key if isinstance(key, tuple) else (key,))
            for p in self._requires_update - started:
                self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, ctx) in list(self._handles.items()):
            if handle is None:
                self._handles[p] = self._allreduce_grad_async(p)
        for key, output, ctxs in self._waited():
            if isinstance(key, tuple):
                for p, out, ctx in zip(key, output, ctxs):
                    self._allreduce_delay[p] = self.backward_passes_per_step
                    self._write_grad(p, out, ctx)
                self._group_counts[key] = 0
                continue
            p = key
            self._allreduce_delay[p] = self.backward_passes_per_step
            if self._groups is not None:
                self._group_counts[self._p_to_group[p]] = 0
            self._write_alone(p, output, ctxs)
        self._handles.clear()
        self._synchronized = True

    def _synchronize_buckets(self):
        for bucket in self._buckets:
            if not bucket.started:
                # a gradient backward did not produce (or not yet as often as
                # backward_passes_per_step) goes as what it has accumulated, or zeros
                for i in range(len(bucket.params)):
                    if i not in bucket.sparse:
                        bucket.adopt(i)
                self._start_bucket(bucket)
        for key, output, ctx in self._waited():
            if not isinstance(key, _Bucket):  # a sparse gradient
                self._write_alone(key, output, ctx)
        for bucket in self._buckets:
            bucket.ready, bucket.started = 0, False
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        self._synchronized = True

    def _waited(self):
        """Every handle in flight waited for at once (a sparse allreduce's is a function that
        waits, as Horovod's): (key, output, contexts) in the handles' order."""
        items = list(self._handles.items())
        outputs = iter(mpi_ops._synchronize_all(
            [h for _, (h, _) in items if not callable(h)]))
        return [(key, handle() if callable(handle) else next(outputs), ctx)
                for key, (handle, ctx) in items]

    def _write_alone(self, p, output, ctx):
        """`_write_grad` of a gradient reduced on its own (its output and context may come as
        one-element lists)."""
        if isinstance(output, list):
            (output,), (ctx,) = output, ctx
        self._write_grad(p, output, ctx)

    def _write_grad(self, p, output, ctx):
        value = self._compression.decompress(output, ctx) if ctx is not None else output
        if p.grad.is_sparse:
            if not value.is_sparse:
                value = value.to_sparse()
            p.grad.zero_().add_(value)
        elif value is not p.grad:
            p.grad.set_(value)

    @contextmanager
    def skip_synchronize(self):
        """`step()` inside it does not synchronize (after an explicit `synchronize()`)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        if self._buckets:
            # dense gradients stay views of their buckets (one fill per bucket); one that would
            # be None is zeros, as Horovod's synchronize makes it anyway
            set_to_none = kwargs.get("set_to_none", args[0] if args else True)
            for bucket in self._buckets:
                bucket.buffer.zero_()
                for i, p in enumerate(bucket.params):
                    if i in bucket.adopted:
                        bucket.adopt(i)
                    elif set_to_none:
                        p.grad = None
                    elif p.grad is not None:
                        p.grad.zero_()
            return None
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wraps `optimizer` so that gradients are averaged (`op`) over the process set before each
    `step()`. Allreduces start from hooks as backward produces the gradients: by default one
    per bucket of gradients (FERROVOD_TORCH_BUCKET_BYTES; 0: one per gradient).
    `backward_passes_per_step`: backward passes accumulated locally before each allreduce;
    `groups`: a number of groups, or lists of parameters, reduced as grouped allreduces;
    `gradient_predivide_factor`: the average is split into 1/f before the sum and f/size after;
    `compression`: float32 gradients are compressed by the core (fp16, and ferrovod's bf16,
    mixed, u8); other dtypes by the compressor in Python."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == mpi_ops.Adasum:
        raise NotImplementedError("Adasum is not supported by ferrovod.")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, groups, sparse_as_dense, process_set)
