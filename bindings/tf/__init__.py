"""Horovod's TensorFlow API on ferrovod (`import ferrovod.tensorflow as hvd`; the `horovod`
package maps `horovod.tensorflow` here)."""

from ferrovod.tensorflow.compression import Compression  # noqa: F401
from ferrovod.tensorflow.decentralized import (  # noqa: F401
    GossipAveraging,
    LocalSGD,
    gossip,
    multistep_allreduce,
)
from ferrovod.tensorflow import util  # noqa: F401
from ferrovod.tensorflow.functions import (  # noqa: F401
    allgather_object,
    broadcast_,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from ferrovod.tensorflow.gradient_tape import (  # noqa: F401
    DistributedGradientTape,
    PartialDistributedGradientTape,
)
from ferrovod.tensorflow.legacy_optimizer import (  # noqa: F401
    BroadcastGlobalVariablesHook,
    DistributedOptimizer,
    broadcast_global_variables,
)
from ferrovod.tensorflow.mpi_ops import *  # noqa: F401,F403
from ferrovod.tensorflow.mpi_ops import (  # noqa: F401
    _allreduce,
    _executing_eagerly,
    _grouped_allreduce,
    _normalize_name,
)
from ferrovod.tensorflow.reduction import allreduce, grouped_allreduce  # noqa: F401
from horovod.common.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from horovod.common.util import check_extension, gpu_available, split_list  # noqa: F401


def __getattr__(name):
    # imported on first use: they load Keras, which `import horovod.tensorflow` should not
    if name == "SyncBatchNormalization":
        from ferrovod.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    if name == "elastic":
        import importlib

        return importlib.import_module("ferrovod.tensorflow.elastic")
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
