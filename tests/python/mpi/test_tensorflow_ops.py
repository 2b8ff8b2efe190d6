"""TensorFlow ops of ferrovod.tensorflow under `mpirun -np 2` (and 4): every op × dtype in
eager mode, inside tf.function and in graph mode (tf.compat.v1), gradients, and the error types,
checked against values each rank computes itself."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import ferrovod.tensorflow as hvd  # noqa: E402

MODES = ["eager", "function", "graph"]
REDUCE_DTYPES = [tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64]
GATHER_DTYPES = REDUCE_DTYPES + [tf.uint16, tf.int16, tf.bool]


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.barrier()


def run(mode, fn, *args):
    """Runs `fn(*args)` (args: numpy arrays) eagerly, in a tf.function, or in a v1 Session."""
    if mode == "eager":
        out = fn(*[tf.constant(a) for a in args])
        return tf.nest.map_structure(lambda t: t.numpy(), out)
    if mode == "function":
        out = tf.function(fn)(*[tf.constant(a) for a in args])
        return tf.nest.map_structure(lambda t: t.numpy(), out)
    graph = tf.Graph()
    with graph.as_default():
        out = fn(*[tf.constant(a) for a in args])
        with tf.compat.v1.Session(graph=graph) as sess:
            return sess.run(out)


def np_dtype(dtype):
    return dtype.as_numpy_dtype


def values(dtype, shape, r, offset=0):
    """Small integers (exact in every dtype); 0/1 for bool."""
    n = int(np.prod(shape))
    v = (np.arange(n) * 7 + r * 3 + offset) % 11 + 1
    if dtype == tf.bool:
        v = v % 2
    return v.reshape(shape).astype(np_dtype(dtype))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: d.name)
def test_allreduce(mode, dtype):
    r, n = hvd.rank(), hvd.size()
    x = values(dtype, (3, 4), r)
    want = sum(values(tf.float64, (3, 4), k) for k in range(n))
    name = "ar.%s.%s" % (mode, dtype.name)
    got = run(mode, lambda t: hvd._allreduce(t, op=hvd.Sum, name=name), x)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2)
    got = run(mode, lambda t: hvd._allreduce(t, op=hvd.Max, name=name + ".max"), x)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.max([values(tf.float64, (3, 4), k) for k in range(n)], 0))


@pytest.mark.parametrize("mode", MODES)
def test_average_and_scaling(mode):
    r, n = hvd.rank(), hvd.size()
    x = values(tf.float32, (5,), r)
    want = sum(values(tf.float64, (5,), k) for k in range(n))
    got = run(mode, lambda t: hvd._allreduce(t, op=hvd.Average, name="avg." + mode), x)
    np.testing.assert_allclose(got, want / n, rtol=1e-6)
    got = run(mode, lambda t: hvd._allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0,
                                             name="scaled." + mode), x)
    np.testing.assert_allclose(got, 2 * want, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce(mode):
    r, n = hvd.rank(), hvd.size()
    xs = [values(tf.float32, (k + 1,), r, k) for k in range(4)]
    got = run(mode, lambda *ts: hvd._grouped_allreduce(list(ts), op=hvd.Sum, name="gar." + mode), *xs)
    for k, g in enumerate(got):
        np.testing.assert_allclose(g, sum(values(tf.float64, (k + 1,), q, k) for q in range(n)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GATHER_DTYPES, ids=lambda d: d.name)
def test_allgather_uneven(mode, dtype):
    r, n = hvd.rank(), hvd.size()
    x = values(dtype, (r + 1, 2), r)
    got = run(mode, lambda t: hvd.allgather(t, name="ag.%s.%s" % (mode, dtype.name)), x)
    want = np.concatenate([values(dtype, (k + 1, 2), k) for k in range(n)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allgather(mode):
    r, n = hvd.rank(), hvd.size()
    xs = [values(tf.int32, (r + 1, k + 1), r, k) for k in range(3)]
    got = run(mode, lambda *ts: hvd.grouped_allgather(list(ts), name="gag." + mode), *xs)
    for k, g in enumerate(got):
        np.testing.assert_array_equal(g, np.concatenate([values(tf.int32, (q + 1, k + 1), q, k) for q in range(n)]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GATHER_DTYPES, ids=lambda d: d.name)
def test_broadcast(mode, dtype):
    r, n = hvd.rank(), hvd.size()
    root = n - 1
    got = run(mode, lambda t: hvd.broadcast(t, root_rank=root, name="bc.%s.%s" % (mode, dtype.name)),
              values(dtype, (2, 3), r))
    np.testing.assert_array_equal(got, values(dtype, (2, 3), root))


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_with_and_without_splits(mode):
    r, n = hvd.rank(), hvd.size()
    splits = np.array([(r + q) % 3 for q in range(n)], np.int32)
    rows = [np.full((splits[q], 2), 100 * r + q, np.float32) for q in range(n)]
    x = np.concatenate(rows)
    out, recv = run(mode, lambda t, s: hvd.alltoall(t, splits=s, name="a2a." + mode), x, splits)
    want_splits = [(q + r) % 3 for q in range(n)]
    np.testing.assert_array_equal(recv, want_splits)
    want = np.concatenate([np.full(((q + r) % 3, 2), 100 * q + r, np.float32) for q in range(n)])
    np.testing.assert_array_equal(out, want)
    even = np.arange(2 * n, dtype=np.int64) + 10 * r
    out = run(mode, lambda t: hvd.alltoall(t, name="a2a.even." + mode), even)  # no splits: output only
    np.testing.assert_array_equal(out, np.concatenate([np.arange(2 * r, 2 * r + 2) + 10 * q for q in range(n)]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.int32, tf.int64, tf.float16, tf.float32, tf.float64], ids=lambda d: d.name)
def test_reducescatter_uneven(mode, dtype):
    r, n = hvd.rank(), hvd.size()
    rows = 2 * n + 1
    x = values(dtype, (rows, 2), r)
    got = run(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum, name="rs.%s.%s" % (mode, dtype.name)), x)
    total = sum(values(tf.float64, (rows, 2), k) for k in range(n))
    start = sum(rows // n + (1 if q < rows % n else 0) for q in range(r))
    mine = rows // n + (1 if r < rows % n else 0)
    np.testing.assert_allclose(np.asarray(got, np.float64), total[start:start + mine])


def test_grouped_reducescatter():
    r, n = hvd.rank(), hvd.size()
    xs = [np.ones((2 * n, 3), np.float32) * (r + 1), np.ones((n, 1), np.float32)]
    got = hvd.grouped_reducescatter([tf.constant(x) for x in xs], op=hvd.Average)
    np.testing.assert_allclose(got[0].numpy(), np.full((2, 3), (n + 1) / 2))
    np.testing.assert_allclose(got[1].numpy(), np.ones((1, 1)))


def test_gradients():
    r, n = hvd.rank(), hvd.size()
    v = tf.Variable(np.full(3, r + 1, np.float32))
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(hvd._allreduce(v * v, op=hvd.Sum, name="grad.ar"))
    # d/dv sum_k(v_k^2) through an allreduce: the upstream ones are summed too (n), times 2v
    np.testing.assert_allclose(tape.gradient(y, v).numpy(), np.full(3, 2 * (r + 1) * n))
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(hvd.allgather(v * (r + 1), name="grad.ag"))
    np.testing.assert_allclose(tape.gradient(y, v).numpy(), np.full(3, r + 1))
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(hvd.broadcast(v, root_rank=0, name="grad.bc"))
    np.testing.assert_allclose(tape.gradient(y, v).numpy(), np.full(3, 1.0 if r == 0 else 0.0))
    w = tf.Variable(np.ones((2 * n, 2), np.float32))
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(hvd.reducescatter(w, op=hvd.Sum, name="grad.rs"))
    np.testing.assert_allclose(tape.gradient(y, w).numpy(), np.full((2 * n, 2), float(n)))


@pytest.mark.parametrize("mode", MODES)
def test_gather_and_grouped_gradients(mode):
    """Allgather, grouped allgather and grouped reducescatter gradients with per-rank shapes (the
    gradient collectives are named after their forward op, so ranks agree even where the rest
    of their gradient graphs differ)."""
    r, n = hvd.rank(), hvd.size()

    def grads(x, y):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            tape.watch(y)
            ag = hvd.allgather(x * (r + 1), name="gg.ag." + mode)
            gag = hvd.grouped_allgather([x, 2 * x], name="gg.gag." + mode)
            grs = hvd.grouped_reducescatter([y], op=hvd.Sum, name="gg.grs." + mode)
            loss_ag = tf.reduce_sum(ag)
            loss_gag = tf.reduce_sum(gag[0]) + tf.reduce_sum(gag[1])
            loss_grs = tf.reduce_sum(grs[0])
        return tape.gradient(loss_ag, x), tape.gradient(loss_gag, x), tape.gradient(loss_grs, y)

    x = np.ones((r + 1, 2), np.float32)  # first dimension differs per rank
    y = np.ones((2 * n, 2), np.float32)
    g_ag, g_gag, g_grs = run(mode, grads, x, y)
    # allgather: the (identical) upstream ones are averaged over ranks, this rank's rows kept,
    # times the factor r + 1 applied before the gather
    np.testing.assert_allclose(g_ag, np.full((r + 1, 2), r + 1.0))
    np.testing.assert_allclose(g_gag, np.full((r + 1, 2), 3.0))
    # reducescatter (Sum): gathered gradient of ones, times the set size
    np.testing.assert_allclose(g_grs, np.full((2 * n, 2), float(n)))


def test_inplace_broadcast_and_util():
    from horovod.tensorflow.util import _executing_eagerly

    r = hvd.rank()
    vs = [tf.Variable(np.full(2, r, np.float32)), tf.Variable(np.full(3, r + 10, np.int32))]
    out = hvd.broadcast_(vs, root_rank=0, name="inplace")
    assert len(out) == 2
    np.testing.assert_array_equal(out[0].numpy(), [0, 0])
    np.testing.assert_array_equal(vs[0].numpy(), [0, 0])
    np.testing.assert_array_equal(vs[1].numpy(), [10, 10, 10])
    assert _executing_eagerly() and hvd.util._executing_eagerly()


def test_mismatch_is_failed_precondition_on_every_rank():
    r = hvd.rank()
    with pytest.raises(tf.errors.FailedPreconditionError, match="Mismatched ALLREDUCE tensor shapes"):
        hvd._allreduce(tf.ones([r + 1]), name="mismatch.shape")
    with pytest.raises(tf.errors.FailedPreconditionError, match="Mismatched data types"):
        hvd._allreduce(tf.ones([2], dtype=tf.float32 if r == 0 else tf.float64), name="mismatch.dtype")


def test_enqueue_errors_are_invalid_argument():
    n = hvd.size()
    with pytest.raises(tf.errors.InvalidArgumentError, match="invalid root rank"):
        hvd.broadcast(tf.ones([1]), root_rank=n, name="bad.root")
    with pytest.raises(tf.errors.InvalidArgumentError, match="splits"):
        hvd.alltoall(tf.ones([n + 1]), name="bad.split")


def test_size_rank_ops_and_join():
    assert int(hvd.size_op()) == hvd.size()
    assert int(hvd.rank_op()) == hvd.rank()
    assert int(hvd.local_rank_op()) == hvd.local_rank()
    assert int(hvd.local_size_op()) == hvd.local_size()
    assert int(hvd.process_set_included_op(0)) == 1
    if hvd.rank() == 0:
        x = hvd._allreduce(tf.fill([3], 5.0), op=hvd.Sum, name="before.join")
        np.testing.assert_allclose(x.numpy(), np.full(3, 5.0))  # the others joined: zeros
    last = int(hvd.join())
    assert last == 0
