"""`import horovod.torch as hvd` — Horovod's PyTorch API, implemented by ferrovod."""

from ferrovod.torch import *  # noqa: F401,F403
from ferrovod.torch import _handle_map  # noqa: F401
from horovod.torch import elastic  # noqa: F401
