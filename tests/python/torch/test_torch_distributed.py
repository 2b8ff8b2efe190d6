"""torch.distributed on the `ferrovod` backend under mpirun: every collective x dtype against
references each rank computes itself, async Works and their Futures, two subgroups at once, DDP
and FSDP2 (`fully_shard`) against one process on the whole batch, FSDP2's state dict loaded
from rank 0 and a checkpoint saved asynchronously, the codec option, bad calls
raising at the call, a disagreement raising on every rank, and the takeover of `gloo`.

On CPU tensors always; on CUDA tensors too where CUDA is available (FERROVOD_TEST_GPU=1 makes
their absence a failure)."""

import copy
import os
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ferrovod.torch as hvd
from ferrovod import _core
from ferrovod.torch import backend

DEVICES = ["cpu"]
if torch.cuda.is_available() or os.environ.get("FERROVOD_TEST_GPU") == "1":
    DEVICES.append("cuda")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.uint8, torch.int8]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}


@pytest.fixture(scope="module", autouse=True)
def group():
    hvd.init()
    if "cuda" in DEVICES:
        assert torch.cuda.is_available(), "FERROVOD_TEST_GPU=1 but CUDA is not available"
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    dist.init_process_group("ferrovod")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def rank():
    return dist.get_rank()


def size():
    return dist.get_world_size()


def dev(device):
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def values(dtype, r, shape, salt=0):
    """Rank r's tensor: small integers, exact in every dtype whatever the reduction order."""
    n = int(np.prod(shape))
    v = (np.arange(n) * 7 + r * 3 + salt) % 5 + (1 if dtype == torch.uint8 else 0)
    return torch.tensor(v.reshape(shape)).to(dtype)


def close(got, want, dtype=torch.float32):
    tol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=tol, atol=tol)


def test_the_group_is_ferrovods_and_mpis():
    assert dist.get_backend() == "ferrovod"
    assert (rank(), size()) == (hvd.rank(), hvd.size())
    # a rank or size that disagrees with MPI's is refused, naming both
    with pytest.raises(ValueError, match="MPI started this process as rank"):
        backend._check_world(rank() + 1, None)
    with pytest.raises(ValueError, match="MPI started %d processes" % size()):
        backend._check_world(None, size() + 1)
    backend._check_world(rank(), size())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_every_op(device, dtype):
    d = dev(device)
    shape = (3, 5)
    stack = torch.stack([values(dtype, r, shape).double() for r in range(size())])
    ops = {dist.ReduceOp.SUM: stack.sum(0), dist.ReduceOp.MIN: stack.min(0).values,
           dist.ReduceOp.MAX: stack.max(0).values}
    if dtype not in (torch.int8, torch.uint8):  # 5^4 wraps 8 bits
        ops[dist.ReduceOp.PRODUCT] = stack.prod(0)
    if dtype in FLOATS:
        ops[dist.ReduceOp.AVG] = stack.mean(0)
        ops[dist._make_nccl_premul_sum(0.5)] = stack.sum(0) * 0.5
    for op, want in ops.items():
        x = values(dtype, rank(), shape).to(d)
        assert dist.all_reduce(x, op=op) is None
        assert x.dtype == dtype and x.device == d
        close(x, want, dtype)
    # a view that is not contiguous is reduced in place too
    base = torch.stack([values(dtype, rank(), (4,)), values(dtype, rank(), (4,), 1)], 1).to(d)
    view = base[:, 1]
    dist.all_reduce(view)
    close(base[:, 1], torch.stack([values(dtype, r, (4,), 1).double() for r in range(size())]).sum(0), dtype)
    close(base[:, 0], values(dtype, rank(), (4,)), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast_gather_scatter_and_reduce(device, dtype):
    d = dev(device)
    shape = (2, 3)
    for root in range(size()):
        x = values(dtype, rank(), shape).to(d)
        dist.broadcast(x, src=root)
        close(x, values(dtype, root, shape), dtype)
        # reduce: the root holds the sum, the others keep their tensor
        y = values(dtype, rank(), shape).to(d)
        dist.reduce(y, dst=root, op=dist.ReduceOp.MAX)
        want = (torch.stack([values(dtype, r, shape).double() for r in range(size())]).max(0).values
                if rank() == root else values(dtype, rank(), shape))
        close(y, want, dtype)
        # gather to the root
        out = [torch.zeros(shape, dtype=dtype, device=d) for _ in range(size())] if rank() == root else None
        dist.gather(values(dtype, rank(), shape).to(d), out, dst=root)
        if rank() == root:
            for r in range(size()):
                close(out[r], values(dtype, r, shape), dtype)
        # scatter from the root: rank r gets piece r
        pieces = [values(dtype, 10 + r, shape).to(d) for r in range(size())] if rank() == root else None
        got = torch.zeros(shape, dtype=dtype, device=d)
        dist.scatter(got, pieces, src=root)
        close(got, values(dtype, 10 + rank(), shape), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_gather_reduce_scatter_and_all_to_all(device, dtype):
    d = dev(device)
    n = size()
    outs = [torch.zeros(4, dtype=dtype, device=d) for _ in range(n)]
    dist.all_gather(outs, values(dtype, rank(), (4,)).to(d))
    for r in range(n):
        close(outs[r], values(dtype, r, (4,)), dtype)
    flat = torch.zeros(n * 2, 3, dtype=dtype, device=d)
    dist.all_gather_into_tensor(flat, values(dtype, rank(), (2, 3)).to(d))
    close(flat, torch.cat([values(dtype, r, (2, 3)) for r in range(n)]), dtype)
    # in place, as FSDP gathers: the input is this rank's piece of the output
    whole = torch.zeros(n * 5, dtype=dtype, device=d)
    piece = whole[rank() * 5:(rank() + 1) * 5]
    piece.copy_(values(dtype, rank(), (5,), 2))
    dist.all_gather_into_tensor(whole, piece)
    close(whole, torch.cat([values(dtype, r, (5,), 2) for r in range(n)]), dtype)
    # coalesced: one Work for several
    pg = dist.distributed_c10d._get_default_group()
    outs2 = [torch.zeros(n * k, dtype=dtype, device=d) for k in (1, 3)]
    work = pg.allgather_into_tensor_coalesced(outs2, [values(dtype, rank(), (k,), k).to(d) for k in (1, 3)])
    assert work.get_future().wait() == outs2
    for k, o in zip((1, 3), outs2):
        close(o, torch.cat([values(dtype, r, (k,), k) for r in range(n)]), dtype)
    # reduce-scatter: rank r keeps the sum of every rank's piece r
    inputs = [values(dtype, rank(), (3,), p) for p in range(n)]
    mine = torch.zeros(3, dtype=dtype, device=d)
    dist.reduce_scatter(mine, [t.to(d) for t in inputs])
    close(mine, torch.stack([values(dtype, r, (3,), rank()).double() for r in range(n)]).sum(0), dtype)
    whole = torch.cat([values(dtype, rank(), (2,), p) for p in range(n)]).to(d)
    part = torch.zeros(2, dtype=dtype, device=d)
    op = dist.ReduceOp.AVG if dtype in FLOATS else dist.ReduceOp.SUM
    dist.reduce_scatter_tensor(part, whole, op=op)
    stack = torch.stack([values(dtype, r, (2,), rank()).double() for r in range(n)])
    close(part, stack.mean(0) if op == dist.ReduceOp.AVG else stack.sum(0), dtype)
    # all-to-all: equal rows, then rank r sends r + 1 rows to each rank
    send = torch.stack([values(dtype, rank(), (2,), p) for p in range(n)]).to(d)
    recv = torch.zeros_like(send)
    dist.all_to_all_single(recv, send)
    for p in range(n):
        close(recv[p], values(dtype, p, (2,), rank()), dtype)
    rows = rank() + 1
    send = torch.cat([values(dtype, rank(), (rows, 2), p) for p in range(n)]).to(d)
    recv = torch.zeros(sum(p + 1 for p in range(n)), 2, dtype=dtype, device=d)
    dist.all_to_all_single(recv, send, output_split_sizes=[p + 1 for p in range(n)],
                           input_split_sizes=[rows] * n)
    close(recv, torch.cat([values(dtype, p, (p + 1, 2), rank()) for p in range(n)]), dtype)
    outs = [torch.zeros(r + 1, dtype=dtype, device=d) for r in range(n)]
    dist.all_to_all(outs, [values(dtype, rank(), (rank() + 1,), p).to(d) for p in range(n)])
    for p in range(n):
        close(outs[p], values(dtype, p, (p + 1,), rank()), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_async_works_and_futures(device):
    d = dev(device)
    xs = [values(torch.float32, rank(), (5,), k).to(d) for k in range(6)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    futures = [w.get_future() for w in works[:3]]
    chained = futures[0].then(lambda f: f.value()[0] * 2)
    for w in works[3:]:
        assert w.wait()
    for k, x in enumerate(xs):
        if k < 3:
            futures[k].wait()
        close(x, torch.stack([values(torch.float32, r, (5,), k) for r in range(size())]).sum(0))
    close(chained.wait(), xs[0] * 2)
    assert all(w.is_completed() and w.is_success() for w in works)
    # a Future asked for once the Work was waited for holds its result (made then), as does
    # the Work
    assert works[4].get_future().wait() == [xs[4]] and works[4].result() == [xs[4]]
    assert works[4].get_future() is works[4].get_future()
    dist.barrier()
    # the Works are forgotten once complete, and the core holds nothing after 1,000 of them
    before = _core.in_flight_count()
    x = torch.ones(8, device=d)
    for _ in range(1000):
        dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True).wait()
    assert not backend._works
    assert _core.in_flight_count() <= before
    group = dist.distributed_c10d._get_default_group()
    assert len(group._names._in_flight) <= 4


@pytest.mark.parametrize("device", DEVICES)
def test_a_futures_callback_may_run_collectives(device):
    """A callback of a Work's Future runs on the backend's completion thread: a collective it
    issues (blocking, under the name of the one completing) completes there too."""
    d = dev(device)
    x = values(torch.float32, rank(), (4,)).to(d)
    y = values(torch.float32, rank(), (4,), 1).to(d)

    def then(f):
        dist.all_reduce(y)  # x's signature: one name, x's operation just completed
        return f.value()[0] + y

    got = dist.all_reduce(x, async_op=True).get_future().then(then).wait()
    want_x = torch.stack([values(torch.float32, r, (4,)) for r in range(size())]).sum(0)
    want_y = torch.stack([values(torch.float32, r, (4,), 1) for r in range(size())]).sum(0)
    close(got, want_x + want_y)


@pytest.mark.parametrize("device", DEVICES)
def test_a_futures_callback_may_wait_for_another_futures_collective(device):
    """As PyTorch's PowerSGD hook does: a callback starts an asynchronous collective and blocks
    in torch's `Future.wait` for it, nested twice; the completion thread it runs on hands its
    work to another rather than wait for itself."""
    d = dev(device)
    x = values(torch.float32, rank(), (4,)).to(d)
    ys = [values(torch.float32, rank(), (3,), k).to(d) for k in (1, 2)]

    def inner(f):
        return f.value()[0] + dist.all_reduce(ys[1], async_op=True).get_future().wait()[0].sum()

    def outer(f):
        nested = dist.all_reduce(ys[0], async_op=True).get_future().then(inner).wait()
        return f.value()[0] + nested.sum()

    got = dist.all_reduce(x, async_op=True).get_future().then(outer).wait()
    total = lambda salt, shape: torch.stack(  # noqa: E731
        [values(torch.float32, r, shape, salt) for r in range(size())]).sum(0)
    want = total(0, (4,)) + (total(1, (3,)) + total(2, (3,)).sum()).sum()
    close(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_ddp_with_torchs_powersgd_hook_averages_as_without_it(device):
    """PyTorch's own PowerSGD hook on the backend (its parity test's model): a rank-1 gradient is
    approximated exactly, so each step's gradient is the plain average."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    d = dev(device)
    if d.type == "cpu" and torch.cuda.is_available():
        pytest.skip("PyTorch's hook synchronises CUDA on the model's device where CUDA exists")
    torch.manual_seed(0)
    m = torch.nn.Linear(1, 5).to(d)
    ids = [d] if d.type == "cuda" else None
    plain = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(m), device_ids=ids)
    for warm_start in (True, False):
        hooked = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(m), device_ids=ids)
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, warm_start=warm_start)
        hooked.register_comm_hook(state=state, hook=powerSGD.powerSGD_hook)
        for step in range(6):
            for net in (plain, hooked):
                net.zero_grad()
                net(torch.tensor([float(rank())], device=d)).sum().backward()
            mean = sum(range(size())) / size()
            grad = hooked.module.weight.grad.cpu().double()
            exact = dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(grad, torch.full((5, 1), mean).double(), **exact)
            torch.testing.assert_close(grad, plain.module.weight.grad.cpu().double(), **exact)


def test_blocking_calls_complete_on_the_waiting_thread_and_leave_nothing_behind():
    import time

    # a Work left to the completion thread, beside blocking calls its waiter completes itself
    a = torch.full((5,), float(rank()))
    w = dist.all_reduce(a, async_op=True)
    seen = w.get_future().then(lambda f: f.value()[0].sum().item())
    total = 0.0
    for i in range(300):
        b = torch.full((2, 3), float(rank() + i))
        dist.all_reduce(b)  # one contiguous tensor: the core's per-name structs
        want = float(sum(range(size())) + i * size())
        close(b, torch.full((2, 3), want))
        total += b[0, 0].item()
    w.wait()
    close(a, torch.full((5,), float(sum(range(size())))))
    assert seen.wait() == 5.0 * sum(range(size()))
    assert total == sum(float(sum(range(size())) + i * size()) for i in range(300))
    # every claimed Work is let go once its callback came
    deadline = time.monotonic() + 10
    while backend._claimed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not backend._claimed


@pytest.mark.parametrize("device", DEVICES)
def test_blocking_calls_complete_within_the_call_beside_asynchronous_ones(device):
    """A blocking all_reduce, all-gather or reduce-scatter into a given output completes before
    the call returns (its Work is finished); under the name of an asynchronous call of the same
    signature still in flight it waits for that one; 1,000 of them leave no name, Work or core
    operation behind, and on CUDA the caller's stream orders the result."""
    if not hasattr(dist.AllreduceOptions(), "asyncOp"):
        pytest.skip("this torch does not say whether a call is asynchronous")
    d = dev(device)
    n = size()
    pg = dist.distributed_c10d._get_default_group()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    x = torch.full((4,), float(rank()), device=d)
    work = pg.allreduce([x], opts)
    assert isinstance(work, backend._Finished)
    assert work.wait() and work.result() == [x] and work.get_future().wait() == [x]
    close(x, torch.full((4,), float(sum(range(n)))))
    # two threads' blocking calls of one signature: each waits for the other's in flight
    # rather than meet the core's refusal of a name in flight
    errors = []

    def calls():
        try:
            for _ in range(100):
                z = torch.full((7,), float(rank()), device=d)
                dist.all_reduce(z)
                close(z, torch.full((7,), float(sum(range(n)))))
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=calls) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # an asynchronous call in flight, then blocking ones of its signature, then another
    # asynchronous one: each in its turn
    a = torch.full((4,), 1.0 + rank(), device=d)
    first = dist.all_reduce(a, async_op=True)
    b = torch.full((4,), 10.0 * (rank() + 1), device=d)
    dist.all_reduce(b)
    c = torch.full((4,), 100.0, device=d)
    last = dist.all_reduce(c, async_op=True)
    dist.all_reduce(b)
    first.wait()
    last.wait()
    close(a, torch.full((4,), float(sum(1 + r for r in range(n)))))
    close(b, torch.full((4,), float(n * sum(10 * (r + 1) for r in range(n)))))
    close(c, torch.full((4,), 100.0 * n))
    before = _core.in_flight_count()
    out = torch.zeros(3 * n, device=d)
    part = torch.zeros(3, device=d)
    for i in range(1000):
        y = torch.full((3,), float(rank() + i), device=d)
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        dist.all_gather_into_tensor(out, y)
        dist.reduce_scatter_tensor(part, out)
        # the next step's computation on the current stream reads the results
        total = part.sum() + y[0]
    # y: the ranks' largest, n - 1 + i; each of part's 3 values: the n ranks' gathered y summed
    close(total, torch.tensor(3 * n * (n - 1 + 999.0) + n - 1 + 999.0, device=d))
    assert _core.in_flight_count() <= before
    assert not pg._names._in_flight
    assert not backend._works


@pytest.mark.parametrize("device", DEVICES)
def test_a_blocking_call_needs_no_callback(device):
    """torch tells the group when its caller waits at once (async_op=False): such an operation
    is submitted without a done callback and completed by the waiting thread, so no key is
    drawn for the completion queue; its results are still right."""
    if not hasattr(dist.AllreduceOptions(), "asyncOp"):
        pytest.skip("this torch does not say whether a call is asynchronous")
    d = dev(device)
    n = size()
    first = next(backend._work_keys)
    for i in range(20):
        x = torch.full((3,), float(rank() + i), device=d)
        dist.all_reduce(x)
        close(x, torch.full((3,), float(sum(range(n)) + i * n)))
        out = torch.zeros(2 * n, device=d)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank() * i), device=d))
        close(out, torch.tensor([float(r * i) for r in range(n) for _ in range(2)]))
        part = torch.zeros(2, device=d)
        dist.reduce_scatter_tensor(part, torch.arange(2.0 * n, device=d) + i)
        close(part, (torch.arange(2.0 * n) + i).view(n, 2)[rank()] * n)
        b = torch.full((2,), float(rank()), device=d)
        dist.broadcast(b, src=n - 1)
        close(b, torch.full((2,), float(n - 1)))
    assert next(backend._work_keys) == first + 1
    # what earlier tests' asynchronous Works left is let go as their completions come
    deadline = time.monotonic() + 10
    while (backend._works or backend._claimed) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not backend._works and not backend._claimed
    # and a coalesced call that torch says is blocking joins pieces that are not
    pg = dist.distributed_c10d._get_default_group()
    outs = [torch.zeros(n * k, device=d) for k in (1, 2)]
    opts = dist.distributed_c10d.AllgatherOptions()
    opts.asyncOp = False
    pg.allgather_into_tensor_coalesced(outs, [torch.full((k,), float(rank()), device=d)
                                              for k in (1, 2)], opts).wait()
    for k, o in zip((1, 2), outs):
        close(o, torch.tensor([float(r) for r in range(n) for _ in range(k)]))
    parts = [torch.zeros(k, device=d) for k in (1, 2)]
    ropts = dist.distributed_c10d.ReduceScatterOptions()
    ropts.asyncOp = False
    ropts.reduceOp = dist.ReduceOp.SUM
    pg.reduce_scatter_tensor_coalesced(parts, [torch.ones(n * k, device=d) for k in (1, 2)],
                                       ropts).wait()
    for k, part in zip((1, 2), parts):
        close(part, torch.full((k,), float(n)))


def test_a_latch_is_set_once_by_any_number_of_threads():
    import threading

    latch = backend._Latch()
    assert not latch.is_set() and latch.wait(0.01) is False
    threads = [threading.Thread(target=latch.set) for _ in range(8)]
    for t in threads:
        t.start()
    assert latch.wait(5)
    for t in threads:
        t.join()
    latch.set()
    assert latch.is_set() and latch.wait() and latch.wait(0)


def test_wait_gives_up_at_its_timeout():
    import datetime

    x = torch.ones(3)
    if rank() == 0:
        work = dist.all_reduce(x, async_op=True)
        with pytest.raises(dist.DistBackendError, match="within 0.3 s"):
            work.wait(timeout=datetime.timedelta(seconds=0.3))
        assert not work.is_completed()
        dist.barrier()
        assert work.wait()  # the others' calls come after the barrier
    else:
        dist.barrier()
        dist.all_reduce(x)
    close(x, torch.full((3,), float(size())))


def test_device_mesh_groups_are_ferrovod_process_sets():
    """DeviceMesh makes a 2-D mesh's groups with its own reference to new_group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (size() // 2, 2), mesh_dim_names=("dp", "tp"))
    for dim, stride in (("tp", 1), ("dp", 2)):
        group = mesh.get_group(dim)
        assert dist.get_backend(group) == "ferrovod"
        members = [r for r in range(size()) if r % stride == rank() % stride
                   and r // (2 * stride) == rank() // (2 * stride)] if dim == "tp" else \
            [r for r in range(size()) if r % 2 == rank() % 2]
        x = torch.full((2,), float(rank() + 1))
        dist.all_reduce(x, group=group)
        close(x, torch.full((2,), float(sum(r + 1 for r in members))))


def test_device_id_and_destroying_world_release_the_sets():
    dist.destroy_process_group()
    assert not backend._sets
    # NCCL-style scripts pass the device to bind: accepted, the device made current
    dist.init_process_group("ferrovod", device_id=dev(DEVICES[-1]))
    g = dist.new_group([0, 1])
    assert backend._sets or size() == 2
    if rank() < 2:
        x = torch.ones(2)
        dist.all_reduce(x, group=g)
        close(x, torch.full((2,), 2.0))
    dist.destroy_process_group(dist.group.WORLD)
    assert not dist.is_initialized() and not backend._sets
    dist.init_process_group("ferrovod")


@pytest.mark.parametrize("device", DEVICES)
def test_all_gather_coalesced(device):
    d = dev(device)
    inputs = [values(torch.float32, rank(), (2, 3)).to(d), values(torch.float32, rank(), (4,), 1).to(d)]
    # torch's layout: one list per rank, one tensor per input in each
    outputs = [[torch.zeros_like(t) for t in inputs] for _ in range(size())]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates the call; scripts still make it
        dist.all_gather_coalesced(outputs, inputs)
    for r in range(size()):
        close(outputs[r][0], values(torch.float32, r, (2, 3)))
        close(outputs[r][1], values(torch.float32, r, (4,), 1))


def test_two_subgroups_at_once():
    n = size()
    evens = list(range(0, n, 2))
    tail = list(range(n // 2, n)) if n > 2 else [0, 1]
    g1 = dist.new_group(evens)
    g2 = dist.new_group(tail)
    # both in flight together
    x1 = torch.full((3,), float(rank()))
    x2 = torch.full((3,), float(rank()) * 10)
    w1 = dist.all_reduce(x1, group=g1, async_op=True) if rank() in evens else None
    w2 = dist.all_reduce(x2, group=g2, async_op=True) if rank() in tail else None
    if w1:
        w1.wait()
        close(x1, torch.full((3,), float(sum(evens))))
    if w2:
        w2.wait()
        close(x2, torch.full((3,), 10.0 * sum(tail)))
    if rank() in tail:
        # group ranks, not global ones, name the root
        b = torch.full((2,), float(rank()))
        dist.broadcast(b, group=g2, group_src=len(tail) - 1)
        close(b, torch.full((2,), float(tail[-1])))
        assert dist.get_rank(g2) == tail.index(rank())
    dist.barrier()


def test_ranks_ask_for_different_groups_in_one_call():
    # torch lets each rank name its own group in the same new_group call (new_subgroups with a
    # group does it): evens ask for the evens, odds for the odds
    n = size()
    mine = [r for r in range(n) if r % 2 == rank() % 2]
    g = dist.new_group(mine)
    x = torch.full((4,), float(rank()) + 1)
    dist.all_reduce(x, group=g)
    close(x, torch.full((4,), float(sum(r + 1 for r in mine))))
    assert dist.get_world_size(g) == len(mine) and dist.get_rank(g) == mine.index(rank())
    # a rank outside the world on one rank only is an error on every rank, not a hang
    with pytest.raises(ValueError, match="out of range"):
        dist.new_group([0, n] if rank() == n - 1 else [0, 1])
    dist.barrier()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("view,static", [(False, False), (True, True)],
                         ids=["copied", "bucket-views-static"])
def test_ddp_equals_one_process_on_the_whole_batch(device, view, static):
    ddp_against_one_process(dev(device), view, static)


@pytest.mark.parametrize("view", [False, True], ids=["copied", "bucket-views"])
def test_ddp_on_a_gpu_that_is_not_the_current_device(view):
    """As PyTorch's own DDP test runs: the model on this rank's GPU while the current device
    stays GPU 0 (nothing calls set_device), so every stream the backend uses must be the
    tensors' device's, not the current one's."""
    if "cuda" not in DEVICES or torch.cuda.device_count() < 2:
        pytest.skip("needs CUDA and a second GPU")
    d = dev("cuda")
    other = 0 if d.index != 0 else 1
    with torch.cuda.device(other):
        ddp_against_one_process(d, view, False)


def test_the_current_device_stays_while_collectives_run_on_another():
    """A collective on this rank's GPU, called while another GPU is the current device: the
    backend records on and waits on the tensors' device, and the caller's current device is
    the same afterwards (PyTorch reads it from the thread's current CUDA context)."""
    if "cuda" not in DEVICES or torch.cuda.device_count() < 2:
        pytest.skip("needs CUDA and a second GPU")
    d = dev("cuda")
    other = 0 if d.index != 0 else 1
    with torch.cuda.device(other):
        t = torch.full((1 << 16,), float(rank() + 1), device=d)
        dist.all_reduce(t)
        assert torch.cuda.current_device() == other
        work = dist.all_reduce(t, async_op=True)
        assert torch.cuda.current_device() == other
        work.wait()
        assert torch.cuda.current_device() == other
        hvd.allreduce_(t, op=hvd.Sum, name="current.device")
        assert torch.cuda.current_device() == other
        n = size()
        want = float(n * (n + 1) // 2) * n * n
        assert torch.equal(t.cpu(), torch.full((1 << 16,), want))


def step_alongside(ddp, opt, ref, ref_opt, x, y):
    """One step of `ddp` on this rank's share of the batch (x, y), and of `ref`, in this one
    process, on all of it."""
    per = x.shape[0] // size()
    mine = slice(per * rank(), per * (rank() + 1))
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
    opt.step()
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()


def ddp_against_one_process(d, view, static):
    """DDP on `d` over the backend against one process on the whole batch: six SGD steps with
    momentum, the parameters equal."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4)).to(d)
    ref = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[d.index] if d.type == "cuda" else None, bucket_cap_mb=0.0002,
        gradient_as_bucket_view=view, static_graph=static)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    per = 4
    for _ in range(6):
        x = torch.randn(per * size(), 8, generator=g).to(d)
        y = torch.randn(per * size(), 4, generator=g).to(d)
        step_alongside(ddp, opt, ref, ref_opt, x, y)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_ddp_join_with_uneven_inputs_averages_over_the_ranks_still_training(device):
    """DDP's `join()` with ranks that run different numbers of steps (rank r: 3 + r), as
    PyTorch's own test of it: each step's gradient, the same input everywhere, is the one input's
    gradient when divided by the ranks still training, and scaled by their share of the world
    when divided by the initial world size. The reducer asks the Work of each forward pass's
    notice for its Future in the backward pass."""
    d = dev(device)
    dim, scale = 5, 50.0
    ddp = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(dim, dim, bias=False).to(d),
        device_ids=[d.index] if d.type == "cuda" else None, bucket_cap_mb=1)
    x = torch.full((1, dim), scale, device=d)
    steps = 3 + rank()
    for initial in (False, True):
        with ddp.join(divide_by_initial_world_size=initial):
            for i in range(steps):
                ddp(x).sum().backward()
                training = sum(1 for r in range(size()) if 3 + r > i)
                share = training / size() if initial else 1.0
                want = torch.full((dim, dim), scale * share)
                torch.testing.assert_close(ddp.module.weight.grad.cpu(), want)
                ddp.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
def test_zero_redundancy_optimizer_and_model_averaging(device):
    """torch's other data-parallel tools over the group: DDP with ZeroRedundancyOptimizer
    (each rank steps its shard of Adam's state, then broadcasts it) equals one process with
    Adam on the whole batch, its state consolidates on rank 0, and post-local SGD's
    PeriodicModelAverager averages every rank's parameters."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import ZeroRedundancyOptimizer

    d = dev(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 3)).to(d)
    ref = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[d.index] if d.type == "cuda" else None)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(2 * size(), 6, generator=g).to(d)
        opt.zero_grad()
        ddp(x[2 * rank():2 * rank() + 2]).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    opt.consolidate_state_dict(to=0)
    if rank() == 0:
        assert len(opt.state_dict()["state"]) == len(list(model.parameters()))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank()))
    PeriodicModelAverager(period=1, warmup_steps=0).average_parameters(model.parameters())
    for p in model.parameters():
        torch.testing.assert_close(p, torch.full_like(p, (size() - 1) / 2))


@pytest.mark.parametrize("device", DEVICES)
def test_dtensor_redistributes_through_functional_collectives(device):
    """DTensor over a mesh of the group: sharding by rows, then to replicas (an all-gather),
    to shards by columns (an all-to-all), a sum (a partial all-reduced) and a product with a
    replicated matrix, each equal to the same on the whole tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    d = dev(device)
    mesh = init_device_mesh(device, (size(),))
    full = torch.arange(4.0 * size() * size()).reshape(4 * size(), size()).to(d)
    rows = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(rows.to_local(), full[4 * rank():4 * rank() + 4])
    assert torch.equal(rows.redistribute(mesh, [Replicate()]).to_local(), full)
    cols = rows.redistribute(mesh, [Shard(1)])
    assert torch.equal(cols.to_local(), full[:, rank():rank() + 1])
    assert torch.equal(cols.full_tensor(), full)
    assert float((rows * 2).sum().full_tensor()) == float(full.sum() * 2)
    ones = distribute_tensor(torch.ones(size(), 2, device=d), mesh, [Replicate()])
    assert torch.equal((rows @ ones).full_tensor(), full @ torch.ones(size(), 2, device=d))


def test_ddp_on_a_side_stream_writes_back_before_the_next_call():
    """As PyTorch's own test: DDP built and run under a non-default stream; each step's averaged
    gradient must be written back before a collective on it that follows."""
    if "cuda" not in DEVICES:
        pytest.skip("CUDA only")
    d = dev("cuda")
    stream = torch.cuda.Stream(d)
    with torch.cuda.stream(stream):
        net = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Linear(1, 1, bias=False).to(d), device_ids=[d.index])
        for _ in range(50):
            if net.module.weight.grad is not None:
                net.module.weight.grad.requires_grad_(False)
                net.module.weight.grad.zero_()
            net(torch.tensor([float(rank())], device=d)).sum().backward()
            avg = net.module.weight.grad.clone()
            dist.all_reduce(avg)
            avg.div_(size())
            want = sum(range(size())) / size()
            assert abs(avg.item() - want) < 1e-6, (avg.item(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_equals_one_process_on_the_whole_batch(device):
    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
        torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
    )
    ref = copy.deepcopy(model)
    model.to(dev(device))
    mesh = init_device_mesh(device, (size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    per = 2
    for _ in range(4):
        x = torch.randn(per * size(), 5, 16, generator=g)
        mine = slice(per * rank(), per * (rank() + 1))
        opt.zero_grad()
        model(x[mine].to(dev(device))).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor().cpu(), q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_loads_a_full_state_dict_broadcast_from_rank_0(device):
    """torch's checkpoint loading for FSDP2 as torchtitan does it: rank 0 alone holds the full
    state dict, `set_model_state_dict(broadcast_from_rank0=True)` sends every rank its shards
    (torch picks the broadcast's device from the group's devices), and the full state dict read
    back on every rank equals rank 0's."""
    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))

    saved = make()
    with torch.no_grad():
        for i, p in enumerate(saved.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 0.01 + i)
    model = make().to(dev(device))
    mesh = init_device_mesh(device, (size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    full = saved.state_dict() if rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=True))
    if rank() == 0:
        assert got.keys() == saved.state_dict().keys()
        for k, v in saved.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    for p, q in zip(model.parameters(), saved.parameters()):
        torch.testing.assert_close(p.full_tensor().cpu(), q, rtol=0, atol=0)


def test_a_checkpoint_saved_asynchronously_loads_back():
    """torch.distributed.checkpoint's `async_save` (which asks the group for a CPU backend)
    and `load`, every rank's own values, into a directory rank 0 names."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    names = [tempfile.mkdtemp(prefix="ferrovod-dcp-") if rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    where = os.path.join(names[0], "ckpt")
    state = {"w": torch.arange(12.0).reshape(3, 4) + 0.5, "step": torch.tensor(7)}
    dcp.async_save(state, checkpoint_id=where).result()
    dist.barrier()
    back = {"w": torch.zeros(3, 4), "step": torch.tensor(0)}
    dcp.load(back, checkpoint_id=where)
    assert torch.equal(back["w"], state["w"]) and back["step"].item() == 7, back
    dist.barrier()
    if rank() == 0:
        import shutil

        shutil.rmtree(names[0])


# (codec, largest error of the mean of values in [0, 1) it may leave)
CODECS = [("fp16", 1e-3), ("bf16", 1e-2), ("mixed", 1e-3), ("u8", 2e-2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec,bound", CODECS, ids=[c for c, _ in CODECS])
def test_the_codec_option_compresses_float32_sums(device, codec, bound):
    d = dev(device)
    g = dist.new_group(list(range(size())),
                       pg_options=backend.Options(compression=getattr(hvd.Compression, codec)))
    gen = torch.Generator().manual_seed(7)
    every = torch.rand(size(), 16384, generator=gen)  # 64 KiB: above mixed's 32 KiB
    x = every[rank()].clone().to(d)
    dist.all_reduce(x, op=dist.ReduceOp.AVG, group=g)
    err = (x.double().cpu() - every.double().mean(0)).abs().max().item()
    # the codec on the wire: off by more than float32 rounding, within the codec's
    assert 1e-6 < err < bound, err
    # the same on every rank
    first = x.clone()
    dist.broadcast(first, src=0)
    assert torch.equal(first, x)
    if codec == "mixed":  # small tensors travel as float32
        small = every[rank(), :1024].clone().to(d)
        dist.all_reduce(small, op=dist.ReduceOp.AVG, group=g)
        close(small, every[:, :1024].double().mean(0))
    # other reductions and dtypes travel as they are
    y = every[rank()].clone().to(d)
    dist.all_reduce(y, op=dist.ReduceOp.MAX, group=g)
    assert torch.equal(y.cpu(), every.max(0).values)
    z = (every[rank()] * 100).double().to(d)
    dist.all_reduce(z, group=g)
    close(z, (every.double() * 100).sum(0), torch.float64)


def test_top_k_and_powersgd_as_options():
    """The host codecs through the group's options: top-k sums every rank's largest values
    (against NumPy), PowerSGD an average of matrices of rank 1 exactly, each with its counter."""
    n = size()
    gen = torch.Generator().manual_seed(11)
    every = torch.randn(n, 40, generator=gen)
    g = dist.new_group(list(range(n)),
                       pg_options=backend.Options(compression=hvd.Compression.topk(0.25)))
    before = hvd.metrics()["wire_topk"]
    x = every[rank()].clone()
    dist.all_reduce(x, group=g)
    want = np.zeros(40)
    for row in every.double().numpy():
        sent = sorted(range(40), key=lambda i: (-abs(row[i]), i))[:10]
        want[sent] += row[sent]
    np.testing.assert_allclose(x.double().numpy(), want, rtol=1e-6, atol=1e-6)
    assert hvd.metrics()["wire_topk"] - before == 10 * 8
    g = dist.new_group(list(range(n)),
                       pg_options=backend.Options(compression=hvd.Compression.powersgd))
    us, vs = torch.randn(n, 48, 1, generator=gen), torch.randn(n, 1, 20, generator=gen)
    before = hvd.metrics()["wire_powersgd"]
    m = (us[rank()] @ vs[rank()]).contiguous()
    dist.all_reduce(m, op=dist.ReduceOp.AVG, group=g)
    want = sum((us[q] @ vs[q]).double() for q in range(n)) / n
    np.testing.assert_allclose(m.double().numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
    assert hvd.metrics()["wire_powersgd"] - before == (48 + 20) * 4 * 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_send_and_recv_around_the_ring(device, dtype):
    d, n = dev(device), size()
    nxt, prev = (rank() + 1) % n, (rank() + n - 1) % n
    # blocking: even ranks send first, odd ranks receive first
    got = torch.zeros(3, 5, dtype=dtype, device=d)
    mine = values(dtype, rank(), (3, 5)).to(d)
    if rank() % 2 == 0:
        dist.send(mine, dst=nxt)
        dist.recv(got, src=prev)
    else:
        dist.recv(got, src=prev)
        dist.send(mine, dst=nxt)
    close(got, values(dtype, prev, (3, 5)), dtype)
    # non-contiguous tensors both ways, and a tag
    out = values(dtype, rank(), (4, 6), salt=1).to(d).t()
    into = torch.zeros(6, 8, dtype=dtype, device=d)[:, ::2]
    works = [dist.irecv(into, src=prev, tag=3), dist.isend(out, dst=nxt, tag=3)]
    for w in works:
        w.wait()
    close(into, values(dtype, prev, (4, 6), salt=1).t(), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_isend_irecv_in_any_order_with_tags(device):
    d, n = dev(device), size()
    nxt, prev = (rank() + 1) % n, (rank() + n - 1) % n
    got = [torch.zeros(7, device=d) for _ in range(4)]
    ops = [dist.P2POp(dist.irecv, got[k], prev, tag=k % 2) for k in range(4)]
    ops += [dist.P2POp(dist.isend, torch.full((7,), 10.0 * rank() + k, device=d), nxt, tag=k % 2)
            for k in range(4)]
    if rank() % 2:
        # sends listed first (the receives keep their order among themselves)
        ops = ops[4:] + ops[:4]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    for k in range(4):
        close(got[k], torch.full((7,), 10.0 * prev + k))


def test_recv_from_any_rank_names_the_sender():
    n = size()
    if rank() == 0:
        seen = []
        for _ in range(n - 1):
            t = torch.zeros(3)
            src = dist.recv(t, tag=4)  # src=None: from any rank
            assert torch.equal(t, torch.full((3,), float(src))), (src, t)
            seen.append(src)
        assert sorted(seen) == list(range(1, n))
        t = torch.zeros(3)
        w = dist.irecv(t, tag=4)  # from any rank too: the Work names the sender
    else:
        dist.send(torch.full((3,), float(rank())), 0, tag=4)
    dist.barrier()  # the first round is received: the next message is the only one
    if rank() == n - 1:
        dist.send(torch.full((3,), 7.0), 0, tag=4)
    if rank() == 0:
        w.wait()
        assert w._source_rank() == n - 1 and torch.equal(t, torch.full((3,), 7.0))
    dist.barrier()


def test_send_and_recv_in_a_subgroup_and_a_mismatch_fails_both_sides():
    n = size()
    g = dist.new_group(list(range(1, n))) if n > 2 else None
    if g is not None and rank() > 0:
        m = n - 1
        gr = dist.get_group_rank(g, rank())
        nxt = dist.get_global_rank(g, (gr + 1) % m)
        prev = dist.get_global_rank(g, (gr + m - 1) % m)
        got = torch.zeros(4, dtype=torch.int64)
        w = dist.irecv(got, src=prev, group=g)
        dist.send(torch.arange(4) + 100 * rank(), dst=nxt, group=g)
        w.wait()
        assert torch.equal(got, torch.arange(4) + 100 * prev)
    # sizes that disagree: both ranks of the pair get a DistBackendError naming them
    if rank() < 2:
        peer = 1 - rank()
        t = torch.zeros(4 if rank() == 0 else 3)
        op = dist.isend if rank() == 0 else dist.irecv
        with pytest.raises(dist.DistBackendError, match="Mismatched point-to-point sizes"):
            op(t, peer).wait()
    # the pair goes on
    if rank() < 2:
        t = torch.full((2,), float(rank()))
        if rank() == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
            close(t, torch.zeros(2))
    dist.barrier()


def sparse_of(r, n, dense_dims, device):
    """Rank r's sparse COO tensor: rank r holds r values (rank 0 none), some indices repeated
    (uncoalesced), some shared with other ranks."""
    rows = torch.tensor([(r * 3 + 2 * k) % n for k in range(r)], dtype=torch.int64)
    cols = torch.tensor([k % 2 for k in range(r)], dtype=torch.int64)
    vals = torch.tensor([float(r + k) for k in range(r)]).reshape((r,) + (1,) * dense_dims)
    vals = vals.expand((r,) + (3,) * dense_dims).contiguous()
    return torch.sparse_coo_tensor(torch.stack([rows, cols]), vals,
                                   (n, 2) + (3,) * dense_dims).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dense_dims", [0, 1])
def test_sparse_all_reduce_sums_every_ranks_values(device, dense_dims):
    n = 2 * size() + 1
    t = sparse_of(rank(), n, dense_dims, dev(device))
    dist.all_reduce(t)
    want = sum(sparse_of(r, n, dense_dims, "cpu").to_dense() for r in range(size()))
    assert t.layout == torch.sparse_coo and t.is_coalesced() and t.device == dev(device)
    assert torch.equal(t.to_dense().cpu(), want)
    # asynchronously, and a second time under the same name
    u = sparse_of(rank(), n, dense_dims, dev(device))
    dist.all_reduce(u, async_op=True).wait()
    assert torch.equal(u.to_dense().cpu(), want)
    with pytest.raises(ValueError, match="SUM only"):
        dist.all_reduce(sparse_of(rank(), n, dense_dims, dev(device)), op=dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match="dense .strided. tensors, not torch.sparse_coo"):
        dist.broadcast(sparse_of(rank(), n, dense_dims, dev(device)), src=0)
    # the group still works
    y = torch.ones(2, device=dev(device))
    dist.all_reduce(y)
    close(y, torch.full((2,), float(size())))


def test_ddp_with_a_sparse_embedding_equals_one_process():
    """DDP sums sparse gradients (an nn.Embedding(sparse=True)) through the sparse all_reduce."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Flatten(),
                                torch.nn.Linear(12, 1))
    single = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    opt1 = torch.optim.SGD(single.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randint(0, 20, (2 * size(), 3), generator=g)
        y = torch.randn(2 * size(), 1, generator=g)
        step_alongside(ddp, opt, single, opt1, x, y)
    for a, b in zip(ddp.module.parameters(), single.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_calls_raise_at_the_call():
    x = torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="ReduceOp.BAND"):
        dist.all_reduce(x, op=dist.ReduceOp.BAND)
    with pytest.raises(ValueError, match="not supported"):
        dist.all_reduce(torch.ones(2, dtype=torch.float8_e4m3fn))
    # (complex sums reach the group as float pairs: torch.distributed views them as real)
    z = torch.full((2,), 1 + 2j, dtype=torch.complex64)
    dist.all_reduce(z)
    assert torch.equal(z, torch.full((2,), size() * (1 + 2j), dtype=torch.complex64))
    with pytest.raises(ValueError, match="tag -1 is outside"):
        dist.isend(torch.ones(1), dst=(rank() + 1) % size(), tag=-1)
    with pytest.raises(ValueError, match="itself"):
        dist.isend(torch.ones(1), dst=rank())
    with pytest.raises(ValueError, match="reduce-scatters with SUM"):
        dist.reduce_scatter_tensor(torch.zeros(1), torch.zeros(size()), op=dist.ReduceOp.MAX)
    with pytest.raises(TypeError, match="ferrovod.torch.backend.Options"):
        backend._create(type("O", (), {"global_ranks_in_group": [], "group_size": size(),
                                       "group_rank": rank()})(), object())
    # the group still works
    y = torch.ones(2)
    dist.all_reduce(y)
    close(y, torch.full((2,), float(size())))


def test_a_disagreement_raises_on_every_rank():
    # rank 0 asks for MAX, the others for SUM: one name, two reductions
    x = torch.ones(4)
    op = dist.ReduceOp.MAX if rank() == 0 else dist.ReduceOp.SUM
    with pytest.raises(dist.DistBackendError, match="(?i)mismatch"):
        dist.all_reduce(x, op=op)
    work = dist.broadcast(torch.ones(2), src=rank() % 2, async_op=True)
    with pytest.raises(dist.DistBackendError):
        work.wait()
    assert work.is_completed() and not work.is_success()
    # a Future asked for after the failure carries it too
    assert isinstance(work.exception(), dist.DistBackendError)
    with pytest.raises(dist.DistBackendError):
        work.get_future().wait()
    y = torch.ones(2)
    dist.all_reduce(y)
    close(y, torch.full((2,), float(size())))


def test_takeover_gives_gloo_code_ferrovods_backend(capfd):
    dist.destroy_process_group()
    assert backend._as_ferrovod("gloo") == "ferrovod"
    assert backend._as_ferrovod("cpu:gloo,cuda:nccl") == "ferrovod"
    assert backend._as_ferrovod(None) == "ferrovod"
    assert backend._as_ferrovod("ucc") == "ucc"
    hvd.takeover()
    dist.init_process_group("gloo")
    assert dist.get_backend() == "ferrovod"
    x = torch.ones(3)
    dist.all_reduce(x)
    close(x, torch.full((3,), float(size())))
    said = capfd.readouterr().out
    assert ("runs on ferrovod" in said) == (rank() == 0)
