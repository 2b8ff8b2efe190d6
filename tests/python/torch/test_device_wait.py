"""torch.distributed on the `ferrovod` backend with FERROVOD_TORCH_DEVICE_WAIT=1: a CUDA call's
wait is left to the device, as NCCL's is. Each GPU batch is launched 300 ms late (the test
fault `slow_gpu_launch` on rank 0, as a slow peer would make it), so a call on a non-blocking
stream must return long before its result exists, and what the stream computes after it must
still see the result; on the legacy default stream, and for the group's first call (whose
launch opens its NCCL communicators), the host waits as before. A failed operation releases
the stream that waits for it and raises at the next call.

Run by scripts/gpu/torch.sh in a job of its own (the fault and the setting are read at start);
skipped elsewhere."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import ferrovod.torch as hvd
from ferrovod.torch import backend

pytestmark = pytest.mark.skipif(
    os.environ.get("FERROVOD_TEST_FAULT") != "slow_gpu_launch:0"
    or os.environ.get("FERROVOD_TORCH_DEVICE_WAIT") != "1"
    or os.environ.get("CUDA_MODULE_LOADING") != "EAGER",
    reason="needs its own job: FERROVOD_TEST_FAULT=slow_gpu_launch:0 FERROVOD_TORCH_DEVICE_WAIT=1 "
           "CUDA_MODULE_LOADING=EAGER (scripts/gpu/torch.sh)")

DELAY = 0.3  # seconds: the fault's
CHANNELS = int(os.environ.get("FERROVOD_CHANNELS", "1"))


def start():
    """The world group on this rank's GPU, past its first call (on a side stream), which waits
    on the host: its launch opens the group's NCCL communicators. The next CUDA call may leave
    its wait to the device. Returns how long the first call took."""
    assert torch.cuda.is_available(), "these tests need CUDA"
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    dist.init_process_group("ferrovod")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.ones(4, device="cuda")
        _, took = timed(lambda: dist.all_reduce(x))
    s.synchronize()
    torch.testing.assert_close(x.cpu(), torch.full((4,), float(size())))
    return took


# how long the group's first call took
FIRST = []


@pytest.fixture(scope="module", autouse=True)
def group():
    FIRST.append(start())
    yield
    dist.destroy_process_group()


def rank():
    return dist.get_rank()


def size():
    return dist.get_world_size()


def total(n=1.0):
    """The sum over ranks of rank r's `r + n`."""
    return sum(r + n for r in range(size()))


def timed(call):
    start = time.perf_counter()
    out = call()
    return out, time.perf_counter() - start


def test_each_executors_first_call_waited_on_the_host_and_the_next_kind_on_the_device():
    # the first call's launch opened the group's NCCL communicators, which may wait for the
    # whole device: no stream may wait on the device for it. With FERROVOD_CHANNELS=k the
    # batches take the k channels in turn, each with communicators of its own: the first call
    # on each waits on the host
    if rank() == 0:
        assert FIRST[0] >= DELAY * 0.9, FIRST
    s = torch.cuda.Stream()
    took = []
    with torch.cuda.stream(s):
        y = torch.full((32,), rank() + 3.0, device="cuda")
        gathered = torch.empty(32 * size(), device="cuda")
        # a kind not run before: where its channel is connected, its launch opens nothing more
        # and loads no kernel library (the core loaded them all before the first wait)
        for _ in range(CHANNELS):
            took.append(timed(lambda: dist.all_gather_into_tensor(gathered, y))[1])
        out = gathered * 1
    s.synchronize()
    expect = torch.cat([torch.full((32,), r + 3.0) for r in range(size())])
    torch.testing.assert_close(out.cpu(), expect)
    if rank() == 0:
        # the k-1 channels not used yet, then the first channel again
        assert all(t >= DELAY * 0.9 for t in took[:-1]), took
        assert took[-1] < DELAY / 2, took


def test_a_call_that_sends_to_single_peers_waits_on_the_host_until_they_are_connected():
    # u8 travels over send/recv between every pair of ranks, which a channel's first u8 launch
    # connects (as its communicators, that may wait for the whole device)
    group = dist.new_group(list(range(size())),
                           pg_options=backend.Options(compression=hvd.Compression.u8))
    s = torch.cuda.Stream()
    took = []
    with torch.cuda.stream(s):
        xs = [torch.full((4096,), rank() + 1.0, device="cuda") for _ in range(CHANNELS + 1)]
        for x in xs:
            took.append(timed(lambda: dist.all_reduce(x, group=group))[1])
        out = [x * 1 for x in xs]
    s.synchronize()
    for x in out:
        torch.testing.assert_close(x.cpu(), torch.full((4096,), total()), rtol=1e-2, atol=1e-2)
    if rank() == 0:
        assert all(t >= DELAY * 0.9 for t in took[:-1]), took
        assert took[-1] < DELAY / 2, took
    dist.destroy_process_group(group)


def test_a_call_on_a_side_stream_returns_before_its_result_and_the_stream_sees_it():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.full((1000,), rank() + 1.0, device="cuda")
        _, took = timed(lambda: dist.all_reduce(x))
        y = x * 2  # on s, after the wait
    if rank() == 0:
        # the host did not wait for the late launch
        assert took < DELAY / 2, took
    s.synchronize()
    torch.testing.assert_close(y.cpu(), torch.full((1000,), 2 * total()))


def test_calls_back_to_back_each_read_by_the_next_all_left_to_the_device():
    s = torch.cuda.Stream()
    n = size()
    with torch.cuda.stream(s):
        start = time.perf_counter()
        a = torch.full((64,), rank() + 1.0, device="cuda")
        dist.all_reduce(a)
        b = a + rank()  # reads the first result on s
        dist.all_reduce(b)
        gathered = torch.empty(64 * n, device="cuda")
        dist.all_gather_into_tensor(gathered, b)
        scattered = torch.empty(64, device="cuda")
        dist.reduce_scatter_tensor(scattered, gathered)
        took = time.perf_counter() - start
        out = scattered.clone()
    s.synchronize()
    first = total()
    second = n * first + sum(range(n))
    torch.testing.assert_close(a.cpu(), torch.full((64,), first))
    torch.testing.assert_close(b.cpu(), torch.full((64,), second))
    torch.testing.assert_close(gathered.cpu(), torch.full((64 * n,), second))
    torch.testing.assert_close(out.cpu(), torch.full((64,), n * second))
    if rank() == 0:
        # each call waits on the host only for the launch of the one before (so that no fused
        # batch waits for itself): at most three launches of four
        assert took < 3 * DELAY + DELAY / 2, took


def test_an_async_works_wait_is_left_to_the_device_too():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.full((8,), rank() + 2.0, device="cuda")
        work = dist.all_reduce(x, async_op=True)
        _, took = timed(work.wait)
        y = x.clone()
    if rank() == 0:
        assert took < DELAY / 2, took
    s.synchronize()
    torch.testing.assert_close(y.cpu(), torch.full((8,), total(2.0)))
    # the next call takes the Work's outcome; the Work then reads as done
    dist.barrier()
    assert work.is_completed()


def test_the_legacy_default_stream_still_waits_on_the_host():
    x = torch.full((16,), rank() + 1.0, device="cuda")
    _, took = timed(lambda: dist.all_reduce(x))
    if rank() == 0:
        assert took >= DELAY * 0.9, took
    torch.testing.assert_close(x.cpu(), torch.full((16,), total()))


@pytest.mark.skipif("os.environ.get('OMPI_COMM_WORLD_SIZE', '1') == '1'")
def test_a_failed_call_releases_the_stream_and_raises_at_the_next_call():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        # ranks disagree on the reduction: the core's mismatch error, on every rank
        x = torch.ones(8, device="cuda")
        dist.all_reduce(x, op=dist.ReduceOp.SUM if rank() == 0 else dist.ReduceOp.MAX)
        after = x + 1
    s.synchronize()  # released: no hang
    assert after.shape == (8,)
    with pytest.raises(dist.DistBackendError, match="Mismatched"):
        dist.barrier()
    # the next call goes on
    y = torch.ones(4, device="cuda")
    dist.all_reduce(y)
    torch.testing.assert_close(y.cpu(), torch.full((4,), float(size())))
