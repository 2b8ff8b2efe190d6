"""ferrovod.mxnet (and the horovod.mxnet drop-in) under mpirun: the collectives pushed onto
MXNet's engine, checked against references every rank computes itself, for every dtype and
reduction; in place and out of place; ordered by the engine after the ops that write their
inputs and before those that read their outputs; and the errors, raised as MXNetError where the
result is waited for, on every rank."""

import time

import mxnet as mx
import numpy as np
import pytest

import horovod.mxnet as hvd

DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8", "int8"]


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvd.init()
    yield
    mx.nd.waitall()


def rank_values(dtype, r, shape):
    """Rank r's tensor: small integers, exact in every dtype whatever the reduction order."""
    n = int(np.prod(shape))
    vals = (np.arange(n) * 7 + r * 3) % 5 + (1 if dtype in ("uint8",) else 0)
    return vals.reshape(shape).astype(dtype)


def reference(dtype, op, shape):
    n = hvd.size()
    stack = np.stack([rank_values(dtype, r, shape).astype(np.float64) for r in range(n)])
    if op == hvd.Sum:
        out = stack.sum(0)
    elif op == hvd.Average:
        out = stack.mean(0)
    elif op == hvd.Min:
        out = stack.min(0)
    elif op == hvd.Max:
        out = stack.max(0)
    else:
        out = stack.prod(0)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(17,), (3, 4, 5), (1,)])
def test_allreduce_every_op(dtype, shape):
    r = hvd.rank()
    x = mx.nd.array(rank_values(dtype, r, shape), dtype=dtype)
    before = x.asnumpy().copy()
    for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Product) + ((hvd.Average,) if "float" in dtype else ()):
        name = "every.%s.%s.%d" % (dtype, "x".join(map(str, shape)), op)
        got = hvd.allreduce(x, op=op, name=name)
        assert got.dtype == np.dtype(dtype) and got.shape == x.shape
        want = reference(dtype, op, shape)
        np.testing.assert_allclose(got.asnumpy().astype(np.float64), want,
                                   rtol=1e-3 if dtype == "float16" else 1e-7,
                                   err_msg="%s %s op %d" % (dtype, shape, op))
    np.testing.assert_array_equal(x.asnumpy(), before)  # out of place: the input is kept


def test_allreduce_in_place_and_scales():
    r, n = hvd.rank(), hvd.size()
    x = mx.nd.array(rank_values("float32", r, (10,)))
    same = hvd.allreduce_(x, op=hvd.Sum, name="inplace", prescale_factor=0.5, postscale_factor=3.0)
    assert same is x
    np.testing.assert_allclose(x.asnumpy(), reference("float32", hvd.Sum, (10,)) * 1.5, rtol=1e-6)
    # the deprecated `average` flag, and the default Average
    y = mx.nd.array(rank_values("float32", r, (10,)))
    np.testing.assert_allclose(hvd.allreduce(y, average=False, name="avgflag").asnumpy(),
                               reference("float32", hvd.Sum, (10,)), rtol=1e-6)
    np.testing.assert_allclose(hvd.allreduce(y, name="default").asnumpy(),
                               reference("float32", hvd.Sum, (10,)) / n, rtol=1e-6)


def test_unnamed_ops_agree_by_call_order():
    r = hvd.rank()
    outs = [hvd.allreduce(mx.nd.ones((4,)) * (r + k), op=hvd.Sum) for k in range(5)]
    n = hvd.size()
    for k, o in enumerate(outs):
        np.testing.assert_allclose(o.asnumpy(), np.full(4, sum(q + k for q in range(n))))


class _Slow(mx.operator.CustomOp):
    """Copies its input after a pause, on the engine: a producer still running when the
    collective that reads its output is pushed."""

    def forward(self, is_train, req, in_data, out_data, aux):
        time.sleep(0.3)
        self.assign(out_data[0], req[0], in_data[0])

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        self.assign(in_grad[0], req[0], out_grad[0])


@mx.operator.register("ferrovod_test_slow")
class _SlowProp(mx.operator.CustomOpProp):
    def list_arguments(self):
        return ["data"]

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def create_operator(self, ctx, shapes, dtypes):
        return _Slow()


def test_engine_orders_the_collective_between_its_producer_and_consumer():
    """The input comes from an engine op still running (0.3 s) and the output feeds another:
    no waiting in Python, the call returns before the producer is done, and the values are
    right (the collective read the produced values, the consumer the reduced ones)."""
    r, n = hvd.rank(), hvd.size()
    produced = mx.nd.Custom(mx.nd.ones((1000, 10)) * (r + 1), op_type="ferrovod_test_slow")
    start = time.monotonic()
    reduced = hvd.allreduce(produced, op=hvd.Sum, name="ordered")
    consumed = reduced * 2 + 1
    assert time.monotonic() - start < 0.2, "the push waited for the producer"
    want = 2 * sum(q + 1 for q in range(n)) + 1
    np.testing.assert_allclose(consumed.asnumpy(), np.full((1000, 10), want), rtol=1e-6)
    # in place, chained twice: each waits for the one before
    z = mx.nd.ones((8,)) * (r + 1)
    hvd.allreduce_(z, op=hvd.Sum, name="chain.1")
    hvd.allreduce_(z, op=hvd.Sum, name="chain.2")
    np.testing.assert_allclose(z.asnumpy(), np.full(8, n * sum(q + 1 for q in range(n))))


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8"])
def test_broadcast_from_every_root(dtype):
    r, n = hvd.rank(), hvd.size()
    for root in range(n):
        x = mx.nd.array(rank_values(dtype, r, (2, 7)), dtype=dtype)
        got = hvd.broadcast(x, root, name="bcast.%s.%d" % (dtype, root))
        np.testing.assert_array_equal(got.asnumpy(), rank_values(dtype, root, (2, 7)))
        np.testing.assert_array_equal(x.asnumpy(), rank_values(dtype, r, (2, 7)))
        y = mx.nd.array(rank_values(dtype, r, (5,)), dtype=dtype)
        assert hvd.broadcast_(y, root, name="bcast_.%s.%d" % (dtype, root)) is y
        np.testing.assert_array_equal(y.asnumpy(), rank_values(dtype, root, (5,)))


def test_mismatches_fail_on_every_rank_where_waited_for():
    r, n = hvd.rank(), hvd.size()
    last = r == n - 1
    cases = [
        (mx.nd.ones((3 + int(last),)), "Mismatched ALLREDUCE tensor shapes"),
        (mx.nd.ones((3,), dtype="float64" if last else "float32"), "Mismatched data types"),
    ]
    for k, (x, what) in enumerate(cases):
        out = hvd.allreduce(x, name="mismatch.%d" % k)
        with pytest.raises(mx.base.MXNetError, match=what):
            out.asnumpy()
    # a broadcast root outside the set fails at once, on every rank
    with pytest.raises(mx.base.MXNetError, match="root rank"):
        hvd.broadcast(mx.nd.ones((2,)), n, name="badroot").asnumpy()
    # after the errors the engine and ferrovod go on
    np.testing.assert_allclose(hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum, name="after").asnumpy(),
                               np.full(2, n))


def test_bad_arguments():
    with pytest.raises(TypeError):
        hvd.allreduce(np.ones(3), name="numpy")
    with pytest.raises(NotImplementedError):
        hvd.allreduce(mx.nd.ones((2,)), op=hvd.Adasum, name="adasum")


def test_a_set_never_registered_is_refused():
    never = hvd.ProcessSet([0])
    for op in (lambda: hvd.allreduce(mx.nd.ones(2), name="never.ar", process_set=never),
               lambda: hvd.allgather(mx.nd.ones(2), name="never.ag", process_set=never),
               lambda: hvd.broadcast(mx.nd.ones(2), 0, name="never.bc", process_set=never),
               lambda: hvd.barrier(process_set=never)):
        with pytest.raises(ValueError, match="has not been registered"):
            op()


def test_process_sets_side_by_side():
    """Two process sets alive and used at once (even and odd ranks), plus the global set: each
    rank's results come from its own set's members only."""
    r, n = hvd.rank(), hvd.size()
    evens = hvd.add_process_set(list(range(0, n, 2)))
    odds = hvd.add_process_set(list(range(1, n, 2)))
    try:
        mine = evens if r % 2 == 0 else odds
        x = mx.nd.ones((6,)) * (r + 1)
        in_set = hvd.allreduce(x, op=hvd.Sum, name="set.sum", process_set=mine)
        everyone = hvd.allreduce(x, op=hvd.Sum, name="all.sum")
        root = mine.ranks[-1]
        from_root = hvd.broadcast(x, root, name="set.bcast", process_set=mine)
        np.testing.assert_allclose(in_set.asnumpy(), np.full(6, sum(q + 1 for q in mine.ranks)))
        np.testing.assert_allclose(everyone.asnumpy(), np.full(6, sum(q + 1 for q in range(n))))
        np.testing.assert_allclose(from_root.asnumpy(), np.full(6, root + 1))
    finally:
        mx.nd.waitall()
        hvd.remove_process_set(odds)
        hvd.remove_process_set(evens)


@pytest.mark.parametrize("inplace", [False, True])
def test_grouped_allreduce(inplace):
    r, n = hvd.rank(), hvd.size()
    xs = [mx.nd.ones((k + 2,), dtype=d) * (r + k) for k, d in enumerate(["float32", "float64", "int32"])]
    fn = hvd.grouped_allreduce_ if inplace else hvd.grouped_allreduce
    outs = fn(xs, op=hvd.Sum, name="grouped.%s" % inplace)
    if inplace:
        assert all(o is x for o, x in zip(outs, xs))
    for k, o in enumerate(outs):
        assert o.dtype == xs[k].dtype
        np.testing.assert_allclose(o.asnumpy(), np.full(k + 2, sum(q + k for q in range(n))))
    assert hvd.grouped_allreduce([], name="empty") == []


@pytest.mark.parametrize("case", ["same array", "overlapping views", "array and its view",
                                  "group comm"])
def test_grouped_in_place_refuses_overlapping_outputs(case):
    """Outputs of one in-place grouped operation that overlap (the same NDArray twice, or
    overlapping views of one) raise MXNetError at the call on every rank, before anything is
    pushed: nothing waits forever on the engine variable they share, and the job goes on."""
    r, n = hvd.rank(), hvd.size()
    x = mx.nd.arange(8) * (r + 1)
    fn = hvd.grouped_allreduce_
    tensors = {"same array": [x, x], "overlapping views": [x[0:4], x[2:6]],
               "array and its view": [x, x[4:8]], "group comm": [x[0:4], x[3:8]]}[case]
    if case == "group comm":
        fn = hvd.GroupComm.grid(1)[0].grouped_allreduce_  # this rank's own process set
    try:
        with pytest.raises(mx.base.MXNetError, match="overlap in memory that it writes.*the "
                           "outputs of one operation must not overlap"):
            fn(tensors, op=hvd.Sum, name="overlap.%s" % case)
    finally:
        hvd.GroupComm.free_all()
    np.testing.assert_array_equal(x.asnumpy(), np.arange(8) * (r + 1))
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum, name="overlap.after.%s" % case)
                                  .asnumpy(), np.arange(8) * sum(q + 1 for q in range(n)))


def test_grouped_ops_over_disjoint_views_of_one_array():
    """Views of one NDArray that do not overlap share its engine variable: one grouped
    operation over them waits for the op writing the array and is waited for by the op reading
    it, in place and out of place; the allgather's inputs too."""
    r, n = hvd.rank(), hvd.size()
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    total = base * sum(q + 1 for q in range(n))
    produced = mx.nd.Custom(mx.nd.array(base * (r + 1)), op_type="ferrovod_test_slow")
    other = mx.nd.ones((2,)) * (r + 1)
    outs = hvd.grouped_allreduce_([produced[0], other, produced[1:3]], op=hvd.Sum,
                                  name="views.inplace")
    consumed = produced * 2
    assert [o.shape for o in outs] == [(4,), (2,), (2, 4)]
    np.testing.assert_allclose(consumed.asnumpy(), total * 2)
    np.testing.assert_allclose(other.asnumpy(), np.full(2, sum(q + 1 for q in range(n))))
    x = mx.nd.array(base * (r + 1))
    a, b = hvd.grouped_allreduce([x[0], x[1:3]], op=hvd.Sum, name="views.outofplace")
    np.testing.assert_allclose(a.asnumpy(), total[0])
    np.testing.assert_allclose(b.asnumpy(), total[1:3])
    np.testing.assert_array_equal(x.asnumpy(), base * (r + 1))
    g, h = hvd.grouped_allgather([x[0:1], x[1:3]], name="views.gather")
    np.testing.assert_array_equal(g.asnumpy(), np.stack([base[0] * (q + 1) for q in range(n)]))
    np.testing.assert_array_equal(h.asnumpy(), np.concatenate([base[1:3] * (q + 1) for q in range(n)]))


def test_a_failure_is_raised_whatever_the_engine():
    """A mismatch raises MXNetError on every rank under any engine: where the result is waited
    for, or at the call under NaiveEngine, which runs each operation inside its push and drops
    the error given to the engine's completion callback."""
    r, n = hvd.rank(), hvd.size()
    x = mx.nd.ones((3 + int(r == n - 1),))
    with pytest.raises(mx.base.MXNetError, match="Mismatched ALLREDUCE tensor shapes"):
        hvd.allreduce(x, name="any_engine.mismatch").asnumpy()
    np.testing.assert_allclose(hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum,
                                             name="any_engine.after").asnumpy(), np.full(2, n))


# Interposes MXEnginePushAsyncND to fail the push of "*push.fails*" as MXNet fails one: after
# it took the parameter and its deleter (a negative variable count is refused only then).
_FAILING_PUSH = r"""
#include <dlfcn.h>
#include <cstdlib>
#include <cstring>
using Push = int (*)(void*, void*, void (*)(void*), const void*, void*, int, void*, int,
                     const void*, int, const char*, bool);
using PushND = int (*)(void*, void*, void (*)(void*), const void*, void**, int, void**, int,
                       const void*, int, const char*, bool);
static void* Mxnet(const char* symbol) {
  static void* lib = dlopen(std::getenv("TEST_LIBMXNET"), RTLD_NOW | RTLD_NOLOAD);
  return dlsym(lib, symbol);
}
extern "C" int MXEnginePushAsyncND(void* f, void* param, void (*deleter)(void*), const void* ctx,
                                   void** reads, int nreads, void** writes, int nwrites,
                                   const void* prop, int priority, const char* name, bool wait) {
  if (name != nullptr && std::strstr(name, "push.fails") != nullptr) {
    return reinterpret_cast<Push>(Mxnet("MXEnginePushAsync"))(
        f, param, deleter, ctx, nullptr, -1, nullptr, 0, prop, priority, name, wait);
  }
  return reinterpret_cast<PushND>(Mxnet("MXEnginePushAsyncND"))(
      f, param, deleter, ctx, reads, nreads, writes, nwrites, prop, priority, name, wait);
}
"""

_FAILING_PUSH_SCRIPT = """
import gc
import mxnet as mx
import horovod.mxnet as hvd
x = mx.nd.ones((4,))
try:
    hvd.allreduce_(x, name="push.fails")
except mx.base.MXNetError as e:
    print("raised:", str(e).splitlines()[0])
gc.collect()
print("x:", (x + 1).asnumpy().tolist())
"""


def test_a_failed_push_frees_its_operation_once(tmp_path):
    """When MXNet refuses the push it has already freed the operation (its deleter runs): the
    call raises MXNetError and the process goes on, rather than freeing it a second time. In a
    process of its own, without MPI (the push fails before ferrovod is reached), with MXNet's
    push interposed to fail."""
    import os
    import subprocess
    import sys

    shim = tmp_path / "failing_push.so"
    (tmp_path / "failing_push.cc").write_text(_FAILING_PUSH)
    subprocess.run([os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O1",
                    str(tmp_path / "failing_push.cc"), "-o", str(shim), "-ldl"], check=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "OPAL_", "HYDRA_"))}
    env["LD_PRELOAD"] = str(shim)
    env["TEST_LIBMXNET"] = os.path.join(os.path.dirname(mx.__file__), "libmxnet.so")
    run = subprocess.run([sys.executable, "-c", _FAILING_PUSH_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "raised: MXEnginePushAsyncND failed: MXNetError: Check failed: num_const_vars" \
        in run.stdout, run.stdout + run.stderr
    assert "x: [2.0, 2.0, 2.0, 2.0]" in run.stdout, run.stdout + run.stderr
    # this job goes on too
    np.testing.assert_allclose(hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum,
                                             name="failed_push.after").asnumpy(),
                               np.full(2, hvd.size()))


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8"])
def test_allgather_uneven_first_dimensions(dtype):
    r, n = hvd.rank(), hvd.size()
    x = mx.nd.array(np.full((r + 1, 3), r, np.float64), dtype=dtype)
    got = hvd.allgather(x, name="gather.%s" % dtype)
    want = np.concatenate([np.full((q + 1, 3), q) for q in range(n)]).astype(dtype)
    assert got.shape == want.shape and got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.asnumpy(), want)


def test_allgather_mismatches_fail_at_the_call_everywhere():
    r, n = hvd.rank(), hvd.size()
    last = r == n - 1
    with pytest.raises(mx.base.MXNetError, match="Mismatched ALLGATHER tensor shapes"):
        hvd.allgather(mx.nd.ones((2, 3 + int(last))), name="gather.bad")
    with pytest.raises(mx.base.MXNetError, match="Mismatched ALLGATHER tensor shapes"):
        hvd.allgather(mx.nd.ones((2, 3, 1) if last else (2, 3)), name="gather.rank")
    with pytest.raises(mx.base.MXNetError, match="Mismatched ALLGATHER data types"):
        hvd.allgather(mx.nd.ones((2,), dtype="int32" if last else "float32"), name="gather.type")
    # the job goes on
    np.testing.assert_array_equal(hvd.allgather(mx.nd.ones((1, 2)) * r, name="gather.ok").asnumpy(),
                                  np.repeat(np.arange(n), 2).reshape(n, 2))


@pytest.mark.parametrize("rows", [8, 7, 1])
def test_reducescatter_rows(rows):
    r, n = hvd.rank(), hvd.size()
    x = mx.nd.array(np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) * (r + 1))
    if rows < n:
        with pytest.raises(ValueError, match="cannot be empty"):
            hvd.reducescatter(x, op=hvd.Sum, name="rs.%d" % rows)
        return
    got = hvd.reducescatter(x, op=hvd.Sum, name="rs.%d" % rows)
    total = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) * sum(q + 1 for q in range(n))
    counts = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
    start = sum(counts[:r])
    np.testing.assert_allclose(got.asnumpy(), total[start:start + counts[r]])


def test_barrier_broadcast_parameters_and_objects():
    r = hvd.rank()
    hvd.barrier()
    params = {"w": mx.nd.ones((2, 2)) * r, "b": mx.nd.arange(3) + r}
    hvd.broadcast_parameters(params, root_rank=0)
    np.testing.assert_array_equal(params["w"].asnumpy(), np.zeros((2, 2)))
    np.testing.assert_array_equal(params["b"].asnumpy(), np.arange(3))
    # a Gluon block's parameters, initialised differently on each rank
    net = mx.gluon.nn.Dense(3, in_units=4)
    net.initialize(mx.init.Constant(r + 1))
    hvd.broadcast_parameters(net.collect_params(), root_rank=hvd.size() - 1)
    np.testing.assert_array_equal(net.weight.data().asnumpy(), np.full((3, 4), hvd.size()))
    # deferred initialisation: broadcast once the first forward pass sets the shapes
    mx.random.seed(r)
    conv = mx.gluon.nn.Conv2D(4, 2)
    conv.initialize()
    hvd.broadcast_parameters(conv.collect_params(), root_rank=0, prefix="deferred.")
    conv(mx.nd.ones((1, 3, 5, 5)))
    w = conv.weight.data()
    np.testing.assert_array_equal(w.asnumpy(), hvd.broadcast(w, 0, name="deferred.check").asnumpy())
    obj = {"rank": r, "list": [1, 2, r]}
    got = hvd.broadcast_object(obj, root_rank=hvd.size() - 1)
    assert got == {"rank": hvd.size() - 1, "list": [1, 2, hvd.size() - 1]}


def test_distributed_optimizer_averages_before_updating():
    r, n = hvd.rank(), hvd.size()
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5), gradient_predivide_factor=2.0)
    w = mx.nd.ones((4,))
    grad = mx.nd.ones((4,)) * (r + 1)
    opt.update(0, w, grad, opt.create_state(0, w))
    mean = sum(q + 1 for q in range(n)) / n
    np.testing.assert_allclose(w.asnumpy(), np.full(4, 1 - 0.5 * mean), rtol=1e-6)
    # several indices at once, in two groups
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0), num_groups=2)
    ws = [mx.nd.zeros((k + 1,)) for k in range(3)]
    gs = [mx.nd.ones((k + 1,)) * (r + k) for k in range(3)]
    opt.update([10, 11, 12], ws, gs, [None] * 3)
    for k, wk in enumerate(ws):
        np.testing.assert_allclose(wk.asnumpy(), np.full(k + 1, -sum(q + k for q in range(n)) / n),
                                   rtol=1e-6)


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_distributed_trainer_matches_one_process_on_the_whole_batch(compression):
    """Each rank trains on its slice of the batch; the weights equal one process training on
    the whole batch (gradients averaged over ranks, Trainer's 1/batch_size per rank)."""
    r, n = hvd.rank(), hvd.size()
    rng = np.random.RandomState(3)
    x, y = rng.randn(4 * n, 5).astype(np.float32), rng.randn(4 * n, 1).astype(np.float32)

    def model():
        net = mx.gluon.nn.Dense(1, in_units=5)
        net.initialize(mx.init.Constant(0.1))
        return net

    def train(net, trainer, xs, ys, steps=3):
        loss = mx.gluon.loss.L2Loss()
        for _ in range(steps):
            with mx.autograd.record():
                out = loss(net(mx.nd.array(xs)), mx.nd.array(ys))
            out.backward()
            trainer.step(len(xs))
        mx.nd.waitall()

    dist = model()
    before = hvd.metrics()["wire_fp16"]
    trainer = hvd.DistributedTrainer(dist.collect_params(), "sgd", {"learning_rate": 0.1},
                                     compression=getattr(hvd.Compression, compression),
                                     prefix="t.%s." % compression)
    train(dist, trainer, x[4 * r:4 * r + 4], y[4 * r:4 * r + 4])
    # fp16: the core's codec carried the float32 gradients (3 steps of 6 values, 2 bytes each)
    sent = hvd.metrics()["wire_fp16"] - before
    assert sent == (3 * 6 * 2 if compression == "fp16" else 0), sent
    ref = model()
    train(ref, mx.gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=None),
          x, y)
    tol = 2e-3 if compression == "fp16" else 1e-5
    for name in ("weight", "bias"):
        np.testing.assert_allclose(getattr(dist, name).data().asnumpy(),
                                   getattr(ref, name).data().asnumpy(), rtol=tol, atol=tol)


def test_compression_classes():
    for dtype in ("float16", "float32", "float64"):
        x = mx.nd.ones((3, 2), dtype=dtype) * 1.5
        c, ctx = hvd.Compression.fp16.compress(x)
        assert c.dtype == np.float16
        back = hvd.Compression.fp16.decompress(c, ctx)
        assert back.dtype == x.dtype
        np.testing.assert_array_equal(back.asnumpy(), x.asnumpy())
    for dtype in ("int32", "uint8"):
        x = mx.nd.ones((3,), dtype=dtype)
        c, ctx = hvd.Compression.fp16.compress(x)
        assert c.dtype == x.dtype and hvd.Compression.fp16.decompress(c, ctx).dtype == x.dtype
    # the core's codecs: compress() leaves tensors alone
    c, ctx = hvd.Compression.bf16.compress(mx.nd.ones((2,)))
    assert c.dtype == np.float32 and ctx is None


def test_alltoall_with_and_without_splits():
    r, n = hvd.rank(), hvd.size()
    # equal parts: row j of every rank goes to rank j
    x = mx.nd.array(np.arange(2 * n * 3).reshape(2 * n, 3) + 100 * r)
    got = hvd.alltoall(x, name="a2a.equal")
    want = np.concatenate([(np.arange(2 * n * 3).reshape(2 * n, 3) + 100 * q)[2 * r:2 * r + 2]
                           for q in range(n)])
    np.testing.assert_array_equal(got.asnumpy(), want)
    # uneven: rank q sends q + j + 1 rows to rank j
    def sends(q):
        return [q + j + 1 for j in range(n)]

    rows = sum(sends(r))
    x = mx.nd.array(np.full((rows, 2), r, np.int64), dtype="int64")
    out, received = hvd.alltoall(x, splits=sends(r), name="a2a.uneven")
    assert received.asnumpy().tolist() == [sends(q)[r] for q in range(n)]
    want = np.concatenate([np.full((sends(q)[r], 2), q) for q in range(n)])
    np.testing.assert_array_equal(out.asnumpy(), want)


def test_alltoall_bad_arguments_fail_on_every_rank():
    r, n = hvd.rank(), hvd.size()
    x = mx.nd.ones((n, 2))
    # only the last rank's splits are wrong: every rank fails at the call
    splits = [1] * n if r != n - 1 else [2] + [1] * (n - 1)
    with pytest.raises(mx.base.MXNetError, match="alltoall"):
        hvd.alltoall(x, splits=splits, name="a2a.bad")
    if n > 1:
        with pytest.raises(mx.base.MXNetError, match="split equally"):
            hvd.alltoall(mx.nd.ones((n + 1, 2)), name="a2a.uneven_equal")
    with pytest.raises(mx.base.MXNetError, match="Mismatched ALLTOALL data types"):
        hvd.alltoall(mx.nd.ones((n,), dtype="int32" if r == n - 1 else "float32"), name="a2a.type")
    np.testing.assert_array_equal(hvd.alltoall(mx.nd.ones((n,)) * r, name="a2a.ok").asnumpy(),
                                  np.arange(n))


def test_grouped_allgather_and_reducescatter_and_objects():
    r, n = hvd.rank(), hvd.size()
    xs = [mx.nd.ones((r + 1, 2)) * r, mx.nd.ones((1, 3), dtype="int32") * (r + 5)]
    a, b = hvd.grouped_allgather(xs, name="gag")
    np.testing.assert_array_equal(a.asnumpy(), np.concatenate([np.full((q + 1, 2), q) for q in range(n)]))
    np.testing.assert_array_equal(b.asnumpy(), np.stack([np.full(3, q + 5) for q in range(n)]))
    ys = [mx.nd.ones((2 * n, 2)) * (r + 1), mx.nd.ones((n + 1,)) * 2]
    c, d = hvd.grouped_reducescatter(ys, op=hvd.Sum, name="grs")
    total = sum(q + 1 for q in range(n))
    np.testing.assert_array_equal(c.asnumpy(), np.full((2, 2), total))
    np.testing.assert_array_equal(d.asnumpy(), np.full(2 if r == 0 else 1, 2 * n))
    assert hvd.allgather_object({"r": r}) == [{"r": q} for q in range(n)]


@pytest.mark.parametrize("axis", [1, -1])
def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch(axis):
    """Rank r holds r + 1 samples (different batch sizes); SyncBatchNorm over the ranks equals
    BatchNorm over the concatenated batch in one process: outputs and input gradients (each
    rank's rows), parameter gradients (summed over ranks), moving mean and variance."""
    r, n = hvd.rank(), hvd.size()
    rng = np.random.RandomState(7)
    sizes = [q + 1 for q in range(n)]
    shape = (sum(sizes), 3, 2, 2) if axis == 1 else (sum(sizes), 2, 2, 3)
    x_all = rng.randn(*shape).astype(np.float32) * 2 + 0.5
    w_all = rng.randn(*shape).astype(np.float32)  # the loss: sum(y * w)
    start = sum(sizes[:r])
    rows = slice(start, start + sizes[r])

    def run(block, x, w):
        block.initialize()
        block.gamma.set_data(mx.nd.array([1.5, 0.5, 2.0]))
        block.beta.set_data(mx.nd.array([0.1, -0.2, 0.3]))
        x = mx.nd.array(x)
        x.attach_grad()
        with mx.autograd.record():
            y = block(x)
            loss = (y * mx.nd.array(w)).sum()
        loss.backward()
        return (y.asnumpy(), x.grad.asnumpy(), block.gamma.grad().asnumpy(),
                block.beta.grad().asnumpy(), block.running_mean.data().asnumpy(),
                block.running_var.data().asnumpy())

    sync = run(hvd.SyncBatchNorm(axis=axis, in_channels=3), x_all[rows], w_all[rows])
    ref = run(mx.gluon.nn.BatchNorm(axis=axis, in_channels=3), x_all, w_all)
    np.testing.assert_allclose(sync[0], ref[0][rows], rtol=1e-4, atol=1e-5, err_msg="output")
    np.testing.assert_allclose(sync[1], ref[1][rows], rtol=1e-4, atol=1e-5, err_msg="dx")
    for k, what in ((2, "dgamma"), (3, "dbeta")):
        summed = hvd.allreduce(mx.nd.array(sync[k]), op=hvd.Sum, name="bn.%s.%d" % (what, axis))
        np.testing.assert_allclose(summed.asnumpy(), ref[k], rtol=1e-4, atol=1e-4, err_msg=what)
    np.testing.assert_allclose(sync[4], ref[4], rtol=1e-5, atol=1e-6, err_msg="moving mean")
    np.testing.assert_allclose(sync[5], ref[5], rtol=1e-5, atol=1e-6, err_msg="moving var")
    # inference: the moving statistics, no communication
    block = hvd.SyncBatchNorm(axis=axis, in_channels=3)
    block.initialize()
    before = hvd.metrics()["tensors"]
    block(mx.nd.array(x_all[rows])).asnumpy()
    assert hvd.metrics()["tensors"] == before


@pytest.mark.parametrize("model_size", [1, 2])
def test_group_comm_grid_runs_model_and_data_groups_at_once(model_size):
    """Model-parallel groups of consecutive ranks and data-parallel groups across them, alive
    together; each rank's operations in both are pushed before any result is read."""
    r, n = hvd.rank(), hvd.size()
    if n % model_size:
        pytest.skip("model_size must divide the ranks")
    model, data = hvd.GroupComm.grid(model_size)
    try:
        assert model.ranks == list(range(r // model_size * model_size, (r // model_size + 1) * model_size))
        assert data.ranks == list(range(r % model_size, n, model_size))
        assert model.rank() == r % model_size and data.rank() == r // model_size
        x = mx.nd.ones((4,)) * (r + 1)
        in_model = model.allreduce(x, op=hvd.Sum, name="grid.model.%d" % model_size)
        in_data = data.allreduce(x, op=hvd.Sum, name="grid.data.%d" % model_size)
        gathered = model.allgather(mx.nd.ones((1, 2)) * r, name="grid.gather.%d" % model_size)
        root = data.ranks[0]
        from_root = data.broadcast(x, root, name="grid.bcast.%d" % model_size)
        np.testing.assert_allclose(in_model.asnumpy(), np.full(4, sum(q + 1 for q in model.ranks)))
        np.testing.assert_allclose(in_data.asnumpy(), np.full(4, sum(q + 1 for q in data.ranks)))
        np.testing.assert_allclose(gathered.asnumpy(), np.repeat(model.ranks, 2).reshape(-1, 2))
        np.testing.assert_allclose(from_root.asnumpy(), np.full(4, root + 1))
    finally:
        mx.nd.waitall()
        hvd.barrier()
        hvd.GroupComm.free_all()


def _partial_fc_case(comm, num_classes, dim, tag):
    """Partial FC over `comm` against one process's full softmax cross-entropy over the group's
    whole batch: each rank's losses, its features' gradient, its weight shard's gradient."""
    from ferrovod.mxnet.partial_fc import PartialFCLoss, shard

    q, m = comm.rank(), comm.size()
    rng = np.random.RandomState(11)
    sizes = [k + 2 for k in range(m)]  # different batch sizes
    feats_all = rng.randn(sum(sizes), dim).astype(np.float32)
    labels_all = rng.randint(0, num_classes, sum(sizes)).astype(np.float32)
    weight_all = (rng.randn(num_classes, dim) * 0.5).astype(np.float32)
    scale_all = rng.rand(sum(sizes)).astype(np.float32)  # the loss: sum(loss * scale)
    rows = slice(sum(sizes[:q]), sum(sizes[:q + 1]))
    c0, c1 = shard(num_classes, m, q)

    feats = mx.nd.array(feats_all[rows])
    weight = mx.nd.array(weight_all[c0:c1])
    feats.attach_grad()
    weight.attach_grad()
    with mx.autograd.record():
        loss = PartialFCLoss(comm, c0)(feats, weight, mx.nd.array(labels_all[rows]))
        total = (loss * mx.nd.array(scale_all[rows])).sum()
    total.backward()

    ref_feats, ref_weight = mx.nd.array(feats_all), mx.nd.array(weight_all)
    ref_feats.attach_grad()
    ref_weight.attach_grad()
    with mx.autograd.record():
        logits = mx.nd.dot(ref_feats, ref_weight, transpose_b=True)
        ref_loss = -mx.nd.pick(mx.nd.log_softmax(logits), mx.nd.array(labels_all))
        (ref_loss * mx.nd.array(scale_all)).sum().backward()
    np.testing.assert_allclose(loss.asnumpy(), ref_loss.asnumpy()[rows], rtol=1e-5, atol=1e-5,
                               err_msg="%s loss" % tag)
    np.testing.assert_allclose(feats.grad.asnumpy(), ref_feats.grad.asnumpy()[rows], rtol=1e-4,
                               atol=1e-5, err_msg="%s features' gradient" % tag)
    np.testing.assert_allclose(weight.grad.asnumpy(), ref_weight.grad.asnumpy()[c0:c1],
                               rtol=1e-4, atol=1e-5, err_msg="%s weight shard's gradient" % tag)


@pytest.mark.parametrize("num_classes", [11, 8])
def test_partial_fc_equals_full_fc(num_classes):
    """Classes sharded over all ranks (11 classes divide among neither 2 nor 4 ranks), and at
    np 4 over the model groups of a 2 x 2 grid, both groups at once."""
    r, n = hvd.rank(), hvd.size()
    world = hvd.GroupComm(range(n))
    _partial_fc_case(world, num_classes, 5, "world")
    if n == 4:
        model, _ = hvd.GroupComm.grid(2)
        try:
            _partial_fc_case(model, num_classes, 5, "model group %s" % model.ranks)
        finally:
            mx.nd.waitall()
            hvd.GroupComm.free_all()


def test_partial_fc_example_trains():
    """examples/mxnet_partial_fc.py: the backbone data-parallel, the classifier sharded; the
    optimizer updates the shard and the backbone every step (the backward pass must not wait
    for those updates), and the loss falls."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "mxnet_partial_fc.py")
    spec = importlib.util.spec_from_file_location("mxnet_partial_fc", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.train(classes=37, steps=40, log=lambda *_: None)
    assert losses[-1] < 0.5 * losses[0], losses


def test_sync_batch_norm_trains_like_batch_norm_on_the_whole_batch():
    """A small net with SyncBatchNorm trained 3 steps by DistributedTrainer (gamma and beta
    updated every step: the backward pass must not wait for those updates) ends with the
    weights of one process training BatchNorm on the whole batch."""
    r, n = hvd.rank(), hvd.size()
    rng = np.random.RandomState(5)
    x_all = rng.randn(4 * n, 6).astype(np.float32)
    y_all = rng.randn(4 * n, 2).astype(np.float32)

    def net(bn):
        mx.random.seed(1)
        block = mx.gluon.nn.Sequential()
        block.add(mx.gluon.nn.Dense(4, in_units=6), bn(in_channels=4), mx.gluon.nn.Dense(2, in_units=4))
        block.initialize(mx.init.Uniform(0.5))
        return block

    def fit(block, trainer, x, y, scale):
        for _ in range(3):
            with mx.autograd.record():
                loss = ((block(mx.nd.array(x)) - mx.nd.array(y)) ** 2).sum() * scale
            loss.backward()
            trainer.step(1)
        mx.nd.waitall()

    dist = net(hvd.SyncBatchNorm)
    # each rank's loss is its share of the whole batch's sum; DistributedTrainer averages over
    # the ranks, so scale by n to get the sum of the shares
    fit(dist, hvd.DistributedTrainer(dist.collect_params(), "sgd", {"learning_rate": 0.05},
                                     prefix="sbn_fit."),
        x_all[4 * r:4 * r + 4], y_all[4 * r:4 * r + 4], float(n))
    ref = net(mx.gluon.nn.BatchNorm)
    fit(ref, mx.gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.05}, kvstore=None),
        x_all, y_all, 1.0)
    # the same layers in the same order (Gluon's name counters differ between the two nets)
    for (name, p), q in zip(dist.collect_params().items(), ref.collect_params().values()):
        np.testing.assert_allclose(p.data().asnumpy(), q.data().asnumpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_gluon_digits_example_matches_one_process():
    """examples/mxnet_digits.py (Horovod's Gluon recipe on scikit-learn's digits): the ranks'
    test accuracy equals one process training on the whole set with the global batch."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "mxnet_digits.py")
    spec = importlib.util.spec_from_file_location("mxnet_digits", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    distributed = example.train(epochs=6)
    alone = example.train(epochs=6, distributed=False)
    assert distributed > 0.9, distributed
    assert abs(distributed - alone) <= 0.01, (distributed, alone)


def test_join_lets_one_rank_finish_alone():
    """Rank 0 allreduces once more while the others have joined: they contribute zeros, and
    join returns the last rank to join (rank 0) everywhere."""
    r = hvd.rank()
    if r == 0:
        x = hvd.allreduce(mx.nd.ones((3,)) * 5, op=hvd.Sum, name="joinee")
        np.testing.assert_array_equal(x.asnumpy(), np.full(3, 5.0))
    assert hvd.join() == 0


def test_gradients_with_their_own_topk_ratio():
    """The trainer's gradient averaging with `hvd.Compression.topk(ratio)`: each rank's largest
    quarter (ties to the lower index) averaged, against NumPy."""
    from ferrovod import _core
    from ferrovod.mxnet import _reduce_grads, global_process_set

    r, n = hvd.rank(), hvd.size()
    xs = [np.random.RandomState(60 + k).standard_normal(40).astype(np.float32) for k in range(n)]
    g = mx.nd.array(xs[r], dtype="float32")
    before = _core.metrics()["wire_topk"]
    _reduce_grads([g], ["mx.topk.own"], 1.0, 0, global_process_set, hvd.Compression.topk(0.25))
    g.wait_to_read()
    want = np.zeros(40)
    for x in xs:
        sent = sorted(range(40), key=lambda i: (-abs(x[i]), i))[:10]
        want[sent] += x[sent]
    np.testing.assert_allclose(g.asnumpy(), want / n, rtol=1e-5, atol=1e-6)
    assert _core.metrics()["wire_topk"] - before == 10 * 8
