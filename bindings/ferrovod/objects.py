"""Python objects through the core (pickled with cloudpickle), shared by the framework
bindings: `broadcast_object` and `allgather_object`, both synchronous."""

import cloudpickle
import numpy as np

from ferrovod import _core


def allgather_object(obj, label, process_set_id=0):
    """Every rank's `obj`, in rank order, on every rank of the process set."""
    payload = np.frombuffer(cloudpickle.dumps(obj), np.uint8)
    (sizes,) = _core.enqueue(_core.ALLGATHER, [np.array([len(payload)], np.int64)],
                             ["allgather_object.%s.sz" % label],
                             process_set=process_set_id).wait()
    (data,) = _core.enqueue(_core.ALLGATHER, [payload], ["allgather_object.%s.t" % label],
                            process_set=process_set_id).wait()
    out, at = [], 0
    for size in np.asarray(sizes):
        out.append(cloudpickle.loads(np.asarray(data)[at:at + int(size)].tobytes()))
        at += int(size)
    return out


def broadcast_object(obj, root_rank, label, process_set_id=0):
    """`root_rank`'s `obj` on every rank of the process set."""
    payload = np.frombuffer(cloudpickle.dumps(obj), np.uint8) if _core.rank() == root_rank else None
    size = np.array([0 if payload is None else len(payload)], np.int64)
    (size,) = _core.enqueue(_core.BROADCAST, [size], ["bcast_object.%s.sz" % label],
                            root_rank=root_rank, process_set=process_set_id).wait()
    data = payload if payload is not None else np.zeros(int(size[0]), np.uint8)
    (data,) = _core.enqueue(_core.BROADCAST, [data], ["bcast_object.%s.t" % label],
                            root_rank=root_rank, process_set=process_set_id).wait()
    return cloudpickle.loads(np.asarray(data).tobytes())
