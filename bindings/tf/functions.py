"""Variable and object helpers (Horovod's `horovod/tensorflow/functions.py`)."""

import io

import cloudpickle
import numpy as np
import tensorflow as tf

from ferrovod.tensorflow.mpi_ops import (
    _normalize_name,
    allgather,
    broadcast,
    rank,
)
from horovod.common.process_sets import global_process_set


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assigns `root_rank`'s value to each variable on every rank of the process set. Returns
    the assign ops in graph mode."""
    assigns = []
    for var in variables:
        name = "HorovodBroadcast_%s" % _normalize_name(var.name)
        value = broadcast(var.read_value() if hasattr(var, "read_value") else var, root_rank,
                          name=name, process_set=process_set)
        assigns.append(var.assign(value))
    if not tf.executing_eagerly():
        return tf.group(*assigns)
    return None


def optimizer_variables(optimizer):
    """An optimizer's variables: a property in Keras 3 and tf_keras's new optimizers, a method in
    tf_keras's legacy ones."""
    found = optimizer.variables
    return list(found() if callable(found) else found)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast: assigns `root_rank`'s values to `variables`. Returns the assigned
    variables (eager) or tensors that run the assignment when evaluated (graph mode)."""
    out = []
    for i, var in enumerate(variables):
        label = name + "_%d" % i if name else "HorovodBroadcast_%s" % _normalize_name(var.name)
        value = broadcast(tf.convert_to_tensor(var), root_rank, name=label, process_set=process_set)
        out.append(var.assign(value))
    return out


def _to_bytes_tensor(obj):
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Pickles `obj` on `root_rank` and returns the unpickled copy on every rank."""
    name = name or type(obj).__name__
    if rank() == root_rank:
        payload = _to_bytes_tensor(obj)
        sz = np.array([len(payload)], np.int32)
    else:
        payload = None
        sz = np.array([0], np.int32)
    sz = _run(broadcast(tf.constant(sz), root_rank, name=name + ".sz", process_set=process_set), session)
    if payload is None:
        payload = np.zeros(int(sz[0]), np.uint8)
    data = _run(broadcast(tf.constant(payload), root_rank, name=name + ".t", process_set=process_set), session)
    return cloudpickle.loads(np.asarray(data).tobytes())


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function `f(obj)` returning `root_rank`'s `obj` on every rank. In graph mode the
    broadcast ops are built once, fed through placeholders on each call."""
    name = name or "broadcast_object_fn"
    if tf.executing_eagerly():
        return lambda obj: broadcast_object(obj, root_rank, name=name, process_set=process_set)
    size_in = tf.compat.v1.placeholder(tf.int32, [1], name="bcast_object_size")
    size_out = broadcast(size_in, root_rank, name=name + ".sz", process_set=process_set)
    data_in = tf.compat.v1.placeholder(tf.uint8, [None], name="bcast_object_data")
    data_out = broadcast(data_in, root_rank, name=name + ".t", process_set=process_set)

    def bcast(obj):
        sess = session or tf.compat.v1.get_default_session() or tf.compat.v1.Session()
        payload = _to_bytes_tensor(obj) if rank() == root_rank else None
        n = len(payload) if payload is not None else 0
        n = int(sess.run(size_out, feed_dict={size_in: [n]})[0])
        if payload is None:
            payload = np.zeros(n, np.uint8)
        data = sess.run(data_out, feed_dict={data_in: payload})
        return cloudpickle.loads(np.asarray(data).tobytes())

    return bcast


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's `obj`, in rank order, on every rank."""
    name = name or type(obj).__name__
    payload = _to_bytes_tensor(obj)
    sizes = _run(allgather(tf.constant([len(payload)], tf.int32), name=name + ".sz", process_set=process_set), session)
    data = np.asarray(_run(allgather(tf.constant(payload), name=name + ".t", process_set=process_set), session))
    out, off = [], 0
    for s in np.asarray(sizes):
        out.append(cloudpickle.loads(data[off:off + int(s)].tobytes()))
        off += int(s)
    return out


def _run(t, session):
    if tf.executing_eagerly():
        return t.numpy()
    if session is None:
        session = tf.compat.v1.get_default_session() or tf.compat.v1.Session()
    return session.run(t)
