"""Rank and size from the launcher's environment (Horovod's `horovod.runner.common.util.env`)."""

import os

# (rank, size) as each launcher names them, in the order they are looked for
_PAIRS = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
          ("PMI_RANK", "PMI_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))


def get_env_rank_and_size():
    """(rank, size) set by mpirun/srun/horovodrun, or None outside a launcher."""
    for rank_var, size_var in _PAIRS:
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return None
