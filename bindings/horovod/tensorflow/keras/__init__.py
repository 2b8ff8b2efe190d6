"""`import horovod.tensorflow.keras as hvd` — implemented by ferrovod."""

from ferrovod.tensorflow.keras import *  # noqa: F401,F403
from ferrovod.tensorflow.keras import (  # noqa: F401
    DistributedOptimizer,
    allreduce,
    broadcast_global_variables,
    callbacks,
    load_model,
)
