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
    compression (`hvd.Compression.fp16`, `bf16`, `mixed`, `u8`, `topk`, `powersgd`: float32
    buckets travel in the core's codec; default: as the job's FERROVOD_COMPRESSION says).
    Under `powersgd` each parameter's gradient is reduced in its own shape (a bucket is flat,
    and PowerSGD compresses matrices), named after the parameter, so that its residual and Q
    stay with it when DDP rebuilds its buckets after the first step."""

    def __init__(self, process_set=global_process_set, compression=None):
        self.process_set = process_set
        self.compression = compression


# parameters reduced one by one (under powersgd) are numbered in the order first seen, which is
# the same on every rank (DDP hands the buckets over in order, and their parameters too); the
# number is kept on the parameter itself
_param_numbers = itertools.count()


def _param_name(param):
    number = getattr(param, "_ferrovod_ddp_number", None)
    if number is None:
        number = param._ferrovod_ddp_number = next(_param_numbers)
    return "ddp.param.%d" % number


def _by_parameter(bucket, buffer):
    """The bucket's gradients as views of its flat buffer, each in its parameter's shape, with
    the parameters' names; None where they do not tile the buffer in order."""
    params = bucket.parameters()
    views, at = [], 0
    for p in params:
        n = p.numel()
        if at + n > buffer.numel():
            return None
        views.append(buffer[at:at + n].view(p.shape))
        at += n
    if at != buffer.numel():
        return None
    return views, [_param_name(p) for p in params]


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
    tensors, names = [buffer], ["ddp.bucket.%d" % bucket.index()]
    if codec is not None and codec & 0xFF == _core.COMPRESSION_POWERSGD:
        tensors, names = _by_parameter(bucket, buffer) or (tensors, names)
    hid = mpi_ops._enqueue(_core.ALLREDUCE, tensors, names, tensors, None, process_set,
                           done=_DONE, done_user_data=key, reduce_op=mpi_ops.Average,
                           compression=_core.COMPRESSION_JOB if codec is None else codec)
    with _lock:
        _to_release.append((hid, fut))
    return fut
