"""ferrovod.torch across `hvd.shutdown(); hvd.init()` under mpirun: a shutdown while another
thread waits on an operation in flight, handles from before the shutdown, the in-flight
registry afterwards.

ferrovod finalizes MPI at shutdown when it initialized MPI itself, and MPI cannot start twice in
a process: this module initializes MPI at import (before any test calls hvd.init) and finalizes
it at exit, as an mpi4py program would. Its tests run after the other modules of this folder."""

import atexit
import ctypes
import gc
import threading
import time
import weakref

import pytest
import torch

import horovod.torch as hvd
from ferrovod import _core
from ferrovod.exceptions import ShutDownError

_MPI_THREAD_MULTIPLE = 3  # Open MPI's value, what ferrovod asks for itself


def _own_mpi():
    """Initializes MPI here unless it runs already; whether it did."""
    if _core.is_initialized():
        return False
    # the MPI library ferrovod's library was linked with (loaded with it already)
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libmpi.so" in line}
    if len(paths) != 1:
        return False
    mpi = ctypes.CDLL(paths.pop(), mode=ctypes.RTLD_GLOBAL)
    flag = ctypes.c_int()
    mpi.MPI_Initialized(ctypes.byref(flag))
    if flag.value:
        return False
    provided = ctypes.c_int()
    if mpi.MPI_Init_thread(None, None, _MPI_THREAD_MULTIPLE, ctypes.byref(provided)) != 0:
        return False

    def finalize():
        if _core.is_initialized():
            _core.shutdown()
        mpi.MPI_Finalize()

    atexit.register(finalize)
    return True


OWN_MPI = _own_mpi()
pytestmark = pytest.mark.skipif(
    not OWN_MPI, reason="MPI was started before this module (ferrovod could not start again)")


def test_shutdown_while_waiting_then_reinit():
    """Rank 0 waits on another thread for an allreduce no other rank submits while every rank
    shuts down: the wait ends with an error, no crash; afterwards the registry is empty (the
    buffers of every operation of the old runtime, collected or not, are freed once its thread
    was joined, not before). After init, a handle from before the shutdown raises the shut-down
    error and never reaches the new runtime's operation of the same ferrovod id, and integer
    handles are not reused."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    # completed, never synchronized: stale after the shutdown
    stale = hvd.allreduce_async(torch.ones(4), op=hvd.Sum, name="reinit.stale")
    stale_core = hvd._handle_map[stale].handle
    while not hvd.poll(stale):
        time.sleep(0.001)
    errors, alive = [], None
    if r == 0:
        big = torch.ones(1 << 20)
        pending = hvd.allreduce_async_(big, op=hvd.Sum, name="reinit.never")
        alive = weakref.ref(big)
        del big

        def waiter():
            try:
                hvd.synchronize(pending)
            except Exception as e:  # noqa: BLE001 (the test checks its type)
                errors.append(type(e))  # not e: its traceback holds the tensor

        thread = threading.Thread(target=waiter)
        thread.start()
    hvd.barrier()  # no rank shuts down before rank 0's allreduce is in flight
    if r == 0:
        time.sleep(0.5)  # the waiter is inside fv_wait by now
    hvd.shutdown()
    if r == 0:
        thread.join(60)
        assert not thread.is_alive(), "a wait did not end at shutdown"
        # the wait either saw the operation fail at shutdown or found the runtime gone
        assert len(errors) == 1 and issubclass(errors[0], (ShutDownError, ValueError)), errors
        gc.collect()
        assert alive() is None, "the old runtime's buffers outlived its shutdown"
    assert _core.in_flight_count() == 0

    hvd.init()
    before = {stale}
    x = torch.full((3,), float(r + 1))
    live = hvd.allreduce_async(x, op=hvd.Sum, name="reinit.live")
    assert live not in before
    # a runtime may number its handles from 1 again: give the stale handle the live one's id
    stale_core.id = hvd._handle_map[live].handle.id
    with pytest.raises(ShutDownError):
        hvd.synchronize(stale)
    assert torch.equal(hvd.synchronize(live), torch.full((3,), n * (n + 1) / 2.0))
    assert hvd.synchronize(stale) is None  # forgotten, as any synchronized handle
    # the new runtime works as before
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="reinit.after"),
                       torch.full((2,), float(n)))
    assert _core.in_flight_count() == 0
