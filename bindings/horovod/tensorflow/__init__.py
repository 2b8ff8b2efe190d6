"""`import horovod.tensorflow as hvd` — Horovod's TensorFlow API, implemented by ferrovod."""

from ferrovod.tensorflow import *  # noqa: F401,F403
from ferrovod.tensorflow import (  # noqa: F401
    BroadcastGlobalVariablesHook,
    Compression,
    DistributedGradientTape,
    DistributedOptimizer,
    PartialDistributedGradientTape,
    allgather_object,
    allreduce,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    grouped_allreduce,
    util,
)
from ferrovod.tensorflow import (  # noqa: F401
    _allreduce,
    _executing_eagerly,
    _grouped_allreduce,
    _normalize_name,
)


def __getattr__(name):
    if name == "elastic":
        import importlib

        return importlib.import_module("horovod.tensorflow.elastic")
    import ferrovod.tensorflow

    return getattr(ferrovod.tensorflow, name)
