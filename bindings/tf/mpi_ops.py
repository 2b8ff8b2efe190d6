"""TensorFlow ops over ferrovod (Horovod's `horovod/tensorflow/mpi_ops.py` API): the raw
collectives, their gradients, and the process-level functions. Higher-level helpers
(DistributedOptimizer, compression, IndexedSlices) build on these."""

import re

import tensorflow as tf
from tensorflow.python.framework import ops

from ferrovod import _core
from ferrovod.tensorflow.build import op_library_path
from horovod.common.process_sets import global_process_set, registered_id

MPI_LIB = tf.load_op_library(op_library_path())

from horovod.common.basics import *  # noqa: E402,F401,F403 (init, rank, size, ..., Sum, Average, ...)


def _normalize_name(name):
    """Node names may not contain ':' and other characters tensor names have."""
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def _executing_eagerly():
    return tf.executing_eagerly()


def _name(prefix, tensor, name):
    if name is None and not _executing_eagerly():
        name = "%s_%s" % (prefix, _normalize_name(tensor.name))
    return name


def _eager_name(name):
    """The `tensor_name` attr: an eager kernel's node name is its op type whatever `name` says,
    so a name given in eager mode travels as the attr (graph mode keeps node names, scoped as
    Horovod does). Without it every eager allreduce would share one name, and the state the
    core keeps per name (the u8 codec's residuals) with it."""
    return name if name is not None and _executing_eagerly() else ""


def _group_name(prefix, tensors, name):
    """Graph mode default name of a grouped op: from its first and last tensor."""
    if name is None and not _executing_eagerly():
        name = _normalize_name("%s_%s_%s" % (prefix, tensors[0].name, tensors[-1].name))
    return name


def _allreduce(tensor, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
               ignore_name_scope=False, process_set=global_process_set,
               compression=_core.COMPRESSION_JOB):
    """Reduces `tensor` across the process set (no averaging convenience: `op` as given);
    `compression`: an fv_compression value, how ferrovod's core carries f32 sums and averages."""
    return MPI_LIB.horovod_allreduce(
        tensor, name=_name("HorovodAllreduce", tensor, name), reduce_op=op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        ignore_name_scope=ignore_name_scope, process_set_id=registered_id(process_set),
        compression=compression, tensor_name=_eager_name(name))


@ops.RegisterGradient("HorovodAllreduce")
def _allreduce_grad(op, grad):
    reduce_op = op.get_attr("reduce_op")
    if reduce_op not in (Sum, Average):
        raise NotImplementedError("The gradient of an allreduce with op %d is not defined" % reduce_op)
    return _allreduce(grad, op=reduce_op, prescale_factor=op.get_attr("prescale_factor"),
                      postscale_factor=op.get_attr("postscale_factor"),
                      ignore_name_scope=op.get_attr("ignore_name_scope"),
                      process_set=_process_set(op), name=_grad_name(op, "_grad"),
                      compression=op.get_attr("compression"))


def _grad_name(op, suffix):
    """Graph mode: name gradient collectives after their forward op, so every rank agrees even
    where the gradient graphs' other node names differ (e.g. shape-dependent helper ops)."""
    if _executing_eagerly():
        return None
    name = getattr(op, "name", None)
    if not name:
        # GradientTape hands in a stand-in op without a name; its outputs are the forward op's
        try:
            name = op.outputs[0].op.name
        except (AttributeError, IndexError, TypeError):
            return None
    return _normalize_name(name) + suffix


def _process_set(op):
    from horovod.common.process_sets import _registered

    set_id = op.get_attr("process_set_id")
    return _registered.get(set_id, global_process_set)


def _grouped_allreduce(tensors, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
                       ignore_name_scope=False, process_set=global_process_set,
                       compression=_core.COMPRESSION_JOB):
    given = name
    name = _group_name("HorovodGroupedAllreduce", tensors, name)
    return MPI_LIB.horovod_grouped_allreduce(
        tensors, name=name, reduce_op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, ignore_name_scope=ignore_name_scope,
        process_set_id=registered_id(process_set), compression=compression,
        tensor_name=_eager_name(given))


def _output_dtype_grads(op, grads):
    """The incoming gradients cast to their outputs' dtype: TensorFlow may hand a grouped op's
    gradient function a caller-supplied gradient of another dtype next to its own zero-filled
    ones, and a grouped collective carries a single dtype."""
    return [g if g.dtype == out.dtype else tf.cast(g, out.dtype)
            for g, out in zip(map(tf.convert_to_tensor, grads), op.outputs)]


@ops.RegisterGradient("HorovodGroupedAllreduce")
def _grouped_allreduce_grad(op, *grads):
    return _grouped_allreduce(_output_dtype_grads(op, grads), op=op.get_attr("reduce_op"),
                              prescale_factor=op.get_attr("prescale_factor"),
                              postscale_factor=op.get_attr("postscale_factor"),
                              ignore_name_scope=op.get_attr("ignore_name_scope"),
                              process_set=_process_set(op), name=_grad_name(op, "_grad"),
                              compression=op.get_attr("compression"))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenates every rank's `tensor` along the first dimension, which may differ per rank."""
    return MPI_LIB.horovod_allgather(
        tensor, name=_name("HorovodAllgather", tensor, name), ignore_name_scope=ignore_name_scope,
        process_set_id=registered_id(process_set))


@ops.RegisterGradient("HorovodAllgather")
def _allgather_grad(op, grad):
    """Average the gradient over ranks, then keep this rank's rows."""
    process_set = _process_set(op)
    grad = _allreduce(grad, op=Average, process_set=process_set, name=_grad_name(op, "_grad"))
    return _own_rows(grad, op.inputs[0], process_set, _grad_name(op, "_grad_sizes"))


def _own_rows(grad, tensor, process_set, name=None):
    """This rank's rows of an allgathered gradient (every rank's first dimension may differ)."""
    with tf.device("/cpu:0"):
        d = tf.shape(tensor)[:1]
        sizes = allgather(d, process_set=process_set, name=name)
    splits = tf.split(grad, num_or_size_splits=sizes, axis=0, num=process_set.size())
    return splits[process_set.rank()]


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    name = _group_name("HorovodGroupedAllgather", tensors, name)
    return MPI_LIB.horovod_grouped_allgather(
        tensors, name=name, ignore_name_scope=ignore_name_scope,
        process_set_id=registered_id(process_set))


@ops.RegisterGradient("HorovodGroupedAllgather")
def _grouped_allgather_grad(op, *grads):
    process_set = _process_set(op)
    grads = _grouped_allreduce(_output_dtype_grads(op, grads), op=Average, process_set=process_set,
                               name=_grad_name(op, "_grad"))
    return [_own_rows(g, t, process_set, _grad_name(op, "_grad_sizes_%d" % i))
            for i, (g, t) in enumerate(zip(grads, op.inputs))]


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """`root_rank`'s tensor (a global rank) on every rank of the process set."""
    return MPI_LIB.horovod_broadcast(
        tensor, name=_name("HorovodBroadcast", tensor, name), root_rank=root_rank,
        ignore_name_scope=ignore_name_scope, process_set_id=registered_id(process_set))


@ops.RegisterGradient("HorovodBroadcast")
def _broadcast_grad(op, grad):
    root_rank = op.get_attr("root_rank")
    process_set = _process_set(op)
    grad_reduced = _allreduce(grad, op=Average, process_set=process_set, name=_grad_name(op, "_grad"))
    if rank() != root_rank:
        return grad_reduced * 0
    return grad_reduced


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Scatters rows of `tensor` to the ranks (`splits[i]` rows to rank i, or evenly) and gathers
    what they send; returns the output, and with `splits` given (output, received_splits)."""
    if splits is None:
        splits_ = tf.convert_to_tensor([], dtype=tf.int32)
    else:
        splits_ = tf.convert_to_tensor(splits, dtype=tf.int32)
    output, received_splits = MPI_LIB.horovod_alltoall(
        tensor, splits=splits_, name=_name("HorovodAlltoall", tensor, name),
        ignore_name_scope=ignore_name_scope, process_set_id=registered_id(process_set))
    # as Horovod: the received splits only when splits were given
    return output if splits is None else (output, received_splits)


@ops.RegisterGradient("HorovodAlltoall")
def _alltoall_grad(op, grad_wrt_output, grad_wrt_received_splits):
    recvsplits = op.outputs[1]
    grad_wrt_tensor, _ = alltoall(grad_wrt_output, splits=recvsplits, process_set=_process_set(op),
                                  name=_grad_name(op, "_grad"))
    return [grad_wrt_tensor, None]


def reducescatter(tensor, name=None, op=Average, ignore_name_scope=False,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces `tensor` and leaves each rank its slice of rows (remainder to the lowest ranks)."""
    return MPI_LIB.horovod_reducescatter(
        tensor, name=_name("HorovodReducescatter", tensor, name), reduce_op=op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        ignore_name_scope=ignore_name_scope, process_set_id=registered_id(process_set))


@ops.RegisterGradient("HorovodReducescatter")
def _reducescatter_grad(op, grad):
    process_set = _process_set(op)
    if op.get_attr("reduce_op") == Sum:
        grad *= process_set.size()
    grad *= op.get_attr("prescale_factor") * op.get_attr("postscale_factor")
    return allgather(grad, process_set=process_set, name=_grad_name(op, "_grad"))


def grouped_reducescatter(tensors, name=None, op=Average, ignore_name_scope=False,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    name = _group_name("HorovodGroupedReducescatter", tensors, name)
    return MPI_LIB.horovod_grouped_reducescatter(
        tensors, name=name, reduce_op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, ignore_name_scope=ignore_name_scope,
        process_set_id=registered_id(process_set))


@ops.RegisterGradient("HorovodGroupedReducescatter")
def _grouped_reducescatter_grad(op, *grads):
    process_set = _process_set(op)
    factor = op.get_attr("prescale_factor") * op.get_attr("postscale_factor")
    if op.get_attr("reduce_op") == Sum:
        factor *= process_set.size()
    return grouped_allgather([g * factor for g in _output_dtype_grads(op, grads)],
                             process_set=process_set,
                             name=_grad_name(op, "_grad"))


def join():
    """Waits until every rank has joined; joined ranks contribute zeros to allreduces. Returns
    the last rank to join."""
    return MPI_LIB.horovod_join()


def barrier(process_set=global_process_set):
    return MPI_LIB.horovod_barrier(process_set_id=registered_id(process_set))


def size_op(process_set_id=0, name=None):
    return MPI_LIB.horovod_size(process_set_id=process_set_id, name=name)


def process_set_included_op(process_set_id=0, name=None):
    return MPI_LIB.horovod_process_set_included(process_set_id=process_set_id, name=name)


def local_size_op(name=None):
    return MPI_LIB.horovod_local_size(name=name)


def rank_op(name=None):
    return MPI_LIB.horovod_rank(name=name)


def local_rank_op(name=None):
    return MPI_LIB.horovod_local_rank(name=name)


for _op_type in ("HorovodSize", "HorovodProcessSetIncluded", "HorovodLocalSize", "HorovodRank",
                 "HorovodLocalRank", "HorovodJoin", "HorovodBarrier"):
    ops.NotDifferentiable(_op_type)
