"""`import horovod.tensorflow.keras as hvd` — implemented by ferrovod."""

from ferrovod.tensorflow.keras import *  # noqa: F401,F403
from ferrovod.tensorflow.keras import (  # noqa: F401
    DistributedOptimizer,
    PartialDistributedOptimizer,
    allreduce,
    broadcast_global_variables,
    callbacks,
    load_model,
)

from . import elastic  # noqa: F401,E402
