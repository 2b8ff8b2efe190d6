"""`horovod.torch.mpi_ops`, implemented by ferrovod."""

from ferrovod.torch.mpi_ops import *  # noqa: F401,F403
from ferrovod.torch.mpi_ops import _handle_map  # noqa: F401
