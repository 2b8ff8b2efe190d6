"""`import horovod.tensorflow as hvd` under mpirun: allreduce semantics (average, compression,
IndexedSlices), variables and objects, DistributedGradientTape against a single-process
reference."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.barrier()


def test_allreduce_defaults_to_average_and_honours_average_flag():
    r, n = hvd.rank(), hvd.size()
    x = tf.constant([float(r), 2.0 * r])
    np.testing.assert_allclose(hvd.allreduce(x).numpy(), [(n - 1) / 2, (n - 1)])
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum).numpy(), [n * (n - 1) / 2, n * (n - 1)])
    with pytest.warns(DeprecationWarning):
        np.testing.assert_allclose(hvd.allreduce(x, average=False).numpy(), [n * (n - 1) / 2, n * (n - 1)])
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(x, average=True, op=hvd.Sum)


def test_fp16_compression_keeps_dtype():
    r, n = hvd.rank(), hvd.size()
    x = tf.constant(np.arange(4, dtype=np.float32) + r)
    y = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert y.dtype == tf.float32
    np.testing.assert_allclose(y.numpy(), sum(np.arange(4) + k for k in range(n)))
    i = hvd.allreduce(tf.constant([r], tf.int32), op=hvd.Sum, compression=hvd.Compression.fp16)
    assert i.dtype == tf.int32 and int(i.numpy()[0]) == n * (n - 1) // 2


def test_compressors_run_in_the_core():
    """hvd.Compression.fp16 (and ferrovod's bf16, mixed and u8) hand f32 sums and averages to the
    core's codec: half the wire bytes, counted per codec, and no Python cast in the graph;
    f64 still takes Horovod's cast to float16 and back; grouped allreduces alike."""
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((n, 16384)).astype(np.float32)
    exact = xs.astype(np.float64).sum(axis=0)
    bound = 2.0 ** -11 * (n + 1) * np.abs(xs).astype(np.float64).sum(axis=0) + 1e-6
    for comp, key, eps in ((hvd.Compression.fp16, "wire_fp16", 2.0 ** -11),
                           (hvd.Compression.bf16, "wire_bf16", 2.0 ** -8),
                           (hvd.Compression.mixed, "wire_fp16", 2.0 ** -11)):
        before = hvd.metrics()
        y = hvd.allreduce(tf.constant(xs[r]), op=hvd.Average, compression=comp)
        g = hvd.grouped_allreduce([tf.constant(xs[r]), tf.constant(xs[r][:100])], op=hvd.Sum,
                                  compression=comp)
        after = hvd.metrics()
        assert y.dtype == tf.float32
        tol = eps / 2.0 ** -11 * bound
        assert np.all(np.abs(y.numpy() - exact / n) <= tol / n)
        assert np.all(np.abs(g[0].numpy() - exact) <= tol)
        assert not np.array_equal(y.numpy(), (exact / n).astype(np.float32))
        # mixed leaves the 400-byte tensor f32 (below FERROVOD_COMPRESSION_MIN_BYTES, 32 KiB)
        small = 0 if comp is hvd.Compression.mixed else 100 * 2
        assert after[key] - before[key] == 2 * 16384 * 2 + small, comp
    # u8: one byte per value on the wire, within the rounding of 8-bit blocks (half a step of
    # each rank's range and of the sum's)
    ranges = sum(float(xs[k].max() - xs[k].min()) for k in range(n))
    before = hvd.metrics()
    y = hvd.allreduce(tf.constant(xs[r]), op=hvd.Sum, name="u8.once", compression=hvd.Compression.u8)
    after = hvd.metrics()
    assert after["wire_u8"] - before["wire_u8"] == 16384
    assert np.all(np.abs(y.numpy() - exact) <= 2 * ranges / 510 * 1.01)
    assert np.abs(y.numpy() - exact).max() > ranges / 510 / 50  # it did travel as 8 bits
    # a graph: the core codec leaves no Cast node behind
    fn = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16))
    graph = fn.get_concrete_function(tf.TensorSpec([16384], tf.float32)).graph
    ops = {o.type for o in graph.get_operations()}
    assert "HorovodAllreduce" in ops and "Cast" not in ops
    # f64 is cast in Python, as Horovod does: the result carries float16's rounding
    before = hvd.metrics()
    d = hvd.allreduce(tf.constant(xs[r].astype(np.float64)), op=hvd.Sum,
                      compression=hvd.Compression.fp16)
    after = hvd.metrics()
    assert d.dtype == tf.float64
    assert after["wire_uncompressed"] - before["wire_uncompressed"] == 16384 * 2  # f16 tensor
    assert np.all(np.abs(d.numpy() - exact) <= bound)


def test_indexed_slices_are_gathered():
    r, n = hvd.rank(), hvd.size()
    s = tf.IndexedSlices(values=tf.fill([1, 2], float(r + 1)), indices=tf.constant([r]), dense_shape=tf.constant([n, 2]))
    out = hvd.allreduce(s, op=hvd.Average)
    assert isinstance(out, tf.IndexedSlices)
    dense = tf.convert_to_tensor(out).numpy()
    np.testing.assert_allclose(dense, np.array([[k + 1, k + 1] for k in range(n)], np.float32) / n)
    with pytest.raises(NotImplementedError):
        hvd.allreduce(s, op=hvd.Max)


def test_grouped_allreduce():
    r, n = hvd.rank(), hvd.size()
    outs = hvd.grouped_allreduce([tf.constant([float(r)]), tf.constant([1.0, 2.0])], op=hvd.Sum)
    np.testing.assert_allclose(outs[0].numpy(), [n * (n - 1) / 2])
    np.testing.assert_allclose(outs[1].numpy(), [n, 2 * n])


def test_broadcast_variables_and_objects():
    r = hvd.rank()
    vs = [tf.Variable(np.full(3, r, np.float32), name="bv0"), tf.Variable(np.int64(r * 10), name="bv1")]
    hvd.broadcast_variables(vs, root_rank=0)
    np.testing.assert_array_equal(vs[0].numpy(), np.zeros(3))
    assert int(vs[1].numpy()) == 0
    obj = {"rank": r, "payload": list(range(r + 3))} if r == 1 else None
    got = hvd.broadcast_object(obj, root_rank=1, name="obj")
    assert got == {"rank": 1, "payload": [0, 1, 2, 3]}
    everyone = hvd.allgather_object({"r": r, "pad": "x" * r}, name="objs")
    assert everyone == [{"r": k, "pad": "x" * k} for k in range(hvd.size())]


def test_broadcast_object_fn_eager_and_graph():
    r = hvd.rank()
    assert hvd.broadcast_object_fn(root_rank=1, name="objfn")(("from", r)) == ("from", 1)
    graph = tf.Graph()
    with graph.as_default():
        bcast = hvd.broadcast_object_fn(root_rank=0, name="objfn_graph")
        with tf.compat.v1.Session(graph=graph):
            # the same ops serve several objects of different sizes
            assert bcast({"r": r}) == {"r": 0}
            assert bcast(list(range(5 + r))) == list(range(5))


def test_distributed_gradient_tape_matches_single_process_on_concatenated_batches():
    r, n = hvd.rank(), hvd.size()
    rng = np.random.RandomState(0)
    w0 = rng.randn(3, 1).astype(np.float32)
    xs = rng.randn(4 * n, 3).astype(np.float32)
    ys = rng.randn(4 * n, 1).astype(np.float32)

    def loss(w, x, y):
        return tf.reduce_mean((tf.matmul(x, w) - y) ** 2)

    w = tf.Variable(w0)
    with tf.GradientTape() as tape:
        l = loss(w, xs[4 * r:4 * r + 4], ys[4 * r:4 * r + 4])
    tape = hvd.DistributedGradientTape(tape)
    (g,) = tape.gradient(l, [w])
    ref = tf.Variable(w0)
    with tf.GradientTape() as t2:
        l2 = loss(ref, xs, ys)
    (g_ref,) = t2.gradient(l2, [ref])
    np.testing.assert_allclose(g.numpy(), g_ref.numpy(), rtol=1e-5, atol=1e-6)


def test_gradient_tape_groups_and_predivide():
    r, n = hvd.rank(), hvd.size()
    a = tf.Variable([1.0, 2.0], name="ga")
    b = tf.Variable([3.0], name="gb")
    with tf.GradientTape() as tape:
        l = tf.reduce_sum(a * (r + 1)) + tf.reduce_sum(b * (r + 1))
    tape = hvd.DistributedGradientTape(tape, groups=1, gradient_predivide_factor=2.0)
    ga, gb = tape.gradient(l, [a, b])
    mean = sum(k + 1 for k in range(n)) / n
    np.testing.assert_allclose(ga.numpy(), [mean, mean], rtol=1e-6)
    np.testing.assert_allclose(gb.numpy(), [mean], rtol=1e-6)


def test_tf1_graph_training_with_distributed_optimizer_and_hook():
    """tf.compat.v1 graph training: the wrapped optimizer averages gradients; the hook and
    broadcast_global_variables give every rank rank 0's initial values."""
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant([float(r + 1), 0.0]))
        x = tf.constant([[1.0, float(r)]])
        loss = tf.reduce_sum(tf.matmul(x, tf.reshape(w, [2, 1])))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
        train = opt.minimize(loss)
        hook = hvd.BroadcastGlobalVariablesHook(0)
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
            start = sess.run(w)
            sess.run(train)
            after = sess.run(w)
    np.testing.assert_allclose(start, [1.0, 0.0])  # rank 0's initial value everywhere
    # d loss / d w = x; averaged over ranks: [1, mean(r)]
    np.testing.assert_allclose(after, [1.0 - 0.5, -0.5 * (n - 1) / 2], rtol=1e-6)
    with pytest.raises(RuntimeError, match="eager"):
        hvd.broadcast_global_variables(0)


def test_an_allreduce_with_its_own_topk_ratio():
    """`hvd.Compression.topk(ratio)`: the operation's own share of the values, each rank's
    largest (ties to the lower index) summed, against NumPy."""
    r, n = hvd.rank(), hvd.size()
    xs = [np.random.RandomState(40 + k).standard_normal(40).astype(np.float32) for k in range(n)]
    before = hvd.metrics()["wire_topk"]
    y = hvd.allreduce(tf.constant(xs[r]), op=hvd.Sum, name="tf.topk.own",
                      compression=hvd.Compression.topk(0.25))
    want = np.zeros(40)
    for x in xs:
        sent = sorted(range(40), key=lambda i: (-abs(x[i]), i))[:10]
        want[sent] += x[sent]
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-6)
    assert hvd.metrics()["wire_topk"] - before == 10 * 8
