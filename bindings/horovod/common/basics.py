"""Horovod's process-level API (init, shutdown, rank, size, ...), on ferrovod's core."""

import atexit
import os

from ferrovod import _core
from horovod.common import process_sets as _ps
from horovod.common.util import get_average_backwards_compatibility_fun


class HorovodBasics:
    """What every `horovod.<framework>` module re-exports. The constructor arguments of
    Horovod's version (extension path and name) are accepted and unused: one library serves
    every framework."""

    def __init__(self, pkg_path=None, *args):
        self._pkg_path = pkg_path
        self.Average, self.Sum, self.Adasum = _core.AVERAGE, _core.SUM, _core.ADASUM
        self.Min, self.Max, self.Product = _core.MIN, _core.MAX, _core.PRODUCT

    def init(self, comm=None, process_sets=None):
        """Starts ferrovod. `comm`: None (all ranks), a list of ranks of MPI_COMM_WORLD, an mpi4py
        communicator, or a list of mpi4py communicators (the first is the world, the others
        become process sets). `process_sets`: a list of ProcessSet, or "dynamic"."""
        if process_sets == "dynamic":
            process_sets = None
        sets = list(process_sets or [])
        if isinstance(comm, (list, tuple)) and comm and hasattr(comm[0], "py2f"):
            sets = [_ps.ProcessSet(c) for c in comm[1:]] + sets
            comm = comm[0]
        try:
            if comm is None:
                _core.init(process_sets=[ps.ranks for ps in sets])
            elif hasattr(comm, "py2f"):
                _core.init(fortran_comm=comm.py2f(), process_sets=[ps.ranks for ps in sets])
            else:
                _core.init(ranks=list(comm), process_sets=[ps.ranks for ps in sets])
        except Exception as e:
            raise ValueError(
                "Horovod initialization failed. Please check log messages above for a more "
                "descriptive error. (%s)" % e
            ) from e
        _ps._setup(sets)
        atexit.register(self.shutdown)

    def shutdown(self):
        """Shuts ferrovod down on every rank (pending operations fail)."""
        _core.shutdown()

    def is_initialized(self):
        return _core.is_initialized()

    def start_timeline(self, file_path, mark_cycles=False):
        if os.environ.get("HOROVOD_TIMELINE") != "DYNAMIC":
            raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
        raise NotImplementedError(
            "ferrovod writes the timeline given by HOROVOD_TIMELINE=<file>; starting it at run time is not supported yet"
        )

    def stop_timeline(self):
        pass

    def size(self):
        return _core.size()

    def local_size(self):
        return _core.local_size()

    def cross_size(self):
        return _core.cross_size()

    def rank(self):
        return _core.rank()

    def local_rank(self):
        return _core.local_rank()

    def cross_rank(self):
        return _core.cross_rank()

    def is_homogeneous(self):
        return _core.is_homogeneous()

    def mpi_threads_supported(self):
        return _core.mpi_threads_supported()

    def mpi_enabled(self):
        return True

    def mpi_built(self):
        return True

    def gloo_enabled(self):
        return False

    def gloo_built(self):
        return False

    def nccl_built(self):
        return 0

    def ddl_built(self):
        return False

    def ccl_built(self):
        return False

    def cuda_built(self):
        return False

    def rocm_built(self):
        return False

    def sycl_built(self):
        return False

    def _get_process_set_ids_and_ranks(self):
        """{process set id: its global ranks} for every registered set (Horovod's private
        helper, which its process-set tests call)."""
        return {set_id: _core.process_set_ranks(set_id) for set_id in _core.process_set_ids()}

    def metrics(self):
        """ferrovod's counters since init (a dict): control collectives and bytes, negotiation
        time in ns, data collectives and bytes, fused batches, tensors, cycles."""
        return _core.metrics()


# One instance serves every framework: `from horovod.common.basics import *` gives a framework
# module Horovod's process-level functions and reduction ops.
__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size",
    "local_size", "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "sycl_built", "metrics",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
]
_default = HorovodBasics()
globals().update({name: getattr(_default, name) for name in __all__})
_op_or_average = get_average_backwards_compatibility_fun(_default)


def reduce_op_of(op, average):
    """The reduction a call asks for (`op=`, or Horovod's deprecated `average=`); Adasum, which
    ferrovod does not implement, is refused."""
    op = _op_or_average(op, average)
    if op == _default.Adasum:
        raise NotImplementedError("Adasum is not supported by ferrovod.")
    return op
