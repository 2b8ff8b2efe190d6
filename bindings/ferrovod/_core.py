"""ctypes binding of the ferrovod C API (include/ferrovod.h).

Thin by design: argument marshalling and error mapping only. Negotiation, fusion, validation and
the collectives live in the Rust library; framework layers (TensorFlow, Keras, the `horovod`
package) build on the functions here.
"""

import collections
import ctypes
import itertools
import os
import threading

import numpy as np

from ferrovod.exceptions import (
    FerrovodError,
    HorovodInternalError,
    InvalidArgumentError,
    PreconditionError,
    ShutDownError,
)

# fv_status
OK, UNKNOWN, PRECONDITION, ABORTED, INVALID_ARGUMENT, IN_PROGRESS = 0, 1, 2, 3, 4, 5
NOT_INITIALIZED, SHUT_DOWN, TIMEOUT, INTERNAL = 6, 7, 8, 9

# fv_op_kind
ALLREDUCE, ALLGATHER, BROADCAST, JOIN, ALLTOALL, BARRIER, REDUCESCATTER = 0, 1, 2, 3, 5, 6, 7
GOSSIP = 22
SEND, RECV = 23, 24
# a receive's root_rank: the first message with its tag from any rank
ANY_SOURCE = -1

# fv_reduce_op (Horovod's values)
AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT = 0, 1, 2, 3, 4, 5
# fv_compression: how an allreduce's f32 values travel (JOB: as FERROVOD_COMPRESSION says)
(COMPRESSION_JOB, COMPRESSION_NONE, COMPRESSION_FP16, COMPRESSION_BF16, COMPRESSION_MIXED,
 COMPRESSION_U8, COMPRESSION_POWERSGD, COMPRESSION_TOPK) = range(8)
# fv_multistep_mode: what a multistep allreduce does with the calls between communications
MULTISTEP_ACCUMULATE, MULTISTEP_LATEST = 0, 1

CPU_DEVICE = -1

NOT_INITIALIZED_MESSAGE = "Horovod has not been initialized; use hvd.init()."

_DTYPES = {
    np.dtype(np.uint8): 0,
    np.dtype(np.int8): 1,
    np.dtype(np.uint16): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float16): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.float64): 8,
    np.dtype(np.bool_): 9,
}
BFLOAT16 = 10


def dtype_code(dtype):
    """The fv_dtype of a numpy dtype (bfloat16 from ml_dtypes, as TensorFlow uses, included)."""
    dtype = np.dtype(dtype)
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype.name == "bfloat16":
        return BFLOAT16
    raise InvalidArgumentError("Tensor type %s is not supported." % dtype)


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("input", ctypes.c_void_p),
        ("output", ctypes.c_void_p),
        ("splits", ctypes.POINTER(ctypes.c_int32)),
        ("nsplits", ctypes.c_int32),
    ]


DONE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32)
ALLOC_FN = ctypes.CFUNCTYPE(
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int32,
    ctypes.c_int32,
    ctypes.POINTER(ctypes.c_int64),
    ctypes.c_uint64,
)


class _Op(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("reduce_op", ctypes.c_int32),
        ("prescale", ctypes.c_double),
        ("postscale", ctypes.c_double),
        ("root_rank", ctypes.c_int32),
        ("process_set", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("tensors", ctypes.POINTER(_Tensor)),
        ("num_tensors", ctypes.c_int32),
        ("done", DONE_FN),
        ("done_user_data", ctypes.c_void_p),
        ("alloc", ALLOC_FN),
        ("alloc_user_data", ctypes.c_void_p),
        # GPU ops: the caller's CUstream / recorded CUevent (None for host tensors)
        ("stream", ctypes.c_void_p),
        ("ready_event", ctypes.c_void_p),
        ("compression", ctypes.c_int32),
        ("multistep", ctypes.c_int32),
        ("multistep_mode", ctypes.c_int32),
        ("multistep_warmup", ctypes.c_int32),
        ("tag", ctypes.c_int32),
        # seconds the op may wait for the other ranks (0: the stall limit alone)
        ("timeout", ctypes.c_double),
    ]


class _InitOptions(ctypes.Structure):
    _fields_ = [
        ("ranks", ctypes.POINTER(ctypes.c_int32)),
        ("num_ranks", ctypes.c_int32),
        ("use_fortran_comm", ctypes.c_int32),
        ("fortran_comm", ctypes.c_int32),
        ("process_set_ranks", ctypes.POINTER(ctypes.c_int32)),
        ("process_set_sizes", ctypes.POINTER(ctypes.c_int32)),
        ("num_process_sets", ctypes.c_int32),
    ]


class _Metrics(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "cycles", "control_collectives", "control_bytes", "negotiation_ns", "data_collectives",
        "data_bytes", "fused_batches", "tensors", "graph_launches", "wire_uncompressed", "wire_fp16",
        "wire_bf16", "wire_u8", "wire_powersgd", "wire_topk")]


def library_path():
    """The shared library installed beside this module by `pip install`."""
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.startswith("libferrovod") and name.endswith(".so"):
            return os.path.join(here, name)
    raise ImportError(
        "ferrovod's shared library was not found in %s; reinstall with `pip install .`" % here
    )


def _load():
    # NCCL (2.22+) connects peers lazily, inside the first collective that needs them, and
    # blocks the calling thread until the peer connects too: a failed peer would stop
    # ferrovod's background thread there. Connecting when a communicator is created avoids
    # that. Set here, at import and before any ferrovod thread exists, rather than by the
    # library (changing the environment while other threads may read it is unsound); the
    # launcher exports it too. A value the user chose is kept.
    os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    # RTLD_GLOBAL: the TensorFlow op library resolves the fv_* symbols from this library.
    lib = ctypes.CDLL(library_path(), mode=ctypes.RTLD_GLOBAL)
    i32p = ctypes.POINTER(ctypes.c_int32)
    sigs = {
        "fv_last_error": (ctypes.c_int32, [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
        "fv_init": (ctypes.c_int32, [ctypes.POINTER(_InitOptions)]),
        "fv_shutdown": (ctypes.c_int32, []),
        "fv_is_initialized": (ctypes.c_int32, []),
        "fv_version": (ctypes.c_char_p, []),
        "fv_built_with": (ctypes.c_int32, [ctypes.c_char_p]),
        "fv_enqueue": (ctypes.c_int32, [ctypes.POINTER(_Op), ctypes.POINTER(ctypes.c_uint64)]),
        "fv_poll": (ctypes.c_int32, [ctypes.c_uint64, i32p]),
        "fv_wait": (ctypes.c_int32, [ctypes.c_uint64, ctypes.c_double]),
        "fv_release": (ctypes.c_int32, [ctypes.c_uint64]),
        "fv_handle_error": (ctypes.c_int32, [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
        "fv_handle_output": (ctypes.c_int32, [ctypes.c_uint64, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint64)]),
        "fv_handle_shape": (ctypes.c_int32, [ctypes.c_uint64, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64), ctypes.c_int32, i32p]),
        "fv_handle_received_splits": (ctypes.c_int32, [ctypes.c_uint64, ctypes.c_int32, i32p, ctypes.c_int32, i32p]),
        "fv_handle_value": (ctypes.c_int32, [ctypes.c_uint64, i32p]),
        "fv_handle_event": (ctypes.c_int32, [ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p)]),
        "fv_next_completion": (ctypes.c_int32, [ctypes.c_double, ctypes.POINTER(ctypes.c_void_p),
                                                ctypes.POINTER(ctypes.c_uint64), i32p]),
        "fv_forget_completion": (ctypes.c_int32, [ctypes.c_uint64, i32p]),
        "fv_stream_wait": (ctypes.c_int32, [ctypes.c_uint64, ctypes.c_int32, ctypes.c_void_p,
                                            i32p]),
        "fv_add_process_set": (ctypes.c_int32, [i32p, ctypes.c_int32, i32p]),
        "fv_remove_process_set": (ctypes.c_int32, [ctypes.c_int32]),
        "fv_process_set_ids": (ctypes.c_int32, [i32p, ctypes.c_int32, i32p]),
        "fv_process_set_ranks": (ctypes.c_int32, [ctypes.c_int32, i32p, ctypes.c_int32, i32p]),
        "fv_process_set_size": (ctypes.c_int32, [ctypes.c_int32, i32p]),
        "fv_process_set_rank": (ctypes.c_int32, [ctypes.c_int32, i32p]),
        "fv_read_metrics": (ctypes.c_int32, [ctypes.POINTER(_Metrics)]),
        "fv_struct_size": (ctypes.c_size_t, [ctypes.c_char_p]),
    }
    for name in ("fv_rank", "fv_size", "fv_local_rank", "fv_local_size", "fv_cross_rank",
                 "fv_cross_size", "fv_is_homogeneous", "fv_mpi_threads_supported"):
        sigs[name] = (ctypes.c_int32, [i32p])
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    _check_layouts(lib, (("fv_tensor", _Tensor), ("fv_op", _Op),
                         ("fv_init_options", _InitOptions), ("fv_metrics", _Metrics)))
    return lib


def _check_layouts(lib, structs):
    """A library built from other sources than these bindings would read past our structs."""
    for cname, struct in structs:
        theirs = lib.fv_struct_size(cname.encode())
        if theirs != ctypes.sizeof(struct):
            raise ImportError(
                "ferrovod's library at %s lays out struct %s in %d bytes but these bindings in %d;"
                " reinstall ferrovod so that both come from the same build"
                % (library_path(), cname, theirs, ctypes.sizeof(struct)))


LIB = _load()
# a done callback that runs no Python on ferrovod's thread: it queues the completion for
# `next_completion` (the library's own function, so the GIL is never taken there)
QUEUED = DONE_FN(ctypes.cast(LIB.fv_queue_completion, ctypes.c_void_p).value)


def last_error():
    buf = ctypes.create_string_buffer(4096)
    LIB.fv_last_error(buf, len(buf), None)
    return buf.value.decode("utf-8", "replace")


def error_for(status, message):
    """The exception for a failed status (one mapping, used by every binding)."""
    if status == INVALID_ARGUMENT:
        return InvalidArgumentError(message)
    if status == PRECONDITION:
        return PreconditionError(message)
    if status == NOT_INITIALIZED:
        return ValueError(message or NOT_INITIALIZED_MESSAGE)
    if status == SHUT_DOWN:
        return ShutDownError(message)
    if status == TIMEOUT:
        return TimeoutError(message)
    if status in (UNKNOWN, ABORTED, INTERNAL):
        return HorovodInternalError(message)
    return FerrovodError(message)


def check(status):
    if status != OK:
        raise error_for(status, last_error())


def _i32_array(values):
    return (ctypes.c_int32 * len(values))(*values)


def init(ranks=None, fortran_comm=None, process_sets=None):
    """Starts ferrovod on all ranks, on `ranks` of MPI_COMM_WORLD, or on a communicator given by
    its Fortran handle (mpi4py: `comm.py2f()`). `process_sets`: lists of ranks."""
    opts = _InitOptions()
    keep = []
    if fortran_comm is not None:
        opts.use_fortran_comm = 1
        opts.fortran_comm = int(fortran_comm)
    elif ranks is not None:
        arr = _i32_array([int(r) for r in ranks])
        keep.append(arr)
        opts.ranks = arr
        opts.num_ranks = len(arr)
    if process_sets:
        flat = [int(r) for ps in process_sets for r in ps]
        sizes = [len(ps) for ps in process_sets]
        fa, sa = _i32_array(flat), _i32_array(sizes)
        keep.extend([fa, sa])
        opts.process_set_ranks = fa
        opts.process_set_sizes = sa
        opts.num_process_sets = len(sizes)
    check(LIB.fv_init(ctypes.byref(opts)))


def shutdown():
    status = LIB.fv_shutdown()
    if not LIB.fv_is_initialized():
        # fv_shutdown joined the runtime's threads (called from one of them, it only asks,
        # and the runtime stays): nothing writes the old operations' buffers any more
        _end_generation()
    check(status)


def is_initialized():
    return bool(LIB.fv_is_initialized())


def _query(fn):
    out = ctypes.c_int32()
    status = fn(ctypes.byref(out))
    if status == NOT_INITIALIZED:
        raise ValueError(NOT_INITIALIZED_MESSAGE)
    check(status)
    return out.value


def metrics():
    """Counters since init: cycles, control collectives and bytes, negotiation time, data
    collectives and bytes, fused batches, tensors, GPU batches replayed from CUDA graphs, and
    tensor bytes on the wire by codec (a dict; see fv_read_metrics in ferrovod.h)."""
    out = _Metrics()
    check(LIB.fv_read_metrics(ctypes.byref(out)))
    return {name: int(getattr(out, name)) for name, _ in _Metrics._fields_}


def rank():
    return _query(LIB.fv_rank)


def size():
    return _query(LIB.fv_size)


def local_rank():
    return _query(LIB.fv_local_rank)


def local_size():
    return _query(LIB.fv_local_size)


def cross_rank():
    return _query(LIB.fv_cross_rank)


def cross_size():
    return _query(LIB.fv_cross_size)


def is_homogeneous():
    return bool(_query(LIB.fv_is_homogeneous))


def mpi_threads_supported():
    return bool(_query(LIB.fv_mpi_threads_supported))


def version():
    return LIB.fv_version().decode()


def built_with(what):
    return bool(LIB.fv_built_with(what.encode()))


def nccl_version():
    """NCCL's version code (e.g. 22803) where the core can load CUDA and NCCL, else 0."""
    return int(LIB.fv_built_with(b"nccl"))


def _list(fn, *args):
    buf = (ctypes.c_int32 * 4096)()
    n = ctypes.c_int32()
    check(fn(*args, buf, len(buf), ctypes.byref(n)))
    return list(buf[: n.value])


def process_set_ids():
    return _list(LIB.fv_process_set_ids)


def process_set_ranks(set_id):
    return _list(LIB.fv_process_set_ranks, int(set_id))


def process_set_size(set_id):
    out = ctypes.c_int32()
    check(LIB.fv_process_set_size(int(set_id), ctypes.byref(out)))
    return out.value


def process_set_rank(set_id):
    out = ctypes.c_int32()
    check(LIB.fv_process_set_rank(int(set_id), ctypes.byref(out)))
    return out.value


def add_process_set(ranks):
    arr = _i32_array(sorted(int(r) for r in ranks))
    out = ctypes.c_int32()
    check(LIB.fv_add_process_set(arr, len(arr), ctypes.byref(out)))
    return out.value


def remove_process_set(set_id):
    check(LIB.fv_remove_process_set(int(set_id)))


# Operations in flight: a key of the handle's (unique in the process, never reused) -> the
# runtime generation and ferrovod id of the handle and the buffers (numpy arrays, ctypes
# structs, tensors) ferrovod may still read or write. They stay here until the operation is
# known to be over and its handle released, whatever happens to the Python objects, as
# Horovod's _handle_map does. Handles dropped before release, and operations whose wait failed
# before they were known to be over, are "orphans": released (and their buffers freed) by a
# later enqueue once ferrovod says they completed, or by `shutdown()` once it has joined the
# runtime. Shared by every framework binding.
_in_flight = {}
_orphans = set()
# reentrant: a Handle's __del__ takes it and may run (from the garbage collector) where it is held
_in_flight_lock = threading.RLock()
# the runtimes this process has shut down: an id means something only to the runtime that gave
# it (a runtime started after a shutdown may number its handles from 1 again)
_generation = 0
_keys = itertools.count(1)


def _register(key, generation, hid, keep):
    with _in_flight_lock:
        _in_flight[key] = (generation, hid, keep)


def _forget(key):
    with _in_flight_lock:
        _in_flight.pop(key, None)
        _orphans.discard(key)


def _end_generation():
    """After `fv_shutdown` joined the runtime's threads: its operations are over, their buffers
    go, and handles still held learn that their ids are meaningless now."""
    global _generation
    with _in_flight_lock:
        ended = _generation
        _generation += 1
        for key in [k for k, entry in _in_flight.items() if entry[0] <= ended]:
            del _in_flight[key]
        _orphans.clear()


# operations a stream waits for on the device (`stream_wait`) whose owners have not yet seen
# them complete: `settle()` each, oldest first, before the next submission (`_settle_deferred`)
_deferred = []
_deferred_lock = threading.Lock()


def defer(settle):
    """Leaves `settle()` (which waits for an operation to be launched and takes its outcome,
    raising its error) to the next submission of any framework: a submission whose input
    waits behind a stream that waits for that operation could be fused with it, and the
    fused batch would then wait for itself."""
    with _deferred_lock:
        _deferred.append(settle)


def _settle_deferred():
    if not _deferred:  # the common case, without the lock
        return
    with _deferred_lock:
        pending = list(_deferred)
        del _deferred[:]
    first = None
    for settle in pending:
        try:
            settle()
        except Exception as e:  # every one is settled; the first failure is reported
            if first is None:
                first = e
    if first is not None:
        raise first


def _sweep_orphans():
    if not _orphans:  # the common case, without the lock
        return
    with _in_flight_lock:
        orphans = [(key,) + _in_flight[key][:2] for key in _orphans if key in _in_flight]
    for key, generation, hid in orphans:
        if generation != _generation:
            continue  # its runtime is gone: shutdown() frees it
        done = ctypes.c_int32()
        status = LIB.fv_poll(hid, ctypes.byref(done))
        if status == OK and done.value:
            LIB.fv_release(hid)
            _forget(key)
        elif status != OK:
            # when it ends cannot be learnt any more (the runtime is shutting down): its
            # buffers stay until shutdown() has joined the runtime, or for good
            with _in_flight_lock:
                _orphans.discard(key)


def in_flight_count():
    """Operations whose buffers ferrovod may still use (for tests and leak checks)."""
    with _in_flight_lock:
        return len(_in_flight)


def handle_error(hid):
    """The error message of completed operation `hid` (empty if it succeeded); also usable from
    a completion callback, which has the handle's id only."""
    buf = ctypes.create_string_buffer(4096)
    LIB.fv_handle_error(hid, buf, len(buf), None)
    return buf.value.decode("utf-8", "replace")


def handle_event(hid):
    """The CUevent recorded after GPU operation `hid`'s work (None for host operations)."""
    out = ctypes.c_void_p()
    check(LIB.fv_handle_event(hid, ctypes.byref(out)))
    return out.value


def next_completion(timeout):
    """The oldest completion `QUEUED` queued, as (user data, handle id, status), waiting up to
    `timeout` seconds (without the GIL); None if none came."""
    user, hid, status = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_int32()
    rc = LIB.fv_next_completion(float(timeout), ctypes.byref(user), ctypes.byref(hid),
                                ctypes.byref(status))
    if rc == TIMEOUT:
        return None
    check(rc)
    return user.value or 0, hid.value, status.value


def stream_wait(hid, device, stream):
    """Makes CUDA `stream` (a raw handle on GPU `device`) wait on the device for operation
    `hid` before it is launched (`fv_stream_wait`); False when it did not (enqueued already, or
    a stream that cannot wait so): the caller then waits as before."""
    placed = ctypes.c_int32(0)
    check(LIB.fv_stream_wait(hid, device, stream, ctypes.byref(placed)))
    return bool(placed.value)


def wait_done(hid, timeout=None):
    """Waits (without the GIL, at most `timeout` seconds when given) until operation `hid` has
    completed, however it ended (a handle already released has); False if it had not by then."""
    return LIB.fv_wait(hid, -1.0 if timeout is None else float(timeout)) != TIMEOUT


def forget_completion(hid):
    """Operation `hid`'s queued completion is not wanted: True if `next_completion` will never
    return it; False if the operation had finished and its completion is not queued (taken
    already, or on its way: then it comes out)."""
    dropped = ctypes.c_int32()
    check(LIB.fv_forget_completion(hid, ctypes.byref(dropped)))
    return bool(dropped.value)


class Later:
    """An output ferrovod allocates (allgather, alltoall, reducescatter without an allocator):
    `convert(raw_bytes, dims)` makes the framework's tensor of it once the operation is done."""

    def __init__(self, convert):
        self.convert = convert


class Handle:
    """An enqueued operation. Its numpy inputs and outputs stay alive in the in-flight
    registry until it is released, even if this object is dropped first. `key` names it in the
    registry and to framework bindings (an integer never reused in the process); `id` is
    ferrovod's, meaningful only while the runtime that gave it runs."""

    def __init__(self, hid, keep, outputs, kind, generation):
        self.id = hid
        self.key = next(_keys)
        # read before the enqueue: a shutdown that ends it after has joined this operation too
        self.generation = generation
        _register(self.key, self.generation, hid, keep)
        self._outputs = outputs
        self._kind = kind
        self.communicated = None
        # join: the last rank to join, after `wait`
        self.last_joined = None
        self._released = False
        self._done = False  # seen to be over: its buffers may go

    def __del__(self):
        if not getattr(self, "_released", True):
            with _in_flight_lock:
                if self.key in _in_flight:
                    _orphans.add(self.key)

    def _current(self):
        """Whether the runtime that gave this handle still runs (a shutdown since ends it)."""
        return self.generation == _generation

    def _gone(self):
        return ShutDownError("operation %d was started before ferrovod was shut down; it did not"
                             " complete, or its result was not collected before" % self.key)

    def _over(self):
        """Whether the operation is known to be over: ferrovod says it completed, or its
        runtime's threads were joined by shutdown()."""
        if not self._current():
            return True
        done = ctypes.c_int32()
        return LIB.fv_poll(self.id, ctypes.byref(done)) == OK and bool(done.value)

    def _abandon(self):
        """Lets go of an operation not known to be over (a wait that failed without it
        completing, e.g. one that found the runtime taken down by a shutdown on another thread
        while the runtime's thread still runs it): its buffers stay in the registry, as an
        orphan's, rather than being freed while MPI or NCCL may still write them."""
        self._released = True
        with _in_flight_lock:
            if self.key in _in_flight:
                _orphans.add(self.key)

    def poll(self):
        if not self._current():
            raise self._gone()
        done = ctypes.c_int32()
        check(LIB.fv_poll(self.id, ctypes.byref(done)))
        return bool(done.value)

    def _error(self):
        return handle_error(self.id) if self._current() else ""

    def _failure(self, status):
        """After a wait: None if it succeeded, else the exception to raise. An operation that
        is not known to be over after a failed wait is abandoned (`_abandon`)."""
        if status == OK:
            self._done = True
            return None
        message = last_error()  # before the calls below overwrite it
        self._done = self._over()
        if not self._done:
            self._abandon()
            return error_for(status, message)
        return error_for(status, self._error() or message)

    def event(self):
        """The CUevent recorded after a GPU operation's work (None for host operations)."""
        return handle_event(self.id)

    def _library_bytes(self, index):
        ptr = ctypes.c_void_p()
        nbytes = ctypes.c_uint64()
        check(LIB.fv_handle_output(self.id, index, ctypes.byref(ptr), ctypes.byref(nbytes)))
        shape = (ctypes.c_int64 * 32)()
        ndim = ctypes.c_int32()
        check(LIB.fv_handle_shape(self.id, index, shape, 32, ctypes.byref(ndim)))
        dims = tuple(shape[: ndim.value])
        raw = ctypes.string_at(ptr.value, nbytes.value) if nbytes.value else b""
        return raw, dims

    def _library_output(self, index, dtype):
        raw, dims = self._library_bytes(index)
        return np.frombuffer(raw, dtype=dtype).reshape(dims).copy()

    def received_splits(self, index=0):
        n = ctypes.c_int32()
        check(LIB.fv_handle_received_splits(self.id, index, None, 0, ctypes.byref(n)))
        buf = (ctypes.c_int32 * max(n.value, 1))()
        check(LIB.fv_handle_received_splits(self.id, index, buf, n.value, ctypes.byref(n)))
        return np.array(buf[: n.value], dtype=np.int32)

    def value(self):
        out = ctypes.c_int32()
        check(LIB.fv_handle_value(self.id, ctypes.byref(out)))
        return out.value

    def wait(self, timeout=None, before_release=None):
        """Blocks (without holding the GIL) until completion; returns the outputs.
        `before_release(handle)` runs once the operation succeeded, while the handle (and its
        GPU event) is still valid."""
        if not self._current():
            self.release()
            raise self._gone()
        status = LIB.fv_wait(self.id, -1.0 if timeout is None else float(timeout))
        if status == TIMEOUT:
            raise TimeoutError("operation %d did not complete in %s s" % (self.id, timeout))
        failure = self._failure(status)
        if self._released:  # abandoned
            raise failure
        try:
            if failure is not None:
                raise failure
            if self._kind == ALLREDUCE:
                # False for a multistep call that only summed its input
                self.communicated = self.value() != 0
            if self._kind == JOIN:
                self.last_joined = self.value()
            if self._kind == RECV:
                # the global rank the message came from (a receive from any rank asks)
                self.source = self.value()
            if before_release is not None:
                before_release(self)
            return self._results()
        finally:
            self.release()

    def _results(self):
        results = []
        for i, out in enumerate(self._outputs):
            if isinstance(out, Later):
                results.append(out.convert(*self._library_bytes(i)))
            elif isinstance(out, np.dtype):
                results.append(self._library_output(i, out))
            else:
                results.append(out)
        if self._kind == ALLTOALL:
            return [(r, self.received_splits(i)) for i, r in enumerate(results)]
        return results

    def release(self):
        """Forgets the handle; its buffers go once the operation is known to be over (until
        then it is an orphan)."""
        if self._released:
            return
        if not (self._done or self._over()):
            self._abandon()
            return
        self._released = True
        if self._current():
            LIB.fv_release(self.id)
        _forget(self.key)


def wait_all(handles, device_waits):
    """`wait()` of every handle in turn, as a training step's synchronize needs, for less per
    handle: no `communicated` value is read, and `device_waits[i](event)` (None for host
    operations) runs only when handle i's GPU event differs from the previous handle's (a fused
    batch's tensors share one). Each handle is released only after the next one's event was
    read, so an address compared is never a new event's. Every handle is released; the first
    failure is raised after that. Returns each handle's outputs (None where it failed)."""
    results, error = [], None
    held, last_event = None, None
    try:
        for h, device_wait in zip(handles, device_waits):
            failure = h._failure(LIB.fv_wait(h.id, -1.0)) if h._current() else h._gone()
            event = None
            if failure is not None:
                error = error or failure
                results.append(None)
            else:
                if device_wait is not None:
                    event = handle_event(h.id)
                    if event and event != last_event:
                        device_wait(event)
                results.append(h._results())
            last_event = event  # held by h until the next handle's is read
            if held is not None:
                held.release()
            held = h
    finally:
        for h in handles:
            h.release()
    if error is not None:
        raise error
    return results


_name_lock = threading.Lock()
_name_counter = [0]


def auto_name(prefix):
    """`<prefix>.noname.<n>`: unnamed ops must then be issued in the same order on every rank."""
    with _name_lock:
        _name_counter[0] += 1
        return "%s.noname.%d" % (prefix, _name_counter[0])


def enqueue(kind, arrays, names, reduce_op=SUM, prescale=1.0, postscale=1.0, root_rank=0,
            process_set=0, splits=None, inplace=False, compression=COMPRESSION_JOB,
            multistep=1, multistep_mode=MULTISTEP_ACCUMULATE, multistep_warmup=0, timeout=0.0):
    """Enqueues one operation over numpy `arrays` (one name each) and returns a Handle.

    Allreduce/broadcast write a new array (or the input itself with `inplace=True`);
    allgather/alltoall/reducescatter outputs are allocated by ferrovod and copied out on wait.
    Allreduce: `multistep` k > 1 communicates on every k-th call of each name only (0: as the
    job's FERROVOD_MULTISTEP says; the default, 1, communicates on every call, as Horovod's
    collectives must: they cannot report a call that only summed); the handle's
    `communicated` tells, after `wait`. `timeout`: as `submit`'s.
    """
    arrays = [np.ascontiguousarray(a) for a in arrays]
    specs, keep, outputs = [], list(arrays), []
    later = kind in (ALLGATHER, ALLTOALL, REDUCESCATTER)
    for a, name in zip(arrays, names):
        if later:
            out_ptr = None
            outputs.append(np.dtype(a.dtype))
        elif inplace:
            out_ptr = a.ctypes.data
            outputs.append(a)
        else:
            # a multistep call that does not communicate leaves the output as it is: the input
            out = np.empty_like(a) if kind != ALLREDUCE or multistep == 1 else a.copy()
            keep.append(out)
            out_ptr = out.ctypes.data
            outputs.append(out)
        specs.append(Spec(name, dtype_code(a.dtype), a.shape, a.ctypes.data, out_ptr))
    return submit(kind, specs, keep, outputs, reduce_op=reduce_op, prescale=prescale,
                  postscale=postscale, root_rank=root_rank, process_set=process_set,
                  splits=splits, compression=compression, multistep=multistep,
                  multistep_mode=multistep_mode, multistep_warmup=multistep_warmup,
                  timeout=timeout)


class Spec:
    """One tensor of an operation: name, fv_dtype code, shape, input address and output
    address (None: allocated later, by ferrovod or the op's allocator)."""

    __slots__ = ("name", "dtype", "shape", "input", "output")

    def __init__(self, name, dtype, shape, input, output):
        self.name, self.dtype, self.shape = name, dtype, tuple(int(d) for d in shape)
        self.input, self.output = input, output


def submit(kind, specs, keep, outputs, reduce_op=SUM, prescale=1.0, postscale=1.0, root_rank=0,
           process_set=0, splits=None, compression=COMPRESSION_JOB, multistep=1,
           multistep_mode=MULTISTEP_ACCUMULATE, multistep_warmup=0, device=CPU_DEVICE,
           stream=None, alloc=None, done=None, done_user_data=None, tag=0, timeout=0.0):
    """Enqueues one operation over `specs` and returns a Handle whose `wait` returns `outputs`
    (a `Later` item: converted from ferrovod's buffer). `keep`: objects that own the memory the
    specs point at, held until the handle is released. GPU ops (`device` >= 0) name the
    caller's CUstream, whose work so far produces the inputs, and an ALLOC_FN for the outputs
    ferrovod sizes. `multistep`: as `enqueue`'s (1: every call communicates). `done`: a
    DONE_FN ferrovod calls on its own thread at completion, with `done_user_data`; it must
    outlive every operation that names it (a module-level one), since a completed handle may be
    released while its callback is still returning. `timeout`: seconds the operation may wait
    for the other ranks to submit it before the job shuts down with a timeout error (0: the
    stall limit alone; it can only shorten it)."""
    _sweep_orphans()
    n = len(specs)
    tensors = (_Tensor * max(n, 1))()
    keep = list(keep) + [tensors]
    for i, spec in enumerate(specs):
        shape = (ctypes.c_int64 * max(len(spec.shape), 1))(*spec.shape)
        bname = spec.name.encode()
        keep.extend([shape, bname])
        t = tensors[i]
        t.name = bname
        t.dtype = spec.dtype
        t.ndim = len(spec.shape)
        t.shape = shape
        t.input = spec.input
        t.output = spec.output
        if splits is not None and kind == ALLTOALL:
            s = _i32_array([int(x) for x in np.asarray(splits).reshape(-1)])
            keep.append(s)
            t.splits = s
            t.nsplits = len(s)
    if kind in (JOIN, BARRIER):
        outputs = [None]
    op = _Op()
    op.kind = kind
    op.reduce_op = reduce_op
    op.prescale = prescale
    op.compression = compression
    op.multistep = multistep
    op.multistep_mode = multistep_mode
    op.multistep_warmup = multistep_warmup
    op.postscale = postscale
    op.root_rank = root_rank
    op.tag = tag
    op.timeout = timeout
    op.process_set = process_set
    op.device = device
    op.stream = stream
    if alloc is not None:
        keep.append(alloc)
        op.alloc = alloc
    if done is not None:
        op.done = done
        op.done_user_data = done_user_data
    op.tensors = tensors
    op.num_tensors = n
    _settle_deferred()
    hid = ctypes.c_uint64()
    generation = _generation
    check(LIB.fv_enqueue(ctypes.byref(op), ctypes.byref(hid)))
    return Handle(hid.value, keep, outputs, kind, generation)


class _OneTensor:
    """The C structs of an operation on one tensor whose output is known at the call (an
    allreduce in place, an allgather or reducescatter into a given output), kept per name and
    reused while its kind, dtype, shape, device and the op's arguments stay the same:
    `fv_enqueue` copies what it reads of them, so the next call only sets the addresses and the
    stream (a framework's gradients, and FSDP's layers, come back every step under the same
    names)."""

    __slots__ = ("key", "op", "tensors", "tensor", "shape", "name")

    def __init__(self, key, kind, name, dtype, shape, reduce_op, prescale, postscale, process_set,
                 compression, device, timeout):
        self.key = key
        self.name = name.encode()
        self.shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.tensors = (_Tensor * 1)()
        t = self.tensor = self.tensors[0]  # a view into the array, made once
        t.name, t.dtype, t.ndim, t.shape = self.name, dtype, len(shape), self.shape
        op = self.op = _Op()
        op.kind, op.reduce_op, op.prescale, op.postscale = kind, reduce_op, prescale, postscale
        op.process_set, op.device, op.compression = process_set, device, compression
        op.timeout = timeout
        # every call communicates, whatever the job's FERROVOD_MULTISTEP: the callers are
        # Horovod's ops, which cannot report a call that only summed
        op.multistep = 1
        op.tensors, op.num_tensors = self.tensors, 1


# `submit_one`'s structs by name, least recently used first; beyond the capacity the oldest go
# (a training step brings back one name per gradient it reduces alone; names that never come
# back, such as unnamed operations', are not kept at all)
ONE_TENSOR_CACHE_CAPACITY = 4096
_NO_DONE = DONE_FN()  # a null function pointer
_one_tensor_ops = collections.OrderedDict()
_one_tensor_lock = threading.Lock()


def submit_one(kind, name, dtype, shape, input_address, output_address, keep, result,
               reduce_op=SUM, prescale=1.0, postscale=1.0, process_set=0,
               compression=COMPRESSION_JOB, device=CPU_DEVICE, stream=None, reuse=True, done=None,
               done_user_data=None, timeout=0.0):
    """`submit` of one contiguous tensor at `input_address` (fv_dtype `dtype`, `shape`) whose
    result goes to `output_address` (the input's, in place, for an allreduce; a given output
    for an allgather or reducescatter), the memory kept alive by `keep` until the handle is
    released; its structs are reused from the last call of `name` (`reuse`: kept for the next
    one, up to ONE_TENSOR_CACHE_CAPACITY names; names that never come back, such as unnamed
    operations', should not be). The handle's `wait` returns `[result]`. `done`,
    `done_user_data`, `timeout`: as `submit`'s."""
    key = (kind, dtype, tuple(shape), device, reduce_op, prescale, postscale, process_set,
           compression, timeout)
    with _one_tensor_lock:
        prepared = _one_tensor_ops.get(name)
        if prepared is not None and prepared.key == key:
            _one_tensor_ops.move_to_end(name)
        else:
            prepared = _OneTensor(key, kind, name, dtype, shape, reduce_op, prescale, postscale,
                                  process_set, compression, device, timeout)
            if reuse:
                _one_tensor_ops[name] = prepared
                _one_tensor_ops.move_to_end(name)
                while len(_one_tensor_ops) > ONE_TENSOR_CACHE_CAPACITY:
                    _one_tensor_ops.popitem(last=False)
    t = prepared.tensor
    t.input, t.output = input_address, output_address
    prepared.op.stream = stream
    # structs reused by name: a call without a callback clears the last one's
    prepared.op.done = done if done is not None else _NO_DONE
    prepared.op.done_user_data = done_user_data
    _sweep_orphans()
    _settle_deferred()
    hid = ctypes.c_uint64()
    generation = _generation
    check(LIB.fv_enqueue(ctypes.byref(prepared.op), ctypes.byref(hid)))
    return Handle(hid.value, keep, [result], kind, generation)


def allreduce_in_place(name, dtype, shape, address, owner, reduce_op=SUM, prescale=1.0,
                       postscale=1.0, process_set=0, compression=COMPRESSION_JOB,
                       device=CPU_DEVICE, stream=None, reuse=True, done=None,
                       done_user_data=None, timeout=0.0):
    """`submit_one` of an allreduce in place of `owner`'s memory at `address`."""
    return submit_one(ALLREDUCE, name, dtype, shape, address, address, [owner], owner,
                      reduce_op, prescale, postscale, process_set, compression, device, stream,
                      reuse, done, done_user_data, timeout)
