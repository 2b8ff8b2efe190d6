"""Rank and size from the launcher's environment (Horovod's `horovod.runner.common.util.env`)."""

import os

_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def get_env_rank_and_size():
    """(rank, size) set by mpirun/srun/horovodrun, or None outside a launcher."""
    for rank_var, size_var in zip(_RANK_VARS, _SIZE_VARS):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return None
