"""A DistributedDataParallel communication hook that reduces DDP's gradient buckets with
ferrovod: `model.register_comm_hook(None, ferrovod.torch.ddp_comm_hook)` (the state may be a
ProcessSet, or a DDPHookState naming a compression too). DDP still needs its process group for construction (parameter broadcast); every
gradient allreduce then goes through ferrovod's engine (fusion, compression, NCCL on GPUs)."""

import itertools
import threading

import torch

from ferrovod import _core
from ferrovod.compression import core_codec
from ferrovod.torch import mpi_ops
from horovod.common.process_sets import ProcessSet, global_process_set

# bucket allreduces in flight: key -> (buffer, Future); their handles, released once the
# Future is complete (by a later hook call: never inside the completion callback)
_waiting = {}
_to_release = []
_keys = itertools.count(1)
_lock = threading.Lock()


def _completed(key, hid, status):
    """ferrovod's completion callback (on its own thread): orders the Future's consumers after
    the collective on the device, then completes the Future."""
    with _lock:
        buffer, fut = _waiting.pop(key)
    if status != _core.OK:
        fut.set_exception(_core.error_for(status, _core.handle_error(hid)))
        return
    if buffer.is_cuda:
        event = _core.handle_event(hid)
        if event:
            # the Future records its completion on this thread's current stream
            with torch.cuda.device(buffer.device):
                mpi_ops._stream_wait(mpi_ops._current_stream(buffer.device), event)
    fut.set_result(buffer)


# one callback for every bucket, alive as long as the module (see _core.submit)
_DONE = _core.DONE_FN(lambda user_data, hid, status: _completed(user_data, hid, status))


def _release_finished():
    with _lock:
        done = [(hid, fut) for hid, fut in _to_release if fut.done()]
        _to_release[:] = [(hid, fut) for hid, fut in _to_release if not fut.done()]
    for hid, _ in done:
        with mpi_ops._handle_lock:
            pending = mpi_ops._handle_map.pop(hid, None)
        if pending is not None:
            pending.handle.release()


class DDPHookState:
    """What `ddp_comm_hook` reduces over and how: a process set (default all ranks) and a
    compression (`hvd.Compression.fp16`, `bf16`, `mixed`, `u8`: float32 buckets travel in the
    core's codec; default: as the job's FERROVOD_COMPRESSION says)."""

    def __init__(self, process_set=global_process_set, compression=None):
        self.process_set = process_set
        self.compression = compression


def ddp_comm_hook(state, bucket):
    """Averages `bucket`'s flat gradient buffer over the process set, in place, and returns a
    Future of it. `state`: None (all ranks), a ProcessSet, or a DDPHookState. The allreduce
    starts at once; the Future completes on ferrovod's thread, after DDP's consumers are
    ordered behind the collective on the device, so backward keeps running meanwhile."""
    _release_finished()
    if isinstance(state, ProcessSet):
        state = DDPHookState(state)
    elif state is None:
        state = DDPHookState()
    process_set = state.process_set
    buffer = bucket.buffer()
    fut = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
    key = next(_keys)
    with _lock:
        _waiting[key] = (buffer, fut)
    codec = None
    if state.compression is not None:
        codec = core_codec(state.compression, buffer.dtype == torch.float32, mpi_ops.Average)
        if codec is None:
            raise ValueError("ddp_comm_hook compresses in ferrovod's core only: float32 buckets "
                             "with one of hvd.Compression's codecs")
    hid = mpi_ops._enqueue(_core.ALLREDUCE, [buffer], ["ddp.bucket.%d" % bucket.index()],
                           [buffer], None, process_set, done=_DONE, done_user_data=key,
                           reduce_op=mpi_ops.Average,
                           compression=_core.COMPRESSION_JOB if codec is None else codec)
    with _lock:
        _to_release.append((hid, fut))
    return fut
