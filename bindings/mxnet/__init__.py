"""Horovod's MXNet API on ferrovod (`import ferrovod.mxnet as hvd`; the `horovod` package maps
`horovod.mxnet` here). The collectives are pushed onto MXNet's dependency engine
(mpi_ops.cc): they run once their inputs are written, overlap other work, and
`wait_to_read()`, `asnumpy()` and `mx.nd.waitall()` wait for them; a failure is raised there
as MXNetError with ferrovod's message."""

import ctypes
import itertools

import mxnet as mx

from ferrovod import _core  # loads libferrovod (RTLD_GLOBAL) before the op library needs it
from ferrovod.mxnet.build import op_library_path
from horovod.common.basics import HorovodBasics as _HorovodBasics
from horovod.common.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from horovod.common.util import get_average_backwards_compatibility_fun

_LIB = ctypes.CDLL(op_library_path())
_LIB.fvmx_push.restype = ctypes.c_int
_LIB.fvmx_push.argtypes = [
    ctypes.c_int32, ctypes.c_int32, ctypes.c_double, ctypes.c_double, ctypes.c_int32,
    ctypes.c_int32, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
    ctypes.c_char_p, ctypes.c_size_t,
]

_basics = _HorovodBasics(__file__)

init = _basics.init
shutdown = _basics.shutdown
is_initialized = _basics.is_initialized
start_timeline = _basics.start_timeline
stop_timeline = _basics.stop_timeline
size = _basics.size
local_size = _basics.local_size
cross_size = _basics.cross_size
rank = _basics.rank
local_rank = _basics.local_rank
cross_rank = _basics.cross_rank
is_homogeneous = _basics.is_homogeneous
mpi_threads_supported = _basics.mpi_threads_supported
mpi_enabled = _basics.mpi_enabled
mpi_built = _basics.mpi_built
gloo_enabled = _basics.gloo_enabled
gloo_built = _basics.gloo_built
nccl_built = _basics.nccl_built
ddl_built = _basics.ddl_built
ccl_built = _basics.ccl_built
cuda_built = _basics.cuda_built
rocm_built = _basics.rocm_built
metrics = _basics.metrics

Average = _basics.Average
Sum = _basics.Sum
Adasum = _basics.Adasum
Min = _basics.Min
Max = _basics.Max
Product = _basics.Product


class _ReduceOps:
    Average, Sum, Adasum = Average, Sum, Adasum


_op_from = get_average_backwards_compatibility_fun(_ReduceOps)

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


def _push(kind, tensor, output, name, reduce_op=Sum, prescale=1.0, postscale=1.0, root_rank=0,
          priority=0, process_set=global_process_set):
    _checked(tensor)
    if process_set.process_set_id != 0:
        process_set.size()  # as Horovod: ValueError for a set that was never registered
    err = ctypes.create_string_buffer(1024)
    rc = _LIB.fvmx_push(kind, reduce_op, prescale, postscale, root_rank,
                        process_set.process_set_id, name.encode(), tensor.handle, output.handle,
                        priority, err, len(err))
    if rc != 0:
        raise RuntimeError(err.value.decode())
    return output


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set, op=None):
    """The reduction (Average by default) of `tensor` over the process set, as a new NDArray;
    `tensor` is left alone."""
    op = _op_from(op, average)
    if op == Adasum:
        raise NotImplementedError("Adasum is not supported by ferrovod.")
    output = _like(tensor)
    return _push(_core.ALLREDUCE, tensor, output, _name("horovod_allreduce", name), op,
                 prescale_factor, postscale_factor, priority=priority, process_set=process_set)


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, op=None):
    """In-place allreduce: `tensor` holds the reduction once the engine has run it."""
    op = _op_from(op, average)
    if op == Adasum:
        raise NotImplementedError("Adasum is not supported by ferrovod.")
    return _push(_core.ALLREDUCE, tensor, tensor, _name("horovod_allreduce", name), op,
                 prescale_factor, postscale_factor, priority=priority, process_set=process_set)


def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """`root_rank`'s `tensor` on every rank of the process set, as a new NDArray."""
    output = _like(tensor)
    return _push(_core.BROADCAST, tensor, output, _name("horovod_broadcast", name),
                 root_rank=root_rank, priority=priority, process_set=process_set)


def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """In-place broadcast."""
    return _push(_core.BROADCAST, tensor, tensor, _name("horovod_broadcast", name),
                 root_rank=root_rank, priority=priority, process_set=process_set)
