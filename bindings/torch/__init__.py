"""Horovod's PyTorch API on ferrovod (`import ferrovod.torch as hvd`; the `horovod` package
maps `horovod.torch` here). Collectives go through ferrovod's C API with ctypes: host tensors
in place, CUDA tensors through the core's GPU path (NCCL) ordered on the current CUDA stream.
See mpi_ops.py for handles and streams, optimizer.py for DistributedOptimizer, ddp.py for the
DistributedDataParallel hook."""

import os

# GPU operations complete once their work is enqueued and `synchronize` makes the current
# stream wait on the device (no host synchronisation per tensor). Set before the core starts;
# a value the user chose is kept.
os.environ.setdefault("HOROVOD_ENABLE_ASYNC_COMPLETION", "1")

from ferrovod import _core  # noqa: E402
from ferrovod.torch.mpi_ops import *  # noqa: E402,F401,F403
from ferrovod.torch.mpi_ops import (  # noqa: E402,F401
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    Product,
    Sum,
    _handle_map,
)
from ferrovod.torch.ddp import DDPHookState, ddp_comm_hook  # noqa: E402,F401
from ferrovod.torch.functions import (  # noqa: E402,F401
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ferrovod.torch.optimizer import DistributedOptimizer  # noqa: E402,F401
from ferrovod.torch.sync_batch_norm import SyncBatchNorm  # noqa: E402,F401
from horovod.common.process_sets import (  # noqa: E402,F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from horovod.common.util import check_extension, gpu_available, split_list  # noqa: E402,F401

from horovod.common.basics import *  # noqa: E402,F401,F403 (init, rank, size, ..., Sum, Average, ...)

from ferrovod.torch import backend as _backend  # noqa: E402

# torch.distributed's `ferrovod` backend; with FERROVOD_TORCH_TAKEOVER=1 also the one that code
# asking for nccl or gloo gets
_backend.register()
if os.environ.get("FERROVOD_TORCH_TAKEOVER", "0").strip().lower() not in ("", "0", "false", "no", "off"):
    _backend.takeover()


def takeover():
    """Makes torch.distributed's `nccl`, `gloo` and `mpi` backends (and the default) ferrovod's
    (see ferrovod.torch.backend.takeover)."""
    _backend.takeover()


def nccl_built():
    """NCCL's version code where CUDA tensors go through NCCL here (Horovod's value for a build
    with NCCL), else 0."""
    return _core.nccl_version()


def cuda_built():
    """Whether CUDA tensors can go through ferrovod's GPU path here."""
    return _core.built_with("cuda")


def __getattr__(name):
    if name == "elastic":
        import importlib

        return importlib.import_module("ferrovod.torch.elastic")
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
