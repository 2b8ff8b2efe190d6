"""Horovod's MXNet API on ferrovod (`import ferrovod.mxnet as hvd`; the `horovod` package maps
`horovod.mxnet` here). The collectives are pushed onto MXNet's dependency engine
(mpi_ops.cc): they run once their inputs are written, overlap other work, and
`wait_to_read()`, `asnumpy()` and `mx.nd.waitall()` wait for them; a failure is raised there
as MXNetError with ferrovod's message. `allgather` and `alltoall` agree shapes, dtypes and
counts synchronously before they push; `barrier`, `join`, `broadcast_parameters`,
`broadcast_object` and `allgather_object` wait."""

import collections
import ctypes
import itertools
import warnings

import mxnet as mx
import numpy as np

from ferrovod import compression as _compression
from ferrovod import objects as _objects
from ferrovod import _core  # loads libferrovod (RTLD_GLOBAL) before the op library needs it
from ferrovod.mxnet.build import op_library_path
from horovod.common.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    registered_id,
    remove_process_set,
)
from horovod.common.basics import reduce_op_of

_LIB = ctypes.CDLL(op_library_path())
_LIB.fvmx_push.restype = ctypes.c_int
_LIB.fvmx_push.argtypes = [
    # kind, reduce_op, prescale, postscale, root_rank, process_set, compression, splits,
    # nsplits, n, names
    ctypes.c_int32, ctypes.c_int32, ctypes.c_double, ctypes.c_double, ctypes.c_int32,
    ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
    ctypes.c_int32, ctypes.POINTER(ctypes.c_char_p),
    ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32,
    ctypes.c_char_p, ctypes.c_size_t,
]

from horovod.common.basics import *  # noqa: E402,F401,F403 (init, rank, size, ..., Sum, Average, ...)


# names of unnamed operations, numbered in call order (the same on every rank, as Horovod's)
_unnamed = itertools.count(1)


def _name(prefix, name):
    if name is None:
        return "%s.noname.%d" % (prefix, next(_unnamed))
    return "%s.%s" % (prefix, name)


def _checked(tensor):
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError("ferrovod.mxnet expects an mxnet.nd.NDArray, not %s" % type(tensor).__name__)
    if tensor.context.device_type != "cpu":
        raise NotImplementedError("ferrovod.mxnet runs on CPU NDArrays (got %s)" % tensor.context)
    return tensor


def _like(tensor):
    """A new NDArray for the result of a collective over `tensor`."""
    _checked(tensor)
    return mx.nd.zeros(shape=tensor.shape, ctx=tensor.context, dtype=tensor.dtype)


def _push(kind, tensors, outputs, names, reduce_op=Sum, prescale=1.0, postscale=1.0,
          root_rank=0, priority=0, process_set=global_process_set,
          compression=_core.COMPRESSION_JOB, splits=None):
    """Pushes one engine operation (and one ferrovod operation) over `tensors` into
    `outputs`; returns `outputs`."""
    for t in tensors:
        _checked(t)
    if registered_id(process_set) != 0:
        process_set.size()  # as Horovod: ValueError for a set that is no longer registered
    n = len(tensors)
    c_names = (ctypes.c_char_p * n)(*[name.encode() for name in names])
    c_in = (ctypes.c_void_p * n)(*[t.handle.value for t in tensors])
    c_out = (ctypes.c_void_p * n)(*[o.handle.value for o in outputs])
    c_splits = None if splits is None else (ctypes.c_int32 * len(splits))(*splits)
    err = ctypes.create_string_buffer(4096)
    rc = _LIB.fvmx_push(kind, reduce_op, prescale, postscale, root_rank,
                        registered_id(process_set), compression, c_splits,
                        0 if splits is None else len(splits), n, c_names, c_in, c_out,
                        priority, err, len(err))
    if rc != 0:
        # refused at the call (e.g. outputs that overlap), or run and failed inside the push
        # (NaiveEngine): MXNetError, as where the engine raises a failure
        raise mx.base.MXNetError(err.value.decode(errors="replace"))
    return outputs


def _group_names(prefix, name, n):
    base = _name(prefix, name)
    return [base if n == 1 else "%s_%dof%d" % (base, i + 1, n) for i in range(n)]


_reduce_op = reduce_op_of


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set, op=None):
    """The reduction (Average by default) of `tensor` over the process set, as a new NDArray;
    `tensor` is left alone."""
    op = _reduce_op(op, average)
    return _push(_core.ALLREDUCE, [tensor], [_like(tensor)], [_name("horovod_allreduce", name)],
                 op, prescale_factor, postscale_factor, priority=priority,
                 process_set=process_set)[0]


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, op=None):
    """In-place allreduce: `tensor` holds the reduction once the engine has run it."""
    op = _reduce_op(op, average)
    return _push(_core.ALLREDUCE, [tensor], [tensor], [_name("horovod_allreduce", name)], op,
                 prescale_factor, postscale_factor, priority=priority,
                 process_set=process_set)[0]


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set, op=None):
    """Allreduce of several tensors, negotiated and completed together (one engine op)."""
    op = _reduce_op(op, average)
    tensors = list(tensors)
    if not tensors:
        return []
    return _push(_core.ALLREDUCE, tensors, [_like(t) for t in tensors],
                 _group_names("horovod_grouped_allreduce", name, len(tensors)), op,
                 prescale_factor, postscale_factor, priority=priority, process_set=process_set)


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, op=None):
    """In-place grouped allreduce."""
    op = _reduce_op(op, average)
    tensors = list(tensors)
    if not tensors:
        return []
    return _push(_core.ALLREDUCE, tensors, tensors,
                 _group_names("horovod_grouped_allreduce", name, len(tensors)), op,
                 prescale_factor, postscale_factor, priority=priority, process_set=process_set)


def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """`root_rank`'s `tensor` on every rank of the process set, as a new NDArray."""
    return _push(_core.BROADCAST, [tensor], [_like(tensor)], [_name("horovod_broadcast", name)],
                 root_rank=root_rank, priority=priority, process_set=process_set)[0]


def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """In-place broadcast."""
    return _push(_core.BROADCAST, [tensor], [tensor], [_name("horovod_broadcast", name)],
                 root_rank=root_rank, priority=priority, process_set=process_set)[0]


# the most dimensions an allgather or alltoall agrees on before it pushes
_MAX_DIMS = 8


def _agree(kind_name, tensor, label, process_set, counts=None, bad=None):
    """Every rank's dtype, shape, argument error (`bad`, a message or None) and `counts`
    (alltoall: rows to each rank), gathered synchronously, so that a mismatch or a bad argument
    on any rank fails the call on every rank alike, before anything is pushed. Returns the
    table: one row per rank, [dtype, ndim, dims (padded), bad, counts...]."""
    _checked(tensor)
    if len(tensor.shape) == 0 or len(tensor.shape) > _MAX_DIMS:
        bad = bad or "%s takes tensors of 1 to %d dimensions" % (kind_name, _MAX_DIMS)
    counts = list(counts or [])
    mine = np.full(_MAX_DIMS + 3 + len(counts), -1, np.int64)
    mine[0], mine[1] = np.dtype(tensor.dtype).num, min(len(tensor.shape), _MAX_DIMS)
    mine[2:2 + mine[1]] = tensor.shape[:_MAX_DIMS]
    mine[_MAX_DIMS + 2] = int(bad is not None)
    mine[_MAX_DIMS + 3:] = counts
    (table,) = _core.enqueue(_core.ALLGATHER, [mine], [label + ".agree"],
                             process_set=registered_id(process_set)).wait()
    table = table.reshape(-1, len(mine))
    # MXNetError (a RuntimeError), as Horovod's MXNet ops raise for bad arguments
    if bad is not None:
        raise mx.base.MXNetError("%s (tensor '%s')" % (bad, label))
    if (table[:, _MAX_DIMS + 2] != 0).any():
        raise mx.base.MXNetError("%s: another rank's arguments were refused (tensor '%s')"
                                 % (kind_name, label))
    if (table[:, 0] != mine[0]).any():
        raise mx.base.MXNetError("Mismatched %s data types (tensor '%s')" % (kind_name, label))
    if (table[:, 1] != mine[1]).any() or (table[:, 3:_MAX_DIMS + 2] != mine[3:_MAX_DIMS + 2]).any():
        raise mx.base.MXNetError(
            "Mismatched %s tensor shapes: every dimension but the first must agree, got %s "
            "(tensor '%s')" % (kind_name, [tuple(int(d) for d in row[2:2 + row[1]]) for row in table],
                              label))
    return table


def _gathered(tensor, label, process_set):
    """The output of an allgather of `tensor`, sized from every rank's agreed first dimension."""
    table = _agree("ALLGATHER", tensor, label, process_set)
    return mx.nd.zeros(shape=(int(table[:, 2].sum()),) + tuple(tensor.shape[1:]),
                       ctx=tensor.context, dtype=tensor.dtype)


def allgather(tensor, name=None, priority=0, process_set=global_process_set):
    """Every rank's `tensor` concatenated along the first dimension, in rank order. The shapes
    and dtypes are agreed first, synchronously (a small allgather), so that the output exists
    before the engine operation is pushed and a mismatch fails at the call on every rank, as
    in Horovod; the data then moves asynchronously."""
    label = _name("horovod_allgather", name)
    return _push(_core.ALLGATHER, [tensor], [_gathered(tensor, label, process_set)], [label],
                 priority=priority, process_set=process_set)[0]


def grouped_allgather(tensors, name=None, priority=0, process_set=global_process_set):
    """Allgather of several tensors, negotiated and completed together (one engine op)."""
    tensors = list(tensors)
    if not tensors:
        return []
    labels = _group_names("horovod_grouped_allgather", name, len(tensors))
    outputs = [_gathered(t, label, process_set) for t, label in zip(tensors, labels)]
    return _push(_core.ALLGATHER, tensors, outputs, labels, priority=priority,
                 process_set=process_set)


def alltoall(tensor, splits=None, name=None, priority=0, process_set=global_process_set):
    """Rows of `tensor` scattered to the ranks (`splits[j]` rows to rank j, in order; None:
    equal parts) and what every rank sent this one, concatenated in rank order. Returns the
    output, and with `splits` also the rows received from each rank. The counts, dtypes and
    shapes are agreed synchronously first; the data moves on the engine."""
    label = _name("horovod_alltoall", name)
    n, me = process_set.size(), process_set.rank()
    rows = tensor.shape[0] if len(tensor.shape) else 0
    bad = None
    if splits is None:
        counts = [rows // n] * n
        if rows % n:
            bad = "alltoall: %d rows cannot be split equally among %d ranks" % (rows, n)
    else:
        counts = [int(c) for c in (splits.asnumpy() if isinstance(splits, mx.nd.NDArray)
                                   else np.asarray(splits)).reshape(-1)]
        if isinstance(splits, mx.nd.NDArray) and not np.issubdtype(splits.dtype, np.integer):
            bad = "alltoall: splits must be integers, not %s" % np.dtype(splits.dtype).name
        elif len(counts) != n or any(c < 0 for c in counts) or sum(counts) != rows:
            bad = "alltoall: splits %s do not split %d rows among %d ranks" % (counts, rows, n)
        counts = (counts + [0] * n)[:n]
    table = _agree("ALLTOALL", tensor, label, process_set, counts, bad)
    received = [int(c) for c in table[:, _MAX_DIMS + 3 + me]]
    output = mx.nd.zeros(shape=(sum(received),) + tuple(tensor.shape[1:]), ctx=tensor.context,
                         dtype=tensor.dtype)
    _push(_core.ALLTOALL, [tensor], [output], [label], priority=priority,
          process_set=process_set, splits=counts)
    if splits is None:
        return output
    return output, mx.nd.array(received, dtype="int32")


def _scattered(tensor, process_set):
    """The output of a reducescatter of `tensor`: this rank's slice of rows (the remainder to
    the lowest ranks), decided alike on every rank from the shape all must share."""
    _checked(tensor)
    if len(tensor.shape) == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    n, r = process_set.size(), process_set.rank()
    if tensor.shape[0] < n:
        raise ValueError("reducescatter of %d rows over %d ranks would leave a rank none, and "
                         "MXNet's NDArrays cannot be empty" % (tensor.shape[0], n))
    rows = tensor.shape[0] // n + (1 if r < tensor.shape[0] % n else 0)
    return mx.nd.zeros(shape=(rows,) + tuple(tensor.shape[1:]), ctx=tensor.context,
                       dtype=tensor.dtype)


def reducescatter(tensor, op=Average, name=None, priority=0, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """The reduction of `tensor` over the process set, of which each rank keeps its slice of
    rows (the remainder to the lowest ranks)."""
    op = _reduce_op(op, None)
    return _push(_core.REDUCESCATTER, [tensor], [_scattered(tensor, process_set)],
                 [_name("horovod_reducescatter", name)], op, prescale_factor, postscale_factor,
                 priority=priority, process_set=process_set)[0]


def grouped_reducescatter(tensors, op=Average, name=None, priority=0,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reducescatter of several tensors, negotiated and completed together (one engine op)."""
    op = _reduce_op(op, None)
    tensors = list(tensors)
    if not tensors:
        return []
    return _push(_core.REDUCESCATTER, tensors, [_scattered(t, process_set) for t in tensors],
                 _group_names("horovod_grouped_reducescatter", name, len(tensors)), op,
                 prescale_factor, postscale_factor, priority=priority, process_set=process_set)


def join():
    """Waits until every rank has joined (synchronous); while it waits, this rank contributes
    zeros to the other ranks' allreduces. Returns the last rank to join."""
    mx.nd.waitall()  # this rank's pushed operations first
    h = _core.enqueue(_core.JOIN, [], [])
    h.wait()
    return h.last_joined


def barrier(process_set=global_process_set):
    """Returns once every rank of the process set has called it (synchronous)."""
    _core.enqueue(_core.BARRIER, [], [], process_set=registered_id(process_set)).wait()


def broadcast_parameters(params, root_rank=0, prefix=None):
    """Assigns `root_rank`'s values to `params` (a dict of NDArrays, or a Gluon ParameterDict /
    dict of Parameters), in place, in name order. A Gluon parameter whose initialisation is
    deferred (shapes known only at the first forward pass) is broadcast right after it is
    initialised."""
    if not hasattr(params, "items"):
        raise ValueError("invalid params of type: %s" % type(params))
    prefix = prefix or ""
    for key, value in sorted(params.items()):
        label = "%s%s" % (prefix, key)
        if not isinstance(value, mx.gluon.Parameter):
            broadcast_(value, root_rank, name=label)
            continue
        try:
            _broadcast_param(value, root_rank, label)
        except mx.gluon.parameter.DeferredInitializationError:
            _broadcast_when_initialised(value, root_rank, label)
    mx.nd.waitall()


def _broadcast_param(param, root_rank, label):
    """Broadcasts each of a Gluon parameter's copies (one per context) in place."""
    tensors = param.list_data()
    for i, t in enumerate(tensors):
        broadcast_(t, root_rank, name=label if len(tensors) == 1 else "%s.%d" % (label, i))


def _broadcast_when_initialised(param, root_rank, label):
    """Wraps `param`'s deferred initialisation so that its values are broadcast once set (every
    rank initialises at its first forward pass, in the same order)."""
    init = param._init_impl

    def init_then_broadcast(*args, **kwargs):
        init(*args, **kwargs)
        param._init_impl = init
        _broadcast_param(param, root_rank, label)
        mx.nd.waitall()

    param._init_impl = init_then_broadcast


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's `obj` (pickled), in rank order, on every rank of the process set
    (synchronous)."""
    return _objects.allgather_object(obj, name or type(obj).__name__, registered_id(process_set))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """`root_rank`'s `obj` (pickled) on every rank of the process set (synchronous)."""
    return _objects.broadcast_object(obj, root_rank, name or type(obj).__name__,
                                     registered_id(process_set))


class _Compressor:
    """Horovod's compressor interface, `compress(tensor) -> (tensor, ctx)` and
    `decompress(tensor, ctx)`, plus `core`: the fv_compression code ferrovod's core applies to
    float32 sums and averages (cast while packed into the fusion buffer), where the Python
    casts are skipped."""

    core = _core.COMPRESSION_JOB
    wire = None  # the dtype compress() casts floating tensors to (None: none)

    @classmethod
    def compress(cls, tensor):
        if cls.wire is None or not np.issubdtype(tensor.dtype, np.floating) or tensor.dtype == cls.wire:
            return tensor, None
        return tensor.astype(cls.wire), tensor.dtype

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else tensor.astype(ctx)


class _NoneCompressor(_Compressor):
    """Nothing compressed here (the job's FERROVOD_COMPRESSION still applies in the core)."""


class _FP16Compressor(_Compressor):
    core = _core.COMPRESSION_FP16
    wire = np.float16


class _CoreOnly(_Compressor):
    """Compressed by the core only; what it does not compress travels as it is."""


class _BF16Compressor(_CoreOnly):
    core = _core.COMPRESSION_BF16


class _MixedCompressor(_CoreOnly):
    core = _core.COMPRESSION_MIXED


class _U8Compressor(_CoreOnly):
    core = _core.COMPRESSION_U8


class _PowerSGDCompressor(_CoreOnly):
    """PowerSGD's low-rank factors (the job's rank, or `Compression.powersgd(rank=r)`'s)."""

    core = _core.COMPRESSION_POWERSGD
    keeps_shapes = True

    def __init__(self, rank):
        self.core = _compression.powersgd_code(rank)


class _TopKCompressor(_CoreOnly):
    """Top-k's (index, value) pairs (the job's ratio, or `Compression.topk(ratio)`'s)."""

    core = _core.COMPRESSION_TOPK

    def __init__(self, ratio):
        self.core = _compression.topk_code(ratio)


class Compression:
    """How gradients travel: `none`, `fp16` (Horovod's; float32 in the core's codec, other
    floating dtypes cast here), and ferrovod's `bf16`, `mixed`, `u8`, `powersgd`, `topk` (core
    only)."""

    none = _NoneCompressor
    fp16 = _FP16Compressor
    bf16 = _BF16Compressor
    mixed = _MixedCompressor
    u8 = _U8Compressor
    powersgd = _PowerSGDCompressor
    topk = _TopKCompressor


def _reduce_grads(grads, names, predivide, num_groups, process_set, compression):
    """Averages `grads` over the process set, in place: one engine op per gradient, or
    `num_groups` grouped ones. The average is divided into 1/predivide before the sum and
    predivide/size after it."""
    if process_set.size() == 1 or not process_set.included():
        return
    if num_groups > 0:
        from horovod.common.util import split_list

        parts = [(gs, _group_names("horovod_grouped_allreduce", "%s:%s" % (ns[0], ns[-1]), len(gs)))
                 for gs, ns in zip(split_list(grads, num_groups), split_list(names, num_groups))]
    else:
        parts = [([g], [_name("horovod_allreduce", n)]) for g, n in zip(grads, names)]
    for i, (gs, labels) in enumerate(parts):
        if all(g.dtype == np.float32 for g in gs):
            _push(_core.ALLREDUCE, gs, gs, labels, Average, 1.0 / predivide, predivide,
                  priority=-i, process_set=process_set, compression=compression.core)
            continue
        # the Python casts where the core's codec does not apply
        pairs = [compression.compress(g) for g in gs]
        sent = [c for c, _ in pairs]
        _push(_core.ALLREDUCE, sent, sent, labels, Average, 1.0 / predivide, predivide,
              priority=-i, process_set=process_set)
        for g, c, (_, ctx) in zip(gs, sent, pairs):
            if c is not g:
                compression.decompress(c, ctx).copyto(g)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an MXNet optimizer: each `update` first averages the gradient over the process
    set (in place, on the engine), then lets the wrapped optimizer update the weight."""

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0,
                 process_set=global_process_set):
        self._optimizer = optimizer
        self._predivide = gradient_predivide_factor
        self._num_groups = num_groups
        self._process_set = process_set

    def __getattr__(self, item):
        return getattr(self._optimizer, item)

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def _reduce(self, index, grad):
        if isinstance(index, (tuple, list)):
            _reduce_grads(list(grad), [str(i) for i in index], self._predivide,
                          self._num_groups, self._process_set, Compression.none)
        else:
            _reduce_grads([grad], [str(index)], self._predivide, 0, self._process_set,
                          Compression.none)

    def update(self, index, weight, grad, state):
        self._reduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._reduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A Gluon Trainer whose gradients are averaged over the process set by ferrovod (no
    kvstore): `step(batch_size)` then scales by 1/batch_size as Trainer does, so each rank
    passes its own batch size. `prefix` keeps the tensor names of several trainers apart."""

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor=1.0, prefix=None, num_groups=0,
                 process_set=global_process_set):
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer does not take DistributedOptimizer as its "
                          "optimizer; it was unwrapped.")
        # the same parameter order on every rank
        if isinstance(params, dict):
            params = collections.OrderedDict(params)
        elif isinstance(params, (list, tuple)):
            params = sorted(params)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._compression = compression
        self._predivide = gradient_predivide_factor
        self._prefix = prefix or ""
        self._num_groups = num_groups
        self._process_set = process_set

    def _allreduce_grads(self):
        live = [(i, p) for i, p in enumerate(self._params) if p.grad_req != "null"]
        _reduce_grads([p.list_grad()[0] for _, p in live],
                      ["%s%d" % (self._prefix, i) for i, _ in live], self._predivide,
                      self._num_groups, self._process_set, self._compression)



from ferrovod.mxnet.group_comm import GroupComm  # noqa: E402,F401
from ferrovod.mxnet import partial_fc  # noqa: E402,F401
from ferrovod.mxnet.sync_batch_norm import SyncBatchNorm  # noqa: E402,F401
