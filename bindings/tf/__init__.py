"""Horovod's TensorFlow API on ferrovod (`import ferrovod.tensorflow as hvd`; the `horovod`
package maps `horovod.tensorflow` here)."""

from ferrovod.tensorflow.mpi_ops import *  # noqa: F401,F403
from ferrovod.tensorflow.mpi_ops import (  # noqa: F401
    _allreduce,
    _executing_eagerly,
    _grouped_allreduce,
    _normalize_name,
)
from horovod.common.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
