"""`torch.distributed` on ferrovod: the `ferrovod` backend of `init_process_group`, so that code
written against PyTorch's distributed API (DDP, FSDP2's `fully_shard`, `all_gather` of metrics)
runs on ferrovod's engine unchanged. `import ferrovod.torch` registers it.

A process group written in Python (PyTorch calls the methods of a `ProcessGroup` subclass from
C++ too, e.g. DDP's reducer): each collective is one ferrovod operation through the same
enqueue as `horovod.torch`'s (`mpi_ops._enqueue`), so it is negotiated, fused and compressed as
those are. Its `Work` is completed from ferrovod's completion queue (the library's own done
callback: no Python runs on ferrovod's thread), in the order operations finish: a thread of this
module collects the result (for CUDA tensors it makes a side stream wait on the collective and
records the completion there), so `get_future()` completes by itself, as DDP needs, and `wait()`
on CUDA makes the current stream wait without waiting for the device. A thread that waits for a
Work completes it itself, and a Future is made only when asked for: FSDP's blocking all-gathers
and reduce-scatters pay for neither a thread switch nor a Future.

Ranks come from MPI (`mpirun`/`horovodrun`). Without MASTER_ADDR the store torch needs is a
TCPStore on rank 0 whose address travels over MPI, so `init_process_group("ferrovod")` needs no
rendezvous settings. Subgroups (`new_group`) are ferrovod process sets: every rank must call
`new_group` (PyTorch's default), since a process set is registered by all ranks."""

import functools
import importlib
import itertools
import os
import re
import socket
import threading
import weakref
from _thread import allocate_lock as _allocate_lock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ferrovod import _core
from ferrovod.compression import core_codec
from ferrovod.exceptions import HorovodInternalError
from ferrovod.torch import mpi_ops
from horovod.common import process_sets as _ps

NAME = "ferrovod"

_LAUNCH = ("The ferrovod backend takes its ranks from MPI: start the job with mpirun (or "
           "horovodrun), e.g. `mpirun -np 4 python train.py`")


class Options:
    """What `init_process_group(backend="ferrovod", pg_options=Options(...))` (or `new_group`'s
    `pg_options`) can set: `compression`, one of `hvd.Compression`'s codecs (fp16, bf16, mixed,
    u8, topk, powersgd) applied by ferrovod's core to float32 sums and averages (None: as the
    job's FERROVOD_COMPRESSION says); PowerSGD takes matrices only, so not DDP's flat buckets
    (`hvd.ddp_comm_hook` hands it each parameter's gradient in its shape)."""

    def __init__(self, compression=None):
        self.compression = compression


def _mpi_world():
    """(rank, size) as the MPI launcher gave them, or None outside an MPI launch."""
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                       ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ and size in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return None


def _start():
    """Starts ferrovod's runtime (as `hvd.init()`) unless it runs."""
    if not _core.is_initialized():
        import ferrovod.torch as hvd

        hvd.init()


# --- rendezvous: the store, bootstrapped over MPI where no address was given -----------------

_env_handler = None


def _check_world(rank, size):
    """A rank or world size given to torch that disagrees with MPI's is an error."""
    world = _mpi_world()
    if world is None:
        return
    if rank not in (None, -1) and int(rank) != world[0]:
        raise ValueError("init_process_group was given rank %s, but MPI started this process as "
                         "rank %d of %d" % (rank, world[0], world[1]))
    if size not in (None, -1) and int(size) != world[1]:
        raise ValueError("init_process_group was given world_size %s, but MPI started %d "
                         "processes" % (size, world[1]))


def _query(url):
    from urllib.parse import parse_qs, urlparse

    q = parse_qs(urlparse(url).query)
    return (int(q["rank"][0]) if "rank" in q else None,
            int(q["world_size"][0]) if "world_size" in q else None)


def _addresses():
    """This host's IPv4 addresses, other hosts' likely routes first (the host name's, then each
    interface's, loopback last)."""
    found = []
    try:
        found.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    try:
        import fcntl
        import struct

        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                         struct.pack("256s", name[:15].encode()))
                except OSError:
                    continue
            found.append(socket.inet_ntoa(packed[20:24]))
    except (ImportError, OSError):
        pass
    unique = list(dict.fromkeys(found))
    return [a for a in unique if not a.startswith("127.")] + [a for a in unique if a.startswith("127.")]


def _reachable(addresses, port):
    """The first of rank 0's addresses this host connects to (on `port`)."""
    for address in addresses:
        try:
            with socket.create_connection((address, port), timeout=3):
                return address
        except OSError:
            continue
    raise RuntimeError("no address of rank 0 (%s) is reachable on port %d for torch.distributed's "
                       "store; set MASTER_ADDR and MASTER_PORT" % (", ".join(addresses), port))


def _env_rendezvous(url, timeout=c10d.default_pg_timeout, **kwargs):
    """torch's env:// rendezvous, which under an MPI launch takes the rank and world size from
    MPI when RANK/WORLD_SIZE are not set, and without MASTER_ADDR starts a TCPStore on rank 0 and
    sends its address to the others over MPI (where torch's own would fail)."""
    world = _mpi_world()
    if world is None:
        yield from _env_handler(url, timeout=timeout, **kwargs)
        return
    rank, size = _query(url)
    _check_world(rank if rank is not None else os.environ.get("RANK"),
                 size if size is not None else os.environ.get("WORLD_SIZE"))
    if "MASTER_ADDR" in os.environ:
        os.environ.setdefault("RANK", str(world[0]))
        os.environ.setdefault("WORLD_SIZE", str(world[1]))
        yield from _env_handler(url, timeout=timeout, **kwargs)
        return
    _start()
    from ferrovod.torch.functions import broadcast_object

    if world[0] == 0:
        store = dist.TCPStore("0.0.0.0", 0, world[1], True, timeout=timeout,
                              wait_for_workers=False)
        broadcast_object((_addresses(), store.port), 0, name="ferrovod.torch.store")
    else:
        addresses, port = broadcast_object(None, 0, name="ferrovod.torch.store")
        host = _reachable(addresses, port)
        store = dist.TCPStore(host, port, world[1], False, timeout=timeout)
    yield store, world[0], world[1]
    raise RuntimeError("Unable to perform re-rendezvous using the ferrovod bootstrap")


# --- process groups ----------------------------------------------------------------------------

# registered by `new_group` on every rank, found by the members' backend: ranks -> ProcessSet;
# the backend owns these (sets the user registered with hvd.add_process_set are used, not
# owned) and removes them when every group is destroyed (`destroy_process_group()`, which all
# ranks call, as a process set's removal needs)
_sets = {}
_sets_lock = threading.Lock()


def _known_set(ranks):
    """The registered process set of these sorted ranks: the backend's own, or one the script
    registered (hvd.add_process_set); None if neither."""
    with _sets_lock:
        found = _sets.get(ranks)
    if found is None:
        found = next((s for s in list(_ps._registered.values())
                      if tuple(s.ranks) == ranks and s.process_set_id is not None), None)
    return found


def _process_set(ranks):
    """The process set of these global ranks (all ranks: the global set), registered on every
    rank the first time (a collective)."""
    ranks = tuple(sorted(int(r) for r in ranks))
    if len(ranks) == _core.size() or not ranks:
        return _ps.global_process_set
    found = _known_set(ranks)
    if found is None:
        found = _ps.add_process_set(list(ranks))
        with _sets_lock:
            _sets[ranks] = found
    return found


def _release_sets():
    with _sets_lock:
        owned = list(_sets.values())
        _sets.clear()
    if _core.is_initialized():
        for s in owned:
            _ps.remove_process_set(s)


_destroy = None


def _destroy_every_group(group=None):
    """torch's `destroy_process_group`; destroying every group also removes the process sets
    the backend registered for them."""
    every = group is None or group is c10d.GroupMember.WORLD
    _destroy(group)
    if every:
        _release_sets()


_new_group = None


def _uses_ferrovod(backend):
    if backend is None:
        default = c10d.GroupMember.WORLD
        return default is not None and default.name() == NAME
    return NAME in str(backend)


def _new_group_every_rank(ranks=None, *args, **kwargs):
    """torch's `new_group`, which for the ferrovod backend first registers the group's process
    set on every rank (a ferrovod process set is added by all ranks; torch calls the backend of
    the group's members only), and the sets of the groups other ranks ask for in the same call."""
    backend = kwargs.get("backend", args[1] if len(args) > 1 else None)
    if dist.is_initialized() and _uses_ferrovod(backend):
        if kwargs.get("use_local_synchronization"):
            raise ValueError("the ferrovod backend registers a group on every rank: call new_group "
                             "on all ranks, without use_local_synchronization")
        _register_every_rank_group(ranks)
    return _new_group(ranks, *args, **kwargs)


def _register_every_rank_group(ranks):
    """Registers the process set of the group each rank asks for in this call of `new_group`,
    on every rank. torch lets the ranks ask for different groups in the same call (what
    `new_subgroups(group=...)` does: each rank splits its own subgroup), so the ranks first
    gather what each asked for (one allgather of a row of `size` flags, and one flag for a list
    that names a rank outside the world), then each distinct group is registered in rank order.
    A bad list on any rank is a ValueError on every rank."""
    import numpy as np

    n = _core.size()
    ranks = list(range(n)) if ranks is None or len(ranks) == 0 else [int(r) for r in ranks]
    row = np.zeros(n + 1, np.uint8)
    bad = [r for r in ranks if not 0 <= r < n]
    if bad:
        row[n] = 1
    else:
        row[ranks] = 1
    (rows,) = _core.enqueue(_core.ALLGATHER, [row], ["ferrovod.torch.new_group"]).wait()
    rows = np.asarray(rows).reshape(-1, n + 1)
    wrong = [r for r in range(len(rows)) if rows[r, n]]
    if bad:
        # torch's own words for it (of its versions before and after 2.12), then ours
        raise ValueError("The new group's rank should be within the world_size set by "
                         "init_process_group: Rank %d is out of range. Valid ranks are 0 to %d "
                         "(world_size=%d); new_group raises on every rank"
                         % (bad[0], n - 1, n))
    if wrong:
        raise ValueError("new_group: rank(s) %s passed a rank that is out of range (valid ranks "
                         "are 0 to %d); the group is made on no rank" % (wrong, n - 1))
    for members in dict.fromkeys(tuple(np.flatnonzero(r[:n]).tolist()) for r in rows):
        _process_set(members)


def _create(backend_opts, pg_options):
    """The backend's constructor (torch's extended API): the group's ranks come with it."""
    world = _mpi_world()
    if world is None and not _core.is_initialized():
        raise RuntimeError(_LAUNCH)
    _start()
    members = list(backend_opts.global_ranks_in_group)
    if not members:
        if backend_opts.group_size != _core.size() or backend_opts.group_rank != _core.rank():
            raise ValueError(
                "torch.distributed asked for rank %d of %d, but ferrovod runs rank %d of %d (%s)"
                % (backend_opts.group_rank, backend_opts.group_size, _core.rank(),
                   _core.size(), _LAUNCH))
        process_set = _ps.global_process_set
    else:
        if members != sorted(members):
            raise ValueError("the ferrovod backend numbers a group's ranks in ascending order; "
                             "create the group with its ranks sorted (sort_ranks=True)")
        ranks = tuple(members)
        process_set = _known_set(ranks)
        if process_set is None and len(ranks) == _core.size():
            process_set = _ps.global_process_set
        if process_set is None:
            raise RuntimeError("the ferrovod process set of ranks %s was not registered: create "
                               "groups with torch.distributed.new_group on every rank"
                               % list(ranks))
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError("the ferrovod backend takes ferrovod.torch.backend.Options, not %s"
                        % type(pg_options).__name__)
    group = ProcessGroupFerrovod(backend_opts.group_rank, backend_opts.group_size, process_set,
                                 pg_options or Options())
    timeout = getattr(backend_opts, "timeout", None)
    if timeout is not None:
        group._timeout = max(timeout.total_seconds(), 0.0)
    return group


# --- completion ----------------------------------------------------------------------------------

# FERROVOD_TORCH_DEVICE_WAIT=1: a CUDA collective's wait leaves the waiting to the device
# (`_Work._wait_on_device`) where CUDA loads kernels eagerly: loading one lazily waits for the
# whole device while it holds the driver's locks, so a stream waiting for a call not launched
# yet would hold up the launch itself (ferrovod's watch then ends the process). `force`: under
# lazy loading too. The core refuses it while the call's launch may still open NCCL
# connections (a group's first calls), which wait for the whole device likewise.
_DEVICE_WAIT = os.environ.get("FERROVOD_TORCH_DEVICE_WAIT", "0")
_lazy_warned = []

_works = {}
# Works a waiting thread took from `_works` to complete itself whose completion still comes out
# of the queue, until it does
_claimed = {}
_works_lock = threading.Lock()
_work_keys = itertools.count(1)
_side_streams = {}
_completer = None
_completer_lock = threading.Lock()


class _Latch:
    """A flag set once, which threads may wait for: `threading.Event`'s use here at a fraction
    of its cost to make (a lock held until the flag is set); every Work has two."""

    __slots__ = ("_lock", "_set")

    def __init__(self):
        self._lock = _allocate_lock()
        self._lock.acquire()
        self._set = False

    def is_set(self):
        return self._set

    def set(self):
        if not self._set:
            self._set = True
            _release(self._lock)

    def wait(self, timeout=None):
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            _release(self._lock)
        return self._set


def _release(lock):
    # a latch set by two threads at once, or set while a waiter holds the lock, releases it
    # twice: the flag is what counts
    try:
        lock.release()
    except RuntimeError:
        pass


# every operation's done callback: the library's completion queue (`_core.QUEUED`), so that
# ferrovod's thread never waits for the GIL; this module is the queue's one consumer
_DONE = _core.QUEUED


def _side_stream(device):
    stream = _side_streams.get(device.index)
    if stream is None:
        stream = _side_streams.setdefault(device.index, torch.cuda.Stream(device))
    return stream


def _complete_forever():
    # until another thread took over (`_hand_over_completion`)
    while threading.current_thread() is _completer:
        _complete_next()


def _complete_next(timeout=1.0):
    """Takes the next completion from the queue (waiting up to `timeout` seconds, without the
    GIL) and completes its Work, unless a thread waiting for it took it to complete it itself
    (`_Work._complete_here`)."""
    got = _core.next_completion(timeout)
    if got is None:
        return
    key = got[0]
    with _works_lock:
        claimed = _claimed.pop(key, None)
        work = _works.pop(key, None) if claimed is None else None
    if work is not None:
        try:
            work._complete()
        except Exception:  # the thread must go on completing every later Work
            work._finished.set()


def _ensure_completer():
    with _completer_lock:
        if _completer is None:
            _start_completer()


def _start_completer():
    """Starts the thread that completes Works from now on (`_completer_lock` held)."""
    global _completer
    _completer = threading.Thread(target=_complete_forever, name="ferrovod-torch-works",
                                  daemon=True)
    _completer.start()


def _hand_over_completion():
    """Called on the completion thread inside a Future's callback that asks for the Future of
    an operation not complete yet: torch's `Future.wait` on it (PyTorch's PowerSGD hook does
    this) would block the only thread that completes it. A new thread completes from now on;
    this one ends once the callback returns."""
    with _completer_lock:
        _start_completer()


class _Work(dist.Work):
    """One operation of the backend: its result (the tensors the op wrote) or its error, and a
    Future made when somebody asks for one (`get_future`; a blocking call never does)."""

    def __init__(self, device, finish):
        super().__init__()
        self._device = device
        self._finish = finish
        self._handle = None
        # the CUDA tensors the operation reads or writes (inputs, temporaries, outputs)
        self._touched = ()
        # `finish` launches no device work (the core wrote the caller's outputs): completing
        # then needs no stream of torch's made current
        self._direct = False
        # submitted without a callback: the thread that waits for it completes it
        self._blocking = False
        # `wait` may leave the waiting to the device (`_wait_on_device`), once
        self._may_defer = False
        # its error was raised to a caller already
        self._reported = False
        self._taken = False
        self._submitted = _Latch()
        # set once the result or error is (a host-side signal: waiting on it orders no stream)
        self._finished = _Latch()
        # CUDA: recorded on the side stream after the result's copies (is_completed, as NCCL's)
        self._event = None
        # a receive from any rank: the group rank its message came from, and the core's handle
        # that reports it
        self._source = -1
        self._core = None
        # the core's handle id: waited for by a later call under the same name (`_Names.next`)
        self._core_id = None
        # the key ferrovod's completion callback names it by
        self._key = None
        self._lock = _allocate_lock()
        self._settled = False
        self._result = None
        self._error = None
        self._future = None
        # run once settled (a group forgets the operation's name)
        self._hooks = []

    @classmethod
    def start(cls, device, finish, touched=(), blocking=False):
        """A Work about to be submitted, with the completion thread running; `touched`: the
        CUDA tensors its side stream's copies or the collective use; `blocking`: the caller
        waits for it at once, so that it completes it (no callback, no completion thread)."""
        if _completer is None:
            _ensure_completer()
        work = cls(device, finish)
        work._blocking = blocking
        if device is not None:
            work._touched = tuple(touched)
        return work

    def _complete(self):
        self._submitted.wait()
        result = error = None
        try:
            if self._device is None:
                result = self._finish(mpi_ops.synchronize(self._handle))
            else:
                side = _side_stream(self._device)
                if self._direct:
                    # the side stream waits for the collective; nothing else runs on it here
                    result = self._finish(mpi_ops.synchronize(self._handle, side.cuda_stream))
                else:
                    with torch.cuda.stream(side):
                        # the side stream now waits for the collective, and the copies of
                        # `finish` run on it
                        result = self._finish(mpi_ops.synchronize(self._handle))
                self._protect(side)
        except Exception as e:  # every failure reaches the caller
            error = _backend_error(e)
        finally:
            self._settle(result, error)

    def _protect(self, side):
        """The allocator must not hand out the touched tensors' memory before the side stream's
        work (the caller's stream only waits when it waits for the Work); the event marks that
        work's end."""
        for t in self._touched:
            t.record_stream(side)
        self._event = torch.cuda.Event()
        self._event.record(side)

    def _settle(self, result, error):
        with self._lock:
            self._settled = True
            self._result, self._error = result, error
            future, hooks, self._hooks = self._future, self._hooks, ()
        # finished before the Future's callbacks run: one of them may wait for this Work
        self._finished.set()
        for hook in hooks:
            hook()
        if future is not None:
            self._set_future(future)

    def _when_settled(self, hook):
        with self._lock:
            if not self._settled:
                self._hooks.append(hook)
                return
        hook()

    def _set_future(self, future):
        if self._error is not None:
            future.set_exception(self._error)
        elif self._device is not None:
            # recorded on the side stream: after the result's copies there
            with torch.cuda.stream(_side_stream(self._device)):
                future.set_result(self._result)
        else:
            future.set_result(self._result)

    def wait(self, timeout=None):
        """As NCCL's: on CUDA the current stream waits for the result; the host waits until it
        is known (at most `timeout`, a timedelta or seconds, when given)."""
        seconds = None
        if timeout is not None and timeout != _NO_TIMEOUT:
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            seconds = seconds if seconds > 0 else None
        if self._wait_on_device():
            return True
        if not self._outcome(seconds):
            raise dist.DistBackendError(
                "ferrovod: the operation did not complete within %.1f s (Work.wait's timeout)"
                % seconds)
        if self._error is not None:
            self._reported = True
            raise self._error
        if self._event is not None:
            mpi_ops._stream_wait(mpi_ops._current_stream(self._device), self._event.cuda_event,
                                 self._device)
        return True

    def _wait_on_device(self):
        """As NCCL's wait: the current stream waits on the device for an operation the ranks
        may not have agreed on yet, and the host goes on (FERROVOD_TORCH_DEVICE_WAIT); its
        outcome is taken before the next submission (`_core.defer`). False where it cannot
        (the operation launched already, a blocking stream): the host waits as before."""
        if not self._may_defer or self._finished.is_set():
            return False
        self._may_defer = False
        self._submitted.wait()
        if self._core_id is None:
            return False
        try:
            placed = _core.stream_wait(self._core_id, self._device.index,
                                       mpi_ops._current_stream(self._device))
        except Exception:  # the host waits instead, and sees the operation's own outcome
            return False
        if placed:
            _core.defer(self._settle_deferred)
        return placed

    def _outcome(self, seconds=None):
        """Waits until the result or error is known, at most `seconds` for the operation when
        given: False if it was not by then."""
        if self._blocking:
            if not self._complete_blocking(seconds):
                return False
        elif seconds is not None and not self._finished.wait(seconds):
            return False
        elif threading.current_thread() is _completer:
            # a Future's callback waits for a collective: only this thread completes it
            while not self._finished.is_set():
                _complete_next(0.01)
        elif self._key is not None and not self._finished.is_set():
            self._complete_here()
        self._finished.wait()
        return True

    def _settle_deferred(self):
        """Waits until the operation was launched (not run) and settles it; raises its error
        unless a caller saw it already."""
        self._outcome()
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error

    def _complete_blocking(self, timeout=None):
        """A blocking Work (no callback), completed by the first thread that asks; at most
        `timeout` seconds for the operation: False if it had not finished by then."""
        self._submitted.wait()
        with self._lock:
            mine, self._taken = not self._taken, True
        if not mine:
            return self._finished.wait(timeout)
        if timeout is not None and not _core.wait_done(self._core_id, timeout):
            with self._lock:
                self._taken = False  # a later call takes it
            return False
        self._complete()
        return True

    def _complete_here(self):
        """Completed by the waiting thread, which waits for the core's handle itself, rather
        than for the completion thread (a thread switch fewer per blocking call, and its queued
        completion is dropped, so that the completion thread does not even wake). Whichever
        thread takes it from `_works` completes it."""
        self._submitted.wait()
        with _works_lock:
            mine = _works.pop(self._key, None) is self
            if mine:
                try:
                    dropped = _core.forget_completion(self._core_id)
                except Exception:
                    dropped = False
                if not dropped:
                    # finished already: its completion still comes out of the queue
                    _claimed[self._key] = self
        if mine:
            self._complete()

    def get_future(self):
        if self._blocking and not self._finished.is_set():
            self._complete_blocking()
        if threading.current_thread() is _completer and not self._finished.is_set():
            _hand_over_completion()
        with self._lock:
            if self._future is not None:
                return self._future
            future = self._future = torch.futures.Future(
                devices=[self._device] if self._device is not None else None)
            settled = self._settled
        if settled:
            self._set_future(future)
        return future

    def _source_rank(self):
        """A receive from any rank: the group rank its message came from (once waited for)."""
        return self._source

    def is_completed(self):
        if (self._blocking and not self._finished.is_set() and self._core_id is not None
                and _core.wait_done(self._core_id, 0.0)):
            self._complete_blocking()
        event = self._event
        return self._finished.is_set() and (event is None or event.query())

    def is_success(self):
        return self._finished.is_set() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        if self._blocking:
            self._complete_blocking()
        self._finished.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def synchronize(self):
        self.wait()


# torch's Work.wait default: no timeout
_NO_TIMEOUT = getattr(dist.Work, "_NO_TIMEOUT", None)


def _timed_out_ranks(message):
    """The global ranks the core's timeout error names as never having submitted the operation
    ("... for rank(s) [1, 2], past its operation's timeout ..."), or None."""
    found = re.search(r"for rank\(s\) \[([0-9, ]*)\], past its operation's timeout", message)
    if found is None:
        return None
    return sorted(int(r) for r in found.group(1).split(",") if r.strip())


def _backend_error(e):
    if isinstance(e, dist.DistBackendError):
        return e
    return dist.DistBackendError("ferrovod: %s" % e)


class _Finished(dist.Work):
    """The Work of a blocking call completed before it returned (`ProcessGroupFerrovod._now`):
    on the host nothing is left to wait for; on CUDA the call's `stream` waits for the
    collective already, and another stream that waits for the Work waits for that one."""

    def __init__(self, result, device=None, stream=None):
        super().__init__()
        self._result = result
        self._device = device
        self._stream = stream

    def _order(self):
        """The current stream, if not the call's, waits for the call's."""
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            if current != self._stream:
                current.wait_stream(self._stream)

    def wait(self, timeout=None):
        self._order()
        return True

    def is_completed(self):
        # the collective is done once the call's stream has passed its wait for it
        return self._stream is None or self._stream.query()

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._result

    def synchronize(self):
        pass

    def get_future(self):
        future = torch.futures.Future(devices=[self._device] if self._device is not None else None)
        if self._stream is None:
            future.set_result(self._result)
        else:
            with torch.cuda.stream(self._stream):  # its consumers wait for the call's stream
                future.set_result(self._result)
        return future


def _done_work(result):
    work = _Work(None, None)
    work._settle(result, None)
    return work


# --- the collectives -----------------------------------------------------------------------------

_OPS = {
    dist.ReduceOp.SUM: mpi_ops.Sum, dist.ReduceOp.AVG: mpi_ops.Average,
    dist.ReduceOp.MIN: mpi_ops.Min, dist.ReduceOp.MAX: mpi_ops.Max,
    dist.ReduceOp.PRODUCT: mpi_ops.Product,
}
# a ferrovod reduction must be one of these; beyond them it refuses at the call
_ONLY_SUMS = (mpi_ops.Sum, mpi_ops.Average)


def _reduction(op):
    """(ferrovod's op, prescale) of a torch ReduceOp."""
    if op == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:  # PyTorch before the attribute: (op, factor) in its pickled state
            try:
                factor = op.__getstate__()[1]
            except Exception:
                factor = None
        if factor is None:
            raise ValueError("ferrovod: this PyTorch does not expose PREMUL_SUM's factor")
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        return mpi_ops.Sum, float(factor)
    for torch_op, ours in _OPS.items():
        if op == torch_op:
            return ours, 1.0
    raise ValueError("the ferrovod backend does not support %s (it reduces with SUM, AVG, MIN, "
                     "MAX, PRODUCT and PREMUL_SUM)" % _op_name(op))


def _op_name(op):
    for name in ("BAND", "BOR", "BXOR"):
        if op == getattr(dist.ReduceOp, name):
            return "ReduceOp." + name
    return str(op)


def _strided(tensors):
    """Refuses, at the call, a layout the collectives cannot take."""
    for t in tensors:
        if t.layout != torch.strided:
            raise ValueError("the ferrovod backend's collectives take dense (strided) tensors, "
                             "not %s (all_reduce sums sparse COO tensors)" % t.layout)


def _flat(t):
    _strided((t,))
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def _contiguous(inputs, outputs, finish):
    """Contiguous stand-ins for non-contiguous inputs and outputs (an output that is an input
    shares its stand-in), and a `finish` that first copies the results back: made here rather
    than inside the enqueue, so that the Work knows every temporary its streams use."""
    if all(t.is_contiguous() for t in inputs) and all(t.is_contiguous() for t in outputs or ()):
        return inputs, outputs, finish
    stand = [t if t.is_contiguous() else t.contiguous() for t in inputs]
    if outputs is None:
        return stand, None, finish
    outs = []
    for o in outputs:
        same = next((s for t, s in zip(inputs, stand) if t is o), None)
        outs.append(same if same is not None else (o if o.is_contiguous() else o.contiguous()))
    back = [(o, s) for o, s in zip(outputs, outs) if s is not o]

    def copied_back(values):
        for o, s in back:
            o.copy_(s)
        return finish(values)

    return stand, outs, copied_back


def _writable_directly(output, flat, slot=None):
    """Whether the collective over `flat` can write `output` itself (its result has `output`'s
    elements: the name holds the shapes, so ranks that disagree never meet). `slot`: an
    allgather's group rank, whose piece of the output the input may be on GPUs (FSDP's layout,
    NCCL's in place); any other overlap is refused."""
    if not (output.is_contiguous() and output.dtype == flat.dtype and output.device == flat.device
            and output.numel() > 0):
        return False
    size = output.element_size()
    o, i = output.data_ptr(), flat.data_ptr()
    if slot is not None and flat.is_cuda and i == o + slot * flat.numel() * size:
        return True
    return o + output.numel() * size <= i or i + flat.numel() * size <= o


def _copy_chunks(flat, outputs):
    """Copies consecutive pieces of `flat` into `outputs` (each of its own numel)."""
    at = 0
    for out in outputs:
        n = out.numel()
        out.copy_(flat[at:at + n].view(out.shape))
        at += n


class _Names:
    """A group's operation names: the group and the call's signature, so that a name comes back
    every training step (the core's response cache and learned groups apply to it) and is the
    same on every member (it depends on the calls alone). The core refuses a name still in
    flight, so a call whose name is waits for the core to complete the earlier operation (which
    needs only that every member submitted it: earlier in each member's order of calls), on the
    core's handle, so that no thread of this module must act first (a Future's callback on the
    completion thread may call). Holds the operations in flight by name, each removed when it
    completes. `submitting` is held from `next` to `track`, so that two threads never submit
    one name at once."""

    def __init__(self, group_name):
        self._group_name = group_name
        self._in_flight = {}
        self._lock = threading.Lock()
        self.submitting = threading.RLock()

    def next(self, signature):
        name = "torch.%s.%s" % (self._group_name(), signature)
        with self._lock:
            previous = self._in_flight.get(name)
        if previous is not None:
            # on the core's handle: no thread of this module has to take its completion first
            if isinstance(previous, int):  # a blocking call's, completed by its caller
                _core.wait_done(previous)
            elif not previous._finished.is_set():
                _core.wait_done(previous._core_id)
        return name

    def track(self, name, work):
        """`work` holds `name` until it settles; `work` may also be the core's handle id of a
        blocking call, which `_forget`s it once waited for."""
        with self._lock:
            self._in_flight[name] = work
        if not isinstance(work, int):
            work._when_settled(lambda: self._forget(name, work))

    def _forget(self, name, work):
        with self._lock:
            if self._in_flight.get(name) is work:
                del self._in_flight[name]


def _signature(kind, tensors):
    """The kind, dtypes and shapes of a call; its reduction and root are not part of it, so
    that ranks disagreeing about them meet under one name and get the core's mismatch error
    (ranks disagreeing about shapes wait for each other until the stall limit ends the job)."""
    return ".".join([kind] + [_tensor_signature(t.dtype, tuple(t.shape)) for t in tensors])


@functools.lru_cache(maxsize=4096)
def _tensor_signature(dtype, shape):
    """A tensor's part of a signature (a step's calls bring back the same few)."""
    return "%s_%s" % (str(dtype).replace("torch.", ""), "x".join(str(d) for d in shape) or "scalar")


class ProcessGroupFerrovod(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on ferrovod (one process set)."""

    def __init__(self, rank, size, process_set, options):
        super().__init__(rank, size)
        self._set = process_set
        self._options = options
        # the group's timeout (seconds; 0: none): how long a collective waits for the group's
        # other ranks to submit it before the job shuts down with a timeout error on every rank.
        # It can only shorten ferrovod's stall limit (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)
        self._timeout = 0.0
        # torch names a group alike on all of its members
        self._names = _Names(lambda: self._group_name or "world")
        self._group_name = ""
        self._group_desc = ""

    def getBackendName(self):
        return NAME

    # torch asks a group for its backend of a device (whether it splits NCCL communicators, when
    # the default group is bound to a device): a Python group is its own, and splits nothing
    supports_splitting = False

    def _get_backend(self, device=None):
        return self

    @property
    def _device_types(self):
        # the devices torch's Python asks a group about before it uses one (loading a state dict
        # broadcast from rank 0, async checkpoints, monitored_barrier, object collectives): a
        # Python group registers no C++ backend, so torch's own property would list none
        if torch.cuda.is_available():
            return [torch.device("cpu"), torch.device("cuda")]
        return [torch.device("cpu")]

    # the group's name and description live here: a Python group has no C++ backend to keep them
    def getGroupName(self):
        return self._group_name

    def setGroupName(self, name):
        self._group_name = name

    def getGroupDesc(self):
        return self._group_desc

    def setGroupDesc(self, desc):
        self._group_desc = desc

    @property
    def process_set(self):
        return self._set

    def _device_waits(self):
        """Whether a CUDA call's wait may be left to the device (FERROVOD_TORCH_DEVICE_WAIT=1);
        the core still refuses it call by call where the launch may open NCCL connections."""
        if _DEVICE_WAIT not in ("1", "force"):
            return False
        if _DEVICE_WAIT != "force" and os.environ.get("CUDA_MODULE_LOADING") != "EAGER":
            if not _lazy_warned:
                _lazy_warned.append(True)
                if self.rank() == 0:
                    print("ferrovod: FERROVOD_TORCH_DEVICE_WAIT needs CUDA_MODULE_LOADING=EAGER "
                          "(lazy kernel loading waits for the whole device); waiting on the "
                          "host", flush=True)
            return False
        return True

    def _run(self, kind, inputs, signature, outputs=None, finish=None, touched=(), opts=None,
             **kwargs):
        """Enqueues one ferrovod operation over `inputs` and returns its Work; `finish(values)`
        makes the Future's value from the operation's outputs (run on the completion thread, on
        a side stream for CUDA tensors); `touched`: the caller's tensors it writes there;
        `opts`: the call's options, which say whether the caller waits at once (`_blocking`)."""
        used = tuple(inputs) + tuple(outputs or ()) + tuple(touched)
        _strided(used)
        device = mpi_ops._device_of(inputs)
        stand_in, outputs, finish = _contiguous(inputs, outputs, finish or (lambda values: values))
        if stand_in is not inputs:  # and the contiguous temporaries
            used += tuple(stand_in) + tuple(outputs or ())
        inputs = stand_in
        work = _Work.start(device, finish, used, _blocking(opts))
        kwargs.setdefault("timeout", self._timeout)
        return self._submit_named(work, signature, len(inputs), lambda names, key: mpi_ops._enqueue(
            kind, inputs, names, outputs, None, self._set, done=_done(key), done_user_data=key,
            **kwargs))

    def _into(self, kind, flat, output, signature, result, opts, **kwargs):
        """An allgather or reducescatter of contiguous `flat` written straight into `output`
        (`_writable_directly`), through the core's per-name structs; `result`: the Work's."""
        device = flat.device if flat.is_cuda else None
        blocking = _blocking(opts)
        defer = device is not None and self._device_waits()
        if blocking and not defer:
            return self._now(signature, device, (flat, output), result, lambda name, stream: (
                mpi_ops._submit_into(kind, flat, output, name, self._set, timeout=self._timeout,
                                     stream=stream, **kwargs)))
        work = _Work.start(device, lambda _v: result, (flat, output), blocking)
        work._direct = device is not None
        work._may_defer = defer
        return self._submit_named(work, signature, 1, lambda names, key: mpi_ops._into_(
            kind, flat, output, names[0], self._set, done=_done(key), done_user_data=key,
            timeout=self._timeout, **kwargs))

    def _now(self, signature, device, touched, result, submit):
        """A blocking call (c10d waits for it at once), completed before it returns: submitted
        without a callback, `submit(name, stream)` (the current CUDA stream's handle, or None
        on the host) returning the core's handle, and waited for here, so that no Work is made,
        registered and completed for it: each blocking collective's host time is on a training
        step's path (FSDP waits for every layer's all-gather). On CUDA the host waits until the
        collective is launched and the current stream waits for it on the device, as after
        NCCL's wait; the allocator keeps `touched` until the stream has passed that wait.
        Returns a finished Work whose result is `result`. (A call whose wait may be left to the
        device, FERROVOD_TORCH_DEVICE_WAIT, goes through a Work: `_Work._wait_on_device`.)"""
        stream = None if device is None else torch.cuda.current_stream(device)
        raw = None if stream is None else stream.cuda_stream or mpi_ops._CU_STREAM_LEGACY
        names = self._names
        with names.submitting:
            name = names.next(signature)
            try:
                handle = submit(name, raw)
            except HorovodInternalError as e:
                raise _backend_error(e) from e
            names.track(name, handle.id)
        try:
            if stream is None:
                handle.wait()
            else:
                handle.wait(before_release=mpi_ops._waits_for_launch(raw, device))
                for t in touched:
                    t.record_stream(stream)
        except Exception as e:  # as a Work's wait raises it
            raise _backend_error(e) from e
        finally:
            names._forget(name, handle.id)
        return _Finished(result, device, stream)

    def _submit_named(self, work, signature, count, submit):
        """Submits `work`'s operation of `count` tensors, `submit(names, key)`, under the
        group's next name for `signature` (the further tensors numbered after it; a barrier has
        none), and tracks the name until the operation completes."""
        with self._names.submitting:
            names = [self._names.next(signature)] if count else []
            names += ["%s_%d" % (names[0], i) for i in range(1, count)]
            _submit_work(work, lambda key: submit(names, key))
            if names:
                self._names.track(names[0], work)
        return work

    def _codec(self, op, tensors):
        c = self._options.compression
        if c is None:
            return _core.COMPRESSION_JOB
        f32 = all(t.dtype == torch.float32 for t in tensors)
        return core_codec(c, f32, op) or _core.COMPRESSION_NONE

    # allreduce and reduce

    def allreduce(self, tensors, opts=None):
        op, prescale = _reduction(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._allreduce(tensors, op, prescale, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def _allreduce(self, tensors, op, prescale, opts=None):
        if not tensors:
            return _done_work([])
        if any(t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, op, prescale)
        one = tensors[0]  # any other layout is refused by `_run`
        if (len(tensors) == 1 and one.layout == torch.strided and one.is_contiguous()
                and one.device.type in ("cpu", "cuda")):
            return self._allreduce_one(one, op, prescale, opts)
        return self._run(_core.ALLREDUCE, tensors, _signature("allreduce", tensors),
                         outputs=list(tensors), finish=lambda _v: list(tensors), opts=opts,
                         reduce_op=op, prescale=prescale, postscale=1.0,
                         compression=self._codec(op, tensors))

    def _allreduce_one(self, t, op, prescale, opts=None):
        """`_allreduce` of one contiguous tensor, through the C structs the core keeps per name
        (what `horovod.torch` does for a gradient): a DDP bucket or a metric each step."""
        device = t.device if t.is_cuda else None
        blocking = _blocking(opts)
        defer = device is not None and self._device_waits()
        codec = self._codec(op, (t,))
        if blocking and not defer:
            return self._now(_signature("allreduce", (t,)), device, (t,), [t], lambda name, s: (
                mpi_ops._submit_allreduce_one(t, name, op, prescale, 1.0, self._set, codec,
                                              timeout=self._timeout, stream=s)))
        work = _Work.start(device, lambda _v: [t], (t,), blocking)
        # in place: the core writes `t` itself, so completing launches no device work
        work._direct = device is not None
        work._may_defer = defer
        return self._submit_named(work, _signature("allreduce", (t,)), 1, lambda names, key: (
            mpi_ops._allreduce_one_(t, names[0], op, prescale, 1.0, self._set, codec,
                                    done=_done(key), done_user_data=key,
                                    timeout=self._timeout)))

    def _sparse_allreduce(self, tensors, op, prescale):
        """A sparse COO sum, as gloo's: every rank's indices and values are gathered (ranks hold
        different numbers of them) and summed here, so each rank ends with the coalesced sum in
        its tensor. It completes within the call (the returned Work is done)."""
        if op is not mpi_ops.Sum or prescale != 1.0:
            raise ValueError("the ferrovod backend reduces sparse tensors with SUM only (as gloo)")
        if len(tensors) != 1 or tensors[0].layout != torch.sparse_coo:
            raise ValueError("the ferrovod backend reduces one sparse tensor per call")
        t = tensors[0]
        own = t.coalesce()
        indices = own._indices().t().contiguous()  # a row of sparse coordinates per value
        values = own._values().contiguous()
        # the name holds what every rank knows: the shape, the dtype, the sparse dimensions
        like = torch.empty(t.shape, dtype=t.dtype, device="meta")
        signature = _signature("sparse%d_allreduce" % t.sparse_dim(), [like])
        works = [self._run(_core.ALLGATHER, [part.reshape(-1)], "%s.%s" % (signature, what),
                           finish=lambda gathered: gathered)
                 for what, part in (("indices", indices), ("values", values))]
        gathered = [w.result()[0] for w in works]
        summed = torch.sparse_coo_tensor(gathered[0].view(-1, t.sparse_dim()).t(),
                                         gathered[1].view((-1,) + tuple(values.shape[1:])),
                                         t.shape).coalesce()
        t.copy_(summed)
        return _done_work([t])

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        op, prescale = _reduction(opts.reduceOp)
        root = opts.rootRank
        _strided(tensors)
        scratch = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]

        def finish(values):
            if self.rank() == root:
                for t, s in zip(tensors, values):
                    t.copy_(s)
            return list(tensors)

        return self._run(_core.ALLREDUCE, scratch, _signature("reduce", scratch),
                         outputs=scratch, finish=finish, touched=tensors, reduce_op=op,
                         prescale=prescale,
                         postscale=1.0, compression=_core.COMPRESSION_NONE)

    # broadcast

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        root = self._global(opts.rootRank)
        return self._run(_core.BROADCAST, tensors, _signature("broadcast", tensors),
                         outputs=list(tensors), finish=lambda _v: list(tensors), opts=opts,
                         root_rank=root)

    def _global(self, group_rank):
        if not 0 <= group_rank < self.size():
            raise ValueError("root rank %d is not a rank of this group of %d"
                             % (group_rank, self.size()))
        return self._set.ranks[group_rank]

    # allgather

    def allgather(self, output_tensors, input_tensors, opts=None):
        if len(input_tensors) != 1:
            raise ValueError("the ferrovod backend gathers one tensor per call")
        outputs = output_tensors[0]
        if len(outputs) != self.size():
            raise ValueError("all_gather needs %d output tensors, got %d"
                             % (self.size(), len(outputs)))
        flat = _flat(input_tensors[0])

        def finish(values):
            _copy_chunks(values[0], outputs)
            return [list(outputs)]

        # ranks may gather different sizes: the name holds what all of them know
        total = torch.empty(sum(o.numel() for o in outputs), dtype=flat.dtype, device="meta")
        return self._run(_core.ALLGATHER, [flat], _signature("allgather", [total]),
                         finish=finish, touched=outputs)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """Each input gathered, completed together: `output_lists[r][i]` receives rank r's
        i-th input (torch's layout: one list per rank)."""
        if len(output_lists) != self.size() or any(len(o) != len(input_list)
                                                    for o in output_lists):
            raise ValueError("allgather_coalesced needs one output list per rank (%d), each with "
                             "one tensor per input (%d)" % (self.size(), len(input_list)))
        works = [self.allgather([[outs[i] for outs in output_lists]], [t], opts)
                 for i, t in enumerate(input_list)]
        if not works:
            return _done_work([])
        return _joined(works, output_lists)

    def _allgather_base(self, output, input, opts=None):
        if output.numel() != input.numel() * self.size():
            raise ValueError("all_gather_into_tensor: the output holds %d elements, not %d x %d"
                             % (output.numel(), self.size(), input.numel()))
        flat = _flat(input)
        if _writable_directly(output, flat, slot=self.rank()):
            return self._into(_core.ALLGATHER, flat, output, _signature("allgather", [flat]),
                              [output], opts)

        def finish(values):
            output.view(-1).copy_(values[0]) if output.is_contiguous() else output.copy_(
                values[0].view(output.shape))
            return [output]

        return self._run(_core.ALLGATHER, [flat], _signature("allgather", [flat]),
                         finish=finish, touched=[output], opts=opts)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = _Piece(opts) if opts is not None else None
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _joined(works, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    # reducescatter

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        if len(output_tensors) != 1:
            raise ValueError("the ferrovod backend reduce-scatters one tensor per call")
        inputs = input_tensors[0]
        if len(inputs) != self.size() or any(t.numel() != output_tensors[0].numel() for t in inputs):
            raise ValueError("reduce_scatter needs %d inputs the size of the output"
                             % self.size())
        flat = torch.cat([_flat(t) for t in inputs])
        return self._reduce_scatter_flat(output_tensors[0], flat, opts, [output_tensors[0]])

    def _reduce_scatter_base(self, output, input, opts=None):
        if input.numel() != output.numel() * self.size():
            raise ValueError("reduce_scatter_tensor: the input holds %d elements, not %d x %d"
                             % (input.numel(), self.size(), output.numel()))
        return self._reduce_scatter_flat(output, _flat(input), opts, output)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = _Piece(opts) if opts is not None else None
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _joined(works, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _reduce_scatter_flat(self, output, flat, opts, result):
        op, prescale = _reduction(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if op not in _ONLY_SUMS:
            raise ValueError("the ferrovod backend reduce-scatters with SUM, AVG and PREMUL_SUM")

        def finish(values):
            output.copy_(values[0].view(output.shape))
            return result

        if _writable_directly(output, flat):
            return self._into(_core.REDUCESCATTER, flat, output,
                              _signature("reducescatter", [flat]), result, opts, reduce_op=op,
                              prescale=prescale)
        return self._run(_core.REDUCESCATTER, [flat], _signature("reducescatter", [flat]),
                         finish=finish, touched=[output], opts=opts, reduce_op=op,
                         prescale=prescale, postscale=1.0)

    # alltoall, gather, scatter

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self.size()
        rows = input.shape[0] if input.dim() else 0
        splits = list(input_split_sizes) or ([rows // n] * n if rows % n == 0 else None)
        if splits is None:
            raise ValueError("all_to_all_single: %d rows cannot be split equally among %d ranks"
                             % (rows, n))
        src = input if input.is_contiguous() else input.contiguous()

        def finish(values):
            received, _splits = values[0]
            output.copy_(received.view(output.shape))
            return [output]

        # the rows sent differ by rank: the name holds a row's shape
        row = src[:0] if src.dim() else src.reshape(0)
        return self._run(_core.ALLTOALL, [src], _signature("alltoall", [row]), finish=finish,
                         touched=[output], splits=splits)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        flat = torch.cat([_flat(t) for t in input_tensors])
        splits = [t.numel() for t in input_tensors]

        def finish(values):
            received, _splits = values[0]
            _copy_chunks(received, output_tensors)
            return list(output_tensors)

        return self._run(_core.ALLTOALL, [flat], _signature("alltoall", [flat[:0]]),
                         finish=finish, touched=output_tensors, splits=splits)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        root = opts.rootRank
        flat = _flat(input_tensors[0])
        splits = [0] * self.size()
        splits[root] = flat.numel()

        def finish(values):
            received, _splits = values[0]
            if self.rank() == root:
                _copy_chunks(received, output_tensors[0])
            return output_tensors

        return self._run(_core.ALLTOALL, [flat], _signature("gather", [flat]),
                         finish=finish, touched=output_tensors[0] if output_tensors else (),
                         splits=splits)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        root = opts.rootRank
        out = output_tensors[0]
        if self.rank() == root:
            pieces = input_tensors[0]
            flat = torch.cat([_flat(t) for t in pieces])
            splits = [t.numel() for t in pieces]
        else:
            flat = torch.empty(0, dtype=out.dtype, device=out.device)
            splits = [0] * self.size()

        def finish(values):
            received, _splits = values[0]
            out.copy_(received.view(out.shape))
            return [out]

        return self._run(_core.ALLTOALL, [flat],
                         _signature("scatter", [out]), finish=finish, touched=[out],
                         splits=splits)

    # barrier and point-to-point

    def barrier(self, opts=None):
        return self._run(_core.BARRIER, [], None, finish=lambda _v: [])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """torch's monitored barrier: a barrier bounded by `timeout` (the group's when None).
        Past it the job shuts down, and every rank's DistBackendError says it in gloo's words
        (on group rank 0 which ranks failed to pass it: the first, or with `wait_all_ranks` all
        of them), then in the core's, which name every missing rank on every rank. gloo's
        raises on the ranks that came and leaves the job running."""
        # a timeout of 0 has passed at once (the core's 0 would mean none)
        seconds = self._timeout if timeout is None else max(timeout.total_seconds(), 1e-6)
        try:
            self._run(_core.BARRIER, [], None, finish=lambda _v: [], timeout=seconds).wait()
        except dist.DistBackendError as e:
            missing = _timed_out_ranks(str(e))
            group = [self._set.ranks.index(r) for r in missing or () if r in self._set.ranks]
            if not group:
                raise
            if timeout is not None and timeout.total_seconds() <= 0:
                # no time to hear from any rank: gloo says this rank timed out itself
                what = "Rank %d timed out in monitoredBarrier after 0 ms" % self.rank()
            elif self.rank() != 0:
                # in gloo only rank 0 hears from the others; the core's words below name them
                what = ("Rank %d successfully reached monitoredBarrier, but received errors "
                        "while waiting for send/recv from rank 0" % self.rank())
            else:
                who = ("Ranks %s" % ", ".join(map(str, group))
                       if wait_all_ranks and len(group) > 1 else "Rank %d" % group[0])
                what = "%s failed to pass monitoredBarrier in %d ms" % (who, round(seconds * 1000))
            raise dist.DistBackendError(
                "ferrovod: [Rank %d]: %s (%s)" % (self.rank(), what, e)) from e

    def send(self, tensors, dst, tag=0):
        return self._p2p(_core.SEND, tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._p2p(_core.RECV, tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        return self._p2p(_core.RECV, tensors, None, tag)

    def _p2p(self, kind, tensors, peer, tag):
        """A send or receive of one tensor with group rank `peer` through the core's
        point-to-point transfers (host memory): a CUDA tensor is staged through the host (its
        producer's stream is synchronised first; a receive copies into it on the side stream,
        which the caller's stream waits for in `wait`). The Work completes once the receiver
        has the message, as NCCL's send does. `peer` None: a receive from any rank (the Work's
        `_source_rank()` then names it)."""
        if len(tensors) != 1:
            raise ValueError("the ferrovod backend sends or receives one tensor per call, got %d"
                             % len(tensors))
        if peer is not None and not 0 <= peer < self.size():
            raise ValueError("rank %d is not a rank of this group of %d" % (peer, self.size()))
        t = tensors[0]
        device = t.device if t.is_cuda else None
        if device is not None or not t.is_contiguous():
            host = t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        else:
            host = t.detach()

        def finish(_values):
            if kind == _core.RECV and host is not t:
                t.copy_(host)
            return [t]

        def finish_and_name_the_source(values):
            source = getattr(work._core, "source", -1)
            if source in self._set.ranks:
                work._source = self._set.ranks.index(source)
            return finish(values)

        work = _Work.start(device, finish if peer is not None else finish_and_name_the_source,
                           (t,))
        name = "torch.%s.%s.%s.%d.%d" % (self._names._group_name(),
                                         "send" if kind == _core.SEND else "recv",
                                         "any" if peer is None else peer, tag, next(_p2p_seq))
        root = _core.ANY_SOURCE if peer is None else self._set.ranks[peer]
        _enqueue_work(work, kind, [host], [name], [host], self._set, keep_handle=peer is None,
                      root_rank=root, tag=tag)
        return work


def _enqueue_work(work, kind, inputs, names, outputs, process_set, keep_handle=False,
                  **kwargs):
    """Enqueues one ferrovod operation for `work` (see `_submit_work`)."""
    _submit_work(work, lambda key: mpi_ops._enqueue(kind, inputs, names, outputs, None,
                                                    process_set, done=_DONE,
                                                    done_user_data=key, **kwargs),
                 keep_handle)


class _Piece:
    """The options of one piece of a coalesced call: the call's, but never blocking (the
    joined Work waits for its pieces through their Futures)."""

    asyncOp = True

    def __init__(self, opts):
        self._opts = opts

    def __getattr__(self, name):
        return getattr(self._opts, name)


def _blocking(opts):
    """Whether the caller waits for the operation at once (torch's options say so since 2.7;
    without them, as for DDP's reducer, it may not)."""
    return opts is not None and getattr(opts, "asyncOp", True) is False


def _done(key):
    """The done callback of an operation submitted under `key` (None: a blocking one)."""
    return None if key is None else _DONE


def _submit_work(work, submit, keep_handle=False):
    """Enqueues `work`'s operation, `submit(key)` (which passes ferrovod the completion
    callback with `key`), registered for that callback (and forgotten again if the enqueue
    fails); `work` counts as submitted either way. `keep_handle`: `work._core` holds the core's
    handle, for what its completion reports (a receive's source), before the completion thread
    may look. A blocking Work is submitted with `key` None: no callback, nothing registered."""
    key = work._key = None if work._blocking else next(_work_keys)
    if key is not None:
        with _works_lock:
            _works[key] = work
    try:
        work._handle = submit(key)
        with mpi_ops._handle_lock:
            core = mpi_ops._handle_map[work._handle].handle
        work._core_id = core.id
        if keep_handle:
            work._core = core
    except Exception as e:
        with _works_lock:
            _works.pop(key, None)
        if isinstance(e, HorovodInternalError):
            # the job has shut down (a stall, a timeout, a rank that left): torch's type for it
            raise _backend_error(e) from e
        raise
    finally:
        work._submitted.set()


# point-to-point names: unique in the process (only the two ranks' order pairs transfers)
_p2p_seq = itertools.count()


def _joined(works, result):
    """One Work that completes when all of `works` have."""
    if len(works) == 1:
        return works[0]
    device = works[0]._device
    joined = _Work(device, None)

    def all_done(_collected):
        result_, error = None, None
        try:
            if device is not None:
                with torch.cuda.device(device), torch.cuda.stream(_side_stream(device)):
                    for f in futures:  # the side stream waits for each
                        f.wait()
                    joined._event = torch.cuda.Event()
                    joined._event.record()
            else:
                for f in futures:
                    f.value()
            result_ = list(result)
        except Exception as e:
            error = _backend_error(e)
        finally:
            joined._settle(result_, error)

    futures = [w.get_future() for w in works]
    torch.futures.collect_all(futures).add_done_callback(all_done)
    return joined


# --- registration and the takeover --------------------------------------------------------------

_registered = False
_takeover_said = False
_init_process_group = None
_init_any = None


def _init_without_device_id(backend=None, *args, **kwargs):
    """torch's `init_process_group`; for the ferrovod backend `device_id` only makes the device
    current (NCCL's eager connection and communicator splitting have no ferrovod counterpart:
    ferrovod connects its NCCL communicators itself)."""
    if backend is not None and NAME in str(backend) and kwargs.get("device_id") is not None:
        device = kwargs.pop("device_id")
        if isinstance(device, torch.device) and device.type == "cuda":
            torch.cuda.set_device(device)
    return _init_any(backend, *args, **kwargs)


def register():
    """Registers the `ferrovod` backend with torch.distributed (CPU and CUDA), the MPI
    bootstrap of env:// and the every-rank `new_group` (idempotent)."""
    global _registered, _env_handler, _new_group, _destroy, _init_any
    if _registered:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    # torch's flight recorder hooks a group that lists devices unless its backend records
    # itself; a Python group has no C++ backend for the hook to name, so it is left unhooked,
    # as torch leaves gloo's
    recording = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(recording, set):
        recording.add(NAME)
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    _env_handler = rdzv._rendezvous_handlers["env"]
    rdzv._rendezvous_handlers["env"] = _env_rendezvous
    _new_group = c10d.new_group
    _install("new_group", _new_group_every_rank)
    _init_any = c10d.init_process_group
    _install("init_process_group", _init_without_device_id)
    _destroy = c10d.destroy_process_group
    _install("destroy_process_group", _destroy_every_group)
    _keep_join_works()
    _registered = True


# the Work of each joinable's last "not joined yet" notice (`_keep_join_works`), by joinable:
# one per live DDP module, replaced at its next forward, gone with the module
_join_works = weakref.WeakKeyDictionary()


def _keep_join_works():
    """DDP under `join()` hands the Work of its forward pass's "not joined yet" all-reduce to
    its reducer, which asks it for its Future in the backward pass, through C++ alone. torch
    finds a Python Work's methods through its Python object, which by then nobody holds (it
    completed, and the forward pass returned): the reducer got "Work::getFuture not
    implemented". The Work of a ferrovod group is kept as long as its joinable, until the next."""
    try:
        join = importlib.import_module("torch.distributed.algorithms.join")
    except ImportError:
        return
    notify = join.Join.notify_join_context
    if getattr(notify, "_ferrovod", False):
        return

    def notify_join_context(joinable):
        work = notify(joinable)
        if isinstance(work, _Work):
            try:
                _join_works[joinable] = work
            except TypeError:  # a joinable that takes no weak reference
                pass
        return work

    notify_join_context._ferrovod = True
    join.Join.notify_join_context = staticmethod(notify_join_context)


def _install(name, function):
    """Replaces torch.distributed's `name` where PyTorch's modules call it: c10d, the package,
    and DeviceMesh (which imported it by name, and makes its groups with it)."""
    setattr(c10d, name, function)
    setattr(dist, name, function)
    try:
        mesh = importlib.import_module("torch.distributed.device_mesh")
    except ImportError:
        return
    if hasattr(mesh, name):
        setattr(mesh, name, function)


def _as_ferrovod(backend):
    if backend is None:
        return NAME
    text = str(backend).lower()
    if text in ("nccl", "gloo", "mpi") or all(
            part.split(":")[-1] in ("nccl", "gloo", "mpi") for part in text.split(",")):
        return NAME
    return backend


def takeover():
    """Makes unchanged code that asks torch.distributed for the `nccl`, `gloo` or `mpi` backend
    (or none) get ferrovod's: `init_process_group` and `new_group` then use it. Rank 0 says so
    once. Call it after `import torch` (FERROVOD_TORCH_TAKEOVER=1 does it at import of
    ferrovod.torch)."""
    global _init_process_group
    register()
    if _init_process_group is not None:
        return
    _init_process_group = c10d.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        global _takeover_said
        chosen = _as_ferrovod(backend)
        if chosen == NAME and not _takeover_said:
            _takeover_said = True
            world = _mpi_world()
            if world is None or world[0] == 0:
                print("ferrovod: torch.distributed's %r backend runs on ferrovod "
                      "(FERROVOD_TORCH_TAKEOVER)" % (backend or "default"), flush=True)
        if chosen == NAME and not isinstance(kwargs.get("pg_options"), (Options, type(None))):
            kwargs.pop("pg_options")  # another backend's options
        return _init_process_group(chosen, *args, **kwargs)

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        if not isinstance(kwargs.get("pg_options"), (Options, type(None))):
            kwargs.pop("pg_options")  # another backend's options
        return _new_group_every_rank(ranks, timeout, _as_ferrovod(backend) if backend else None,
                                     *args, **kwargs)

    _install("init_process_group", init_process_group)
    _install("new_group", new_group)
