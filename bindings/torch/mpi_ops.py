"""Horovod's PyTorch collectives on ferrovod's C API (through `ferrovod._core`, ctypes).

Every `*_async` call enqueues one ferrovod operation and returns an integer handle, as
Horovod's do; `synchronize(handle)` waits for it without holding the GIL and returns the
output. Host tensors are read and written in place by the core. CUDA tensors go through the
core's GPU path: the current CUDA stream is handed over with the operation (its work so far
produces the inputs; the host does not wait for it), and `synchronize` makes the current stream
wait on the event recorded after the collective, so no host synchronisation happens per tensor
(HOROVOD_ENABLE_ASYNC_COMPLETION is on by default here, see __init__.py)."""

import ctypes
import itertools
import threading

import torch

from ferrovod import _core
from ferrovod.compression import Framework, compression_for, core_codec
from ferrovod.exceptions import HorovodInternalError  # noqa: F401 (Horovod's mpi_ops has it)
from horovod.common.process_sets import global_process_set, registered_id
from horovod.common.basics import reduce_op_of

Average, Sum, Adasum = _core.AVERAGE, _core.SUM, _core.ADASUM
Min, Max, Product = _core.MIN, _core.MAX, _core.PRODUCT


Compression = compression_for(Framework(
    is_floating=lambda t: t.dtype.is_floating_point,
    cast=lambda t, dtype: t.type(dtype),
    dtype=lambda t: t.dtype,
    float16=torch.float16,
))

_CODES = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 3, torch.int32: 4, torch.int64: 5,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bool: 9, torch.bfloat16: 10,
}
if hasattr(torch, "uint16"):
    _CODES[torch.uint16] = 2


def _code(tensor):
    try:
        return _CODES[tensor.dtype]
    except KeyError:
        raise _core.InvalidArgumentError(
            "Tensor type %s is not supported by ferrovod." % tensor.dtype) from None


# names of unnamed operations, numbered in call order (the same on every rank, as Horovod's)
_unnamed = itertools.count(1)


def _name(prefix, name):
    if name is None:
        return "%s.noname.%d" % (prefix, next(_unnamed))
    return "%s.%s" % (prefix, name)


def _grouped(kind, name, tensors):
    """The names of a grouped operation's tensors: `grouped_<kind>.<name>_<i>of<n>`."""
    base, n = _name("grouped_" + kind, name), len(tensors)
    return [base if n == 1 else "%s_%dof%d" % (base, i + 1, n) for i in range(n)]


_reduce_op = reduce_op_of


_libcuda = None


def _stream_wait(stream, event, device=None):
    """Makes `stream` (of CUDA `device`) wait on the device for `event` (the driver's
    cuStreamWaitEvent; the runtime and the driver share the device's primary context). The
    legacy default stream's handle names the default stream of the thread's current device,
    which need not be `device` (nothing obliges a script to call set_device): there `device`
    is made current for the call."""
    if (stream == _CU_STREAM_LEGACY and device is not None and device.index is not None
            and device.index != torch.cuda.current_device()):
        with torch.cuda.device(device):
            return _stream_wait(stream, event, device)
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        lib.cuStreamWaitEvent.restype = ctypes.c_int
        _libcuda = lib
    rc = _libcuda.cuStreamWaitEvent(stream, event, 0)
    if rc == _CUDA_ERROR_INVALID_CONTEXT and device is not None:
        # a thread that never called the runtime (the backend's completion thread) has no
        # context current: one runtime call on the device makes its primary context current
        torch.cuda.current_stream(device).query()
        rc = _libcuda.cuStreamWaitEvent(stream, event, 0)
    if rc != 0:
        raise _core.HorovodInternalError("cuStreamWaitEvent failed with CUDA error %d" % rc)


# the legacy default stream's handle in the driver API (torch's default stream is 0)
_CU_STREAM_LEGACY = 1
_CUDA_ERROR_INVALID_CONTEXT = 201


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device):
    """The current CUDA stream's handle on `device` (PyTorch's private accessor where it has
    one: it skips building a Stream object per tensor)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(device).cuda_stream
    return raw or _CU_STREAM_LEGACY


class _Pending:
    """An operation in flight: ferrovod's handle, the CUDA device (None on the host) and
    `finish(results)`, which makes the Python result."""

    __slots__ = ("handle", "device", "finish")

    def __init__(self, handle, device, finish):
        self.handle, self.device, self.finish = handle, device, finish

    def poll(self):
        return self.handle.poll()

    def wait(self, stream=None):
        """The operation's result; on CUDA `stream` (a raw handle; default the current stream)
        waits for the collective on the device."""
        wait_on_device = None
        if self.device is not None:
            wait_on_device = _waits_for_launch(stream or _current_stream(self.device), self.device)
        return self.finish(self.handle.wait(before_release=wait_on_device))


def _waits_for_launch(stream, device):
    """A core handle's `before_release`: CUDA `stream` (a raw handle on `device`) waits on the
    device for the launched collective."""
    def wait(h):
        event = h.event()
        if event:
            _stream_wait(stream, event, device)

    return wait


_handle_map = {}
_handle_lock = threading.Lock()


def _device_of(tensors):
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        # a RuntimeError, as Horovod's C++ extension raises it
        raise _core.FerrovodError(
            "the tensors of one operation must be on one device, got %s" % sorted(map(str, devices)))
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cuda":
        return device
    if device.type != "cpu":
        raise _core.InvalidArgumentError("ferrovod.torch runs on CPU and CUDA tensors, not %s" % device)
    return None


def _from_bytes(dtype):
    """Converts ferrovod's output buffer (bytes, dims) to a new CPU tensor of `dtype`."""

    def convert(raw, dims):
        if not raw:
            return torch.empty(dims, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(dims)

    return convert


_alloc_streams = {}


def _alloc_stream(device):
    """The stream ferrovod's GPU outputs are allocated on, one per device, on which no work ever
    runs. The caching allocator hands a block to an allocation on its stream at once, as
    ordered after that stream's work: allocated on the caller's stream (or ferrovod's thread's,
    the default stream), an output could get a block whose tensor the caller freed while work
    queued on that stream after the enqueue still uses it, and ferrovod's stream would write it
    meanwhile. On this stream a block comes back only from a freed output of ours, whose users
    were recorded (`record_stream` at synchronize)."""
    stream = _alloc_streams.get(device.index)
    if stream is None:
        stream = _alloc_streams.setdefault(device.index, torch.cuda.Stream(device))
    return stream


def _gpu_alloc(dtype, device, made):
    """An ALLOC_FN that allocates ferrovod's GPU outputs as torch tensors (kept in `made` by
    index) on `_alloc_stream(device)`. It runs on ferrovod's thread; a failure returns NULL,
    which fails the operation."""
    stream = _alloc_stream(device)

    def alloc(_user_data, index, ndim, shape, _nbytes):
        dims = tuple(shape[i] for i in range(ndim))
        numel = 1
        for d in dims:
            numel *= d
        # never a NULL address, also for an empty output
        with torch.cuda.stream(stream):
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        made[index] = buf[:numel].view(dims)
        return buf.data_ptr()

    return _core.ALLOC_FN(alloc)


def _record_consumer(tensors, device):
    """Marks ferrovod-allocated outputs as used by the current stream, which `synchronize` has
    made wait for the collective: the caching allocator then reuses their memory only after the
    work queued there by the time they are freed (and so after ferrovod's writes)."""
    consumer = torch.cuda.current_stream(device)
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(consumer)


def _enqueue(kind, tensors, names, outputs=None, finish=None, process_set=global_process_set,
             done=None, done_user_data=None, **kwargs):
    """Enqueues one ferrovod operation over `tensors` and returns its integer handle.

    `outputs`: the tensors allreduce/broadcast write (None for the kinds whose output ferrovod
    sizes). `finish(results)` turns the outputs into what `synchronize` returns."""
    set_id = registered_id(process_set)
    device = _device_of(tensors)
    keep, specs, results = [], [], []
    copies = []  # (caller's tensor, contiguous output) for non-contiguous in-place outputs
    for i, (t, name) in enumerate(zip(tensors, names)):
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        keep.append(src)
        if outputs is None:
            out_ptr = None
            results.append(_core.Later(_from_bytes(t.dtype)) if device is None else None)
        else:
            out = outputs[i]
            target = out
            if not out.is_contiguous():
                target = src if out is t else out.contiguous()
                copies.append((out, target))
            keep.append(target)
            out_ptr = target.data_ptr()
            results.append(out)
        specs.append(_core.Spec(name, _code(t), t.shape, src.data_ptr(), out_ptr))
    made = {}
    alloc = None
    stream = None
    if device is not None:
        stream = _current_stream(device)
        if outputs is None:
            alloc = _gpu_alloc(tensors[0].dtype, device, made)
    handle = _core.submit(kind, specs, keep, results, process_set=set_id,
                          device=-1 if device is None else device.index, stream=stream,
                          alloc=alloc, done=done, done_user_data=done_user_data, **kwargs)

    def done(values):
        for out, target in copies:
            out.copy_(target)
        if made:
            _record_consumer(made.values(), device)
            # alltoall's results are (output, received splits)
            values = [(made.get(i), v[1]) if isinstance(v, tuple) else made.get(i, v)
                      for i, v in enumerate(values)]
        return finish(values) if finish is not None else values

    return _pending(handle, device, done)


def _pending(handle, device, finish):
    """Registers the core's `handle` as in flight (`_Pending`) and returns the key the caller
    holds: the core's handle key, never reused in the process (ferrovod's ids may start again
    after a shutdown)."""
    with _handle_lock:
        _handle_map[handle.key] = _Pending(handle, device, finish)
    return handle.key


def _allreduce_one_(tensor, name, op, prescale, postscale, process_set, codec, finish=list,
                    reuse=True, done=None, done_user_data=None, timeout=0.0):
    """`allreduce_async_` of one contiguous tensor through the C structs the core keeps per name
    (`_core.allreduce_in_place`; `reuse`: unnamed operations' names never come back); `finish`
    makes the handle's result from `[tensor]`; `done`, `done_user_data`, `timeout`:
    `_core.submit`'s."""
    handle = _submit_allreduce_one(tensor, name, op, prescale, postscale, process_set, codec,
                                   reuse, done, done_user_data, timeout)
    return _pending(handle, tensor.device if tensor.is_cuda else None, finish)


def _submit_allreduce_one(tensor, name, op, prescale, postscale, process_set, codec, reuse=True,
                          done=None, done_user_data=None, timeout=0.0, stream=None):
    """`_allreduce_one_`'s submission: the core's handle, registered nowhere here. `stream`:
    the raw CUDA stream to order it on (default the current one)."""
    device, stream = _device_and_stream(tensor, stream)
    return _core.allreduce_in_place(
        name, _code(tensor), tuple(tensor.shape), tensor.data_ptr(), tensor, op, prescale,
        postscale, registered_id(process_set), codec, device, stream, reuse, done,
        done_user_data, timeout)


def _into_(kind, tensor, output, name, process_set, reduce_op=_core.SUM, prescale=1.0, done=None,
            done_user_data=None, timeout=0.0):
    """An allgather or reducescatter of one contiguous tensor into `output` (contiguous, the
    result's size when every rank's tensor has this shape) through the C structs the core keeps
    per name (`_core.submit_one`); the handle's result is `[output]`."""
    handle = _submit_into(kind, tensor, output, name, process_set, reduce_op, prescale, done,
                          done_user_data, timeout)
    return _pending(handle, tensor.device if tensor.is_cuda else None, list)


def _submit_into(kind, tensor, output, name, process_set, reduce_op=_core.SUM, prescale=1.0,
                 done=None, done_user_data=None, timeout=0.0, stream=None):
    """`_into_`'s submission: the core's handle, registered nowhere here. `stream`: the raw
    CUDA stream to order it on (default the current one)."""
    device, stream = _device_and_stream(tensor, stream)
    return _core.submit_one(
        kind, name, _code(tensor), tuple(tensor.shape), tensor.data_ptr(), output.data_ptr(),
        [tensor, output], output, reduce_op, prescale, 1.0, registered_id(process_set),
        _core.COMPRESSION_JOB, device, stream, True, done, done_user_data, timeout)


def _device_and_stream(tensor, stream=None):
    """The core's device ordinal for `tensor` and the raw stream its operation is ordered on
    (`stream`, else the current one; None on the host)."""
    if not tensor.is_cuda:
        return _core.CPU_DEVICE, None
    return tensor.device.index, stream or _current_stream(tensor.device)


def poll(handle):
    """Whether the operation behind `handle` has completed (`synchronize` then does not block)."""
    with _handle_lock:
        pending = _handle_map.get(handle)
    if pending is None:
        raise ValueError("handle %r is not an operation in flight" % (handle,))
    return pending.poll()


def synchronize(handle, stream=None):
    """Waits for the operation behind `handle` and returns its output. For CUDA tensors the
    current stream (or `stream`, a raw handle) waits for the collective on the device; the host
    does not."""
    with _handle_lock:
        pending = _handle_map.pop(handle, None)
    if pending is None:
        return None
    return pending.wait(stream)


def _synchronize_all(handles):
    """`synchronize` of each handle, for a training step's many gradients at once: the current
    stream is read once per device and waits once per fused batch rather than once per tensor.
    Returns the outputs in order (None for unknown handles); raises the first failure once
    every handle is released."""
    with _handle_lock:
        pendings = [_handle_map.pop(h, None) for h in handles]
    live = [p for p in pendings if p is not None]
    streams = {}

    def waiter(device):
        def wait(event):
            if device not in streams:  # read once, at the first GPU event
                streams[device] = _current_stream(device)
            _stream_wait(streams[device], event, device)

        return wait

    waiters = {p.device: waiter(p.device) for p in live if p.device is not None}
    waits = [waiters.get(p.device) for p in live]  # None for host operations
    outputs = iter(_core.wait_all([p.handle for p in live], waits))
    return [None if p is None else p.finish(next(outputs)) for p in pendings]


def _single(values):
    return values[0]


def _new_like(tensors):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]


def _allreduce_async(tensors, outputs, names, op, prescale_factor, postscale_factor, process_set,
                     finish, codec=_core.COMPRESSION_JOB):
    """An allreduce over `tensors` into `outputs`; `codec`: the fv_compression the core applies."""
    return _enqueue(_core.ALLREDUCE, tensors, names, outputs, finish, process_set, reduce_op=op,
                    prescale=float(prescale_factor), postscale=float(postscale_factor),
                    compression=codec)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce of `tensor` into a new tensor (Average by default); returns a handle
    for `poll` and `synchronize`."""
    op = _reduce_op(op, average)
    return _allreduce_async([tensor], _new_like([tensor]), [_name("allreduce", name)], op, prescale_factor,
                            postscale_factor, process_set, _single)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts an in-place allreduce of `tensor`."""
    op = _reduce_op(op, average)
    if tensor.is_contiguous() and tensor.dtype in _CODES and not tensor.is_sparse:
        return _allreduce_one_(tensor, _name("allreduce", name), op,
                               float(prescale_factor), float(postscale_factor), process_set,
                               _core.COMPRESSION_JOB, _single, reuse=name is not None)
    return _allreduce_async([tensor], [tensor], [_name("allreduce", name)], op, prescale_factor,
                            postscale_factor, process_set, _single)


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce with a gradient: the gradient is allreduced with the same op and factors."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                codec=_core.COMPRESSION_JOB):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        op = _reduce_op(op, average)
        return synchronize(_allreduce_async(
            [tensor], _new_like([tensor]), [_name("allreduce", name)], op, prescale_factor,
            postscale_factor, process_set, _single, codec))

    @staticmethod
    def backward(ctx, grad_output):
        average, op, prescale_factor, postscale_factor, process_set = ctx.args
        return (allreduce(grad_output, average=average, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set),
                None, None, None, None, None, None, None)


def _compressed(tensors, compression, op):
    """`compression` applied: by the core where it can (every tensor float32 and a core codec:
    its fv_compression comes back), else by the compressor in Python. Returns (the tensors to
    send, their decompression contexts or None, the fv_compression for the core)."""
    unchanged = [None] * len(tensors)
    if compression is None or compression is Compression.none:
        return tensors, unchanged, _core.COMPRESSION_JOB
    codec = core_codec(compression, all(t.dtype == torch.float32 for t in tensors), op)
    if codec is not None:
        return tensors, unchanged, codec
    pairs = [compression.compress(t) for t in tensors]
    return [p[0] for p in pairs], [p[1] for p in pairs], _core.COMPRESSION_JOB


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """The reduction (Average by default) of `tensor` over the process set, as a new tensor,
    differentiable. `compression`: float32 sums and averages are compressed by the core; other
    tensors by the compressor's `compress`/`decompress`."""
    op = _reduce_op(op, average)
    (sent,), (cctx,), codec = _compressed([tensor], compression, op)
    out = HorovodAllreduce.apply(sent, None, name, op, prescale_factor, postscale_factor,
                                 process_set, codec)
    return compression.decompress(out, cctx) if cctx is not None else out


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """In-place allreduce of `tensor`; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce of several tensors, negotiated and completed together."""
    op = _reduce_op(op, average)
    tensors = list(tensors)
    return _allreduce_async(tensors, _new_like(tensors), _grouped("allreduce", name, tensors),
                            op, prescale_factor, postscale_factor, process_set, list)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """In-place grouped allreduce."""
    op = _reduce_op(op, average)
    tensors = list(tensors)
    return _allreduce_async(tensors, tensors, _grouped("allreduce", name, tensors), op,
                            prescale_factor, postscale_factor, process_set, list)


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set,
                codec, *tensors):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        op = _reduce_op(op, average)
        return tuple(synchronize(_allreduce_async(
            list(tensors), _new_like(tensors), _grouped("allreduce", name, tensors), op,
            prescale_factor, postscale_factor, process_set, list, codec)))

    @staticmethod
    def backward(ctx, *grad_output):
        average, op, prescale_factor, postscale_factor, process_set = ctx.args
        grads = grouped_allreduce(list(grad_output), average=average, op=op,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, process_set=process_set)
        return (None,) * 7 + tuple(grads)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Allreduce of several tensors into new ones, negotiated and completed together."""
    op = _reduce_op(op, average)
    tensors = list(tensors)
    if not tensors:
        return []
    sent, cctxs, codec = _compressed(tensors, compression, op)
    outs = HorovodGroupedAllreduce.apply(None, name, op, prescale_factor, postscale_factor,
                                         process_set, codec, *sent)
    return [compression.decompress(o, c) if c is not None else o for o, c in zip(outs, cctxs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Allreduce of a sparse COO tensor as Horovod does it: its indices and values are
    allgathered (duplicates are summed when the result is coalesced); Average divides the
    values by the set's size. Returns, as Horovod does, a function that waits and returns the
    sparse result."""
    op = _reduce_op(op, None)
    if op not in (Average, Sum):
        raise NotImplementedError("sparse allreduce supports Average and Sum, not op %d" % op)
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_async(t._indices().t().contiguous(), name="%s.indices" % name,
                              process_set=process_set)
    values = allgather_async(t._values(), name="%s.values" % name, process_set=process_set)
    n = process_set.size()

    def handle():
        i = synchronize(indices).t()
        v = synchronize(values)
        if op == Average:
            v = v / n
        return torch.sparse_coo_tensor(i, v, size=t.size())

    return handle


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts an allgather: every rank's `tensor` concatenated along the first dimension."""
    return _enqueue(_core.ALLGATHER, [tensor], [_name("allgather", name)], None, _single,
                    process_set)


class HorovodAllgather(torch.autograd.Function):
    """Allgather whose gradient is this rank's rows of the averaged output gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        ps = ctx.process_set
        reduced = allreduce(grad_output, average=True, process_set=ps)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64), process_set=ps)
        offset = int(rows[: ps.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's `tensor` concatenated along the first dimension, in rank order (the other
    dimensions must agree); differentiable."""
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    tensors = list(tensors)
    return _enqueue(_core.ALLGATHER, tensors,
                    _grouped("allgather", name, tensors), None, list,
                    process_set)


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grad_output):
        ps = ctx.process_set
        reduced = grouped_allreduce(list(grad_output), average=True, process_set=ps)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64), process_set=ps)
        offsets = rows[: ps.rank()].sum(dim=0)
        return (None, None) + tuple(
            r.narrow(0, int(o), n) for r, o, n in zip(reduced, offsets, ctx.rows))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    tensors = list(tensors)
    if not tensors:
        return []
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts a broadcast of `root_rank`'s `tensor` into a new tensor."""
    return _enqueue(_core.BROADCAST, [tensor], [_name("broadcast", name)], _new_like([tensor]),
                    _single, process_set, root_rank=root_rank)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts an in-place broadcast of `root_rank`'s `tensor`."""
    return _enqueue(_core.BROADCAST, [tensor], [_name("broadcast", name)], [tensor], _single,
                    process_set, root_rank=root_rank)


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast whose gradient is the averaged output gradient on the root, zero elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce(grad_output, average=True, process_set=ctx.process_set)
        if _core.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """`root_rank`'s `tensor` on every rank of the process set, as a new tensor;
    differentiable."""
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast; returns `tensor`."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def _splits_list(splits):
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype == torch.bool:
            raise _core.InvalidArgumentError("alltoall: splits must be integers, not %s" % splits.dtype)
        return [int(x) for x in splits.reshape(-1).tolist()]
    return [int(x) for x in splits]


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts an alltoall: `splits[j]` rows of `tensor` to rank j (None: equal parts).
    `synchronize` returns (output, received_splits)."""
    counts = _splits_list(splits)
    # the received splits live where the splits were given (host memory for a list or None)
    where = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")

    def finish(values):
        output, received = values[0]
        return output, torch.from_numpy(received.astype("int32")).to(where)

    if counts is None:
        n = process_set.size()
        rows = tensor.shape[0] if tensor.dim() else 0
        if rows % n:
            raise _core.InvalidArgumentError(
                "alltoall: %d rows cannot be split equally among %d ranks; pass splits" % (rows, n))
        counts = [rows // n] * n
    return _enqueue(_core.ALLTOALL, [tensor], [_name("alltoall", name)], None, finish,
                    process_set, splits=counts)


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall whose gradient is the alltoall of the output gradient back by the received
    splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.process_set = process_set
        ctx.received = received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = alltoall(grad_output, splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows of `tensor` scattered to the ranks and what every rank sent this one, concatenated
    in rank order; differentiable. Returns the output, and with `splits` also the rows received
    from each rank."""
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reducescatter: the reduction of `tensor`, of which this rank keeps its slice of
    rows (the remainder to the lowest ranks)."""
    op = _reduce_op(op, None)
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    return _enqueue(_core.REDUCESCATTER, [tensor], [_name("reducescatter", name)], None,
                    _single, process_set, reduce_op=op, prescale=float(prescale_factor),
                    postscale=float(postscale_factor))


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter whose gradient is the allgather of the output gradient (scaled as the
    forward scaled)."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        op, process_set, prescale_factor, postscale_factor = ctx.args
        scale = prescale_factor * postscale_factor * (process_set.size() if op == Sum else 1)
        return (allgather(grad_output * scale, process_set=process_set),
                None, None, None, None, None)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """The reduction of `tensor` over the process set, of which each rank keeps its slice of
    rows; differentiable."""
    sent, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(sent, name, op, process_set, prescale_factor,
                                     postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    op = _reduce_op(op, None)
    tensors = list(tensors)
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("reducescatter needs tensors of at least one dimension")
    return _enqueue(_core.REDUCESCATTER, tensors,
                    _grouped("reducescatter", name, tensors), None,
                    list, process_set, reduce_op=op, prescale=float(prescale_factor),
                    postscale=float(postscale_factor))


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return tuple(synchronize(grouped_reducescatter_async(
            tensors, name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_output):
        op, process_set, prescale_factor, postscale_factor = ctx.args
        scale = prescale_factor * postscale_factor * (process_set.size() if op == Sum else 1)
        grads = grouped_allgather([g * scale for g in grad_output], process_set=process_set)
        return (None,) * 5 + tuple(grads)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    tensors = list(tensors)
    if not tensors:
        return []
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                             postscale_factor, *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def join(device=-1):
    """Blocks until every rank has joined; meanwhile this rank contributes zeros to the other
    ranks' allreduces. Returns the last rank to join. (`device` is accepted for Horovod's
    signature: the core makes the zeros where each operation's tensors live.)"""
    h = _core.enqueue(_core.JOIN, [], [])
    h.wait()
    return h.last_joined


def barrier(process_set=global_process_set):
    """Returns once every rank of the process set has called it."""
    _core.enqueue(_core.BARRIER, [], [], process_set=registered_id(process_set)).wait()
