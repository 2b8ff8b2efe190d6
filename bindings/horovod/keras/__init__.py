"""`import horovod.keras as hvd` — the same Keras API (Keras 3 or tf_keras), on ferrovod."""

from horovod.tensorflow.keras import *  # noqa: F401,F403
from horovod.tensorflow.keras import (  # noqa: F401
    DistributedOptimizer,
    PartialDistributedOptimizer,
    allreduce,
    broadcast_global_variables,
    callbacks,
    load_model,
)

from . import elastic  # noqa: F401,E402
