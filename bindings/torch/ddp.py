"""A DistributedDataParallel communication hook that reduces DDP's gradient buckets with
ferrovod: `model.register_comm_hook(None, ferrovod.torch.ddp_comm_hook)` (the state may be a
ProcessSet). DDP still needs its process group for construction (parameter broadcast); every
gradient allreduce then goes through ferrovod's engine (fusion, compression, NCCL on GPUs)."""

import ctypes

import torch

from ferrovod import _core
from ferrovod.torch import mpi_ops
from horovod.common.process_sets import ProcessSet, global_process_set


def ddp_comm_hook(state, bucket):
    """Averages `bucket`'s flat gradient buffer over the process set (`state`: a ProcessSet or
    None for all ranks), in place, and returns a Future of it. The allreduce starts at once;
    the Future completes on ferrovod's thread, after DDP's consumers are ordered behind the
    collective on the device, so backward keeps running meanwhile."""
    process_set = state if isinstance(state, ProcessSet) else global_process_set
    buffer = bucket.buffer()
    cuda = buffer.is_cuda
    fut = torch.futures.Future(devices=[buffer.device] if cuda else None)

    def on_done(hid, status):
        if status != _core.OK:
            buf = ctypes.create_string_buffer(4096)
            _core.LIB.fv_handle_error(hid, buf, len(buf), None)
            fut.set_exception(_core.error_for(status, buf.value.decode("utf-8", "replace")))
            return
        if cuda:
            event = ctypes.c_void_p()
            _core.LIB.fv_handle_event(hid, ctypes.byref(event))
            if event.value:
                # the Future records its completion on this thread's current stream
                with torch.cuda.device(buffer.device):
                    mpi_ops._stream_wait(mpi_ops._current_stream(buffer.device), event.value)
        fut.set_result(buffer)

    handle = mpi_ops._enqueue(_core.ALLREDUCE, [buffer], ["ddp.bucket.%d" % bucket.index()],
                              [buffer], None, process_set, on_done=on_done,
                              reduce_op=mpi_ops.Average)
    # the result travels through the Future: the handle is dropped here and released by a
    # later operation once complete (it must not be waited for inside its own callback)
    with mpi_ops._handle_lock:
        mpi_ops._handle_map.pop(handle)
    return fut
