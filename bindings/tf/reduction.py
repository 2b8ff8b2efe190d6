"""Horovod's user-facing allreduce: averaging semantics, compression, tf.IndexedSlices."""

import tensorflow as tf

from ferrovod import _core
from ferrovod.tensorflow.compression import Compression, core_codec
from ferrovod.tensorflow.mpi_ops import (
    MPI_LIB,
    Adasum,
    Average,
    Sum,
    _allreduce,
    _grouped_allreduce,
    allgather,
)
from horovod.common.process_sets import global_process_set, registered_id
from horovod.common.util import get_average_backwards_compatibility_fun


class _ReduceOps:
    Average, Sum, Adasum = Average, Sum, Adasum


_op_from = get_average_backwards_compatibility_fun(_ReduceOps)


def _check_op(op, process_set):
    if op == Adasum:
        raise NotImplementedError("Adasum is not supported by ferrovod.")
    if registered_id(process_set) != 0:
        process_set.size()  # as Horovod: ValueError for a set that is no longer registered


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none,
              op=None, prescale_factor=1.0, postscale_factor=1.0, name=None,
              process_set=global_process_set, ignore_name_scope=False):
    """Reduces `tensor` over the process set (Average by default). tf.IndexedSlices are
    gathered (values and indices) instead, for Sum and Average only."""
    op = _op_from(op, average)
    _check_op(op, process_set)
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (Average, Sum):
            raise NotImplementedError("Only Sum and Average are supported with tf.IndexedSlices")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
        with tf.device(device_sparse):
            values = allgather(tensor.values, name=None if name is None else name + "_values",
                               ignore_name_scope=ignore_name_scope, process_set=process_set)
            indices = allgather(tensor.indices, name=None if name is None else name + "_indices",
                                ignore_name_scope=ignore_name_scope, process_set=process_set)
            if op == Average:
                values = tf.math.divide(values, tf.cast(process_set.size(), values.dtype))
            return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    with tf.device(device_dense):
        core = core_codec(compression, tf.as_dtype(tensor.dtype), op)
        if core is not None:
            return _allreduce(tensor, name=name, op=op, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor,
                              ignore_name_scope=ignore_name_scope, process_set=process_set,
                              compression=core)
        compressed, ctx = compression.compress(tensor)
        reduced = _allreduce(compressed, name=name, op=op, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, ignore_name_scope=ignore_name_scope,
                             process_set=process_set)
        return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Allreduce of several tensors, negotiated and completed together."""
    if not tensors:
        return tensors
    op = _op_from(op, average)
    _check_op(op, process_set)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [allreduce(t, op=op, compression=compression, process_set=process_set,
                          device_dense=device_dense, device_sparse=device_sparse,
                          ignore_name_scope=ignore_name_scope) for t in tensors]
    with tf.device(device_dense):
        dtypes = {tf.as_dtype(t.dtype) for t in tensors}
        core = core_codec(compression, dtypes.pop(), op) if len(dtypes) == 1 else None
        if core is not None:
            return _grouped_allreduce(tensors, name=name, op=op, prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor,
                                      ignore_name_scope=ignore_name_scope, process_set=process_set,
                                      compression=core)
        pairs = [compression.compress(t) for t in tensors]
        reduced = _grouped_allreduce([p[0] for p in pairs], name=name, op=op,
                                     prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                     ignore_name_scope=ignore_name_scope, process_set=process_set)
        return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, pairs)]


def multistep_reduce(tensors, every, name, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                     compression=Compression.none, process_set=global_process_set):
    """Horovod's `backward_passes_per_step` in ferrovod's core: each call's `tensors` are added to
    sums the core keeps per name, and every `every`-th call reduces the sums (one op per dtype,
    fused by the core). Returns (outputs, communicated): the reduced sums, or this call's
    tensors where nothing was communicated. `name`: the same on every rank, once per process."""
    _check_op(op, process_set)
    buckets = {}
    for i, t in enumerate(tensors):
        buckets.setdefault(tf.as_dtype(t.dtype), []).append(i)
    out = list(tensors)
    communicated = None
    for dtype, idx in buckets.items():
        if not dtype.is_floating:
            raise ValueError("backward_passes_per_step > 1 needs floating-point gradients, got %s"
                             % dtype.name)
        label = name if len(buckets) == 1 else "%s_%s" % (name, dtype.name)
        core = core_codec(compression, dtype, op)
        if core is None:
            pairs = [compression.compress(tensors[i]) for i in idx]
            inputs, codec = [p[0] for p in pairs], _core.COMPRESSION_JOB
        else:
            pairs, inputs, codec = None, [tensors[i] for i in idx], core
        sums, flag = MPI_LIB.ferrovod_multistep_allreduce(
            inputs, reduce_op=op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, compression=codec, multistep=int(every),
            multistep_mode=_core.MULTISTEP_ACCUMULATE, tensor_name=label,
            process_set_id=registered_id(process_set))
        if pairs is not None:
            sums = [compression.decompress(t, ctx) for t, (_, ctx) in zip(sums, pairs)]
        for i, t in zip(idx, sums):
            out[i] = t
        communicated = flag if communicated is None else communicated
    return out, communicated
