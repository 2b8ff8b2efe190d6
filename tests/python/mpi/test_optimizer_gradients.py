"""The gradient methods of the DistributedOptimizers, for every optimizer family they wrap (Keras 3,
tf_keras, tf_keras legacy, tf.compat.v1): `compute_gradients`/`_compute_gradients` return the
reduced gradients (with local variables and local aggregation, eagerly and in a tf.function),
`apply_gradients` does not reduce them a second time, `get_gradients` reduces in a graph, and an
infinite or NaN gradient in one aggregation cycle does not reach the next. Every expected value is
computed here from the loss's formula, per rank, with NumPy."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvd_keras  # noqa: E402

FAMILIES = ["keras3", "tf_keras", "tf_keras_legacy"]


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.barrier()


def sgd(family, lr):
    return {"keras3": keras.optimizers.SGD, "tf_keras": tf_keras.optimizers.SGD,
            "tf_keras_legacy": tf_keras.optimizers.legacy.SGD}[family](lr)


def variable(family, value):
    value = np.asarray(value, np.float32)
    return keras.Variable(value) if family == "keras3" else tf.Variable(value)


def coefficients(r):
    """Rank r's loss is sum(c * w) + sum(d * b * b) / 2: dL/dw = c, dL/db = d * b."""
    return np.array([1.0, -2.0, 0.5], np.float32) * (r + 1), np.array([3.0, r + 1.0], np.float32)


def make_loss(w, b, r):
    c, d = (tf.constant(a) for a in coefficients(r))
    return lambda: tf.reduce_sum(w * c) + tf.reduce_sum(b * b * d) / 2


def expected(r, n, b_value, op, local_b):
    """(grad of w, grad of b) that the wrapper must return on rank r."""
    cs, ds = zip(*(coefficients(k) for k in range(n)))
    combine = np.mean if op == hvd.Average else np.sum
    gw = combine(cs, axis=0)
    gb = ds[r] * b_value / n if local_b else combine([d * b_value for d in ds], axis=0)
    return gw, gb


def assert_one_step(w, b, r, n, op, local_b, lr=0.1):
    """w and b, started at [0.5]*3 and [1, 2], moved by one SGD step of the expected gradients."""
    gw, gb = expected(r, n, np.array([1.0, 2.0]), op, local_b)
    np.testing.assert_allclose(w.numpy(), 0.5 - lr * gw, rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), [1.0, 2.0] - lr * gb, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["compute_gradients", "_compute_gradients"])
@pytest.mark.parametrize("loss_kind", ["callable", "tensor"])
def test_compute_gradients_returns_reduced_gradients_and_apply_does_not_reduce_again(
        family, method, loss_kind):
    """op=Sum makes a second reduction visible (it would multiply by n); b is a local variable:
    this rank's gradient divided by n, as Horovod's scale_local_gradients does for either op."""
    r, n = hvd.rank(), hvd.size()
    w, b = variable(family, [0.5, 0.5, 0.5]), variable(family, [1.0, 2.0])
    loss = make_loss(w, b, r)
    opt = hvd_keras.DistributedOptimizer(sgd(family, 0.1), op=hvd.Sum)
    opt.register_local_var(b)
    if loss_kind == "callable":
        pairs = getattr(opt, method)(loss, [w, b])
    else:
        with tf.GradientTape() as tape:
            value = loss()
        pairs = getattr(opt, method)(value, [w, b], tape=tape)
    gw, gb = expected(r, n, np.array([1.0, 2.0]), hvd.Sum, local_b=True)
    assert pairs[0][1] is w and pairs[1][1] is b
    np.testing.assert_allclose(pairs[0][0].numpy(), gw, rtol=1e-6)
    np.testing.assert_allclose(pairs[1][0].numpy(), gb, rtol=1e-6)
    opt.apply_gradients(pairs)
    assert_one_step(w, b, r, n, hvd.Sum, local_b=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_computed_elsewhere_are_reduced_when_applied(family):
    """A loop that computes its own gradients (tape.gradient) still trains data-parallel."""
    r, n = hvd.rank(), hvd.size()
    w, b = variable(family, [0.5, 0.5, 0.5]), variable(family, [1.0, 2.0])
    loss = make_loss(w, b, r)
    with tf.GradientTape() as tape:
        value = loss()
    grads = tape.gradient(value, [w, b])
    opt = hvd_keras.DistributedOptimizer(sgd(family, 0.1))
    opt.apply_gradients(zip(grads, [w, b]))
    assert_one_step(w, b, r, n, hvd.Average, local_b=False)


@pytest.mark.parametrize("family", ["tf_keras", "tf_keras_legacy"])
def test_minimize_reduces_once(family):
    r, n = hvd.rank(), hvd.size()
    w, b = variable(family, [0.5, 0.5, 0.5]), variable(family, [1.0, 2.0])
    opt = hvd_keras.DistributedOptimizer(sgd(family, 0.1), op=hvd.Sum)
    opt.minimize(make_loss(w, b, r), [w, b])
    assert_one_step(w, b, r, n, hvd.Sum, local_b=False)


@pytest.mark.parametrize("family", ["keras3", "tf_keras"])
def test_grad_loss_weights_the_output(family):
    r, n = hvd.rank(), hvd.size()
    x = variable(family, [1.0, 2.0])
    opt = hvd_keras.DistributedOptimizer(sgd(family, 0.1))
    with tf.GradientTape() as tape:
        y = x * float(r + 1)
    pairs = opt._compute_gradients(y, [x], grad_loss=tf.constant([2.0, -1.0]), tape=tape)
    mean = np.mean([k + 1.0 for k in range(n)])
    np.testing.assert_allclose(pairs[0][0].numpy(), [2.0 * mean, -mean], rtol=1e-6)


def test_tensor_loss_without_a_tape_is_a_value_error():
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1))
    x = keras.Variable([1.0])
    with pytest.raises(ValueError, match="tape"):
        opt.compute_gradients(tf.constant(1.0), [x])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("average", [True, False])
def test_aggregation_with_local_variables_in_a_tf_function(family, average):
    """backward_passes_per_step=3, as model.fit runs it (gradients computed and applied in one
    tf.function): the variables move only on every third pass, by the sums of three passes
    (divided by 3 when averaging), shared ones averaged over the ranks, local ones this rank's
    divided by n; `iterations` counts every pass."""
    r, n = hvd.rank(), hvd.size()
    passes, lr = 3, 0.25
    w, b = variable(family, [0.5, 0.5, 0.5]), variable(family, [1.0, 2.0])
    loss = make_loss(w, b, r)
    opt = hvd_keras.DistributedOptimizer(sgd(family, lr), backward_passes_per_step=passes,
                                         average_aggregated_gradients=average, sparse_as_dense=True)
    opt.register_local_var(b)

    @tf.function
    def step():
        opt.apply_gradients(opt._compute_gradients(loss, [w, b]))

    want_w, want_b = np.full(3, 0.5), np.array([1.0, 2.0])
    sum_w, sum_b = np.zeros(3), np.zeros(2)
    for k in range(7):
        step()
        gw, gb = expected(r, n, want_b, hvd.Average, local_b=True)
        sum_w, sum_b = sum_w + gw, sum_b + gb  # b only moves on a communicating pass
        if (k + 1) % passes == 0:
            scale = 1.0 / passes if average else 1.0
            want_w, want_b = want_w - lr * scale * sum_w, want_b - lr * scale * sum_b
            sum_w, sum_b = np.zeros(3), np.zeros(2)
        np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-5, err_msg="pass %d" % k)
        np.testing.assert_allclose(b.numpy(), want_b, rtol=1e-5, err_msg="pass %d" % k)
        assert int(opt.iterations.numpy()) == k + 1
    assert int(opt._agg_helper.counter.numpy()) == 7 % passes


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_non_finite_gradient_stays_in_its_aggregation_cycle(family, bad):
    """The first cycle's sums are not finite (rank 0's first pass); once applied they are reset,
    and the second cycle returns exactly its own sums (2 passes of gradient 1, averaged over the
    ranks)."""
    r = hvd.rank()
    x = variable(family, [0.0])
    count = tf.Variable(0)
    opt = hvd_keras.DistributedOptimizer(sgd(family, 0.1), backward_passes_per_step=2)

    def loss():
        count.assign_add(1)
        factor = tf.where(tf.logical_and(tf.equal(count, 1), r == 0), bad, 1.0)
        return tf.reduce_sum(x * factor)

    returned = []
    for _ in range(4):
        pairs = opt._compute_gradients(loss, [x])
        opt.apply_gradients(pairs)
        returned.append(pairs[0][0].numpy())
    assert r != 0 or not np.isfinite(returned[0]).all()
    assert not np.isfinite(returned[1]).all()  # the allreduced sums of the first cycle
    np.testing.assert_array_equal(returned[2], [1.0])
    np.testing.assert_array_equal(returned[3], [2.0])


def test_get_gradients_reduces_in_a_graph():
    """tf_keras legacy optimizers in graph mode (Keras 2's training loop calls get_gradients)."""
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        w = tf.Variable(np.full(3, 0.5, np.float32))
        c, _ = coefficients(r)
        loss = tf.reduce_sum(c * w)
        opt = hvd_keras.DistributedOptimizer(tf_keras.optimizers.legacy.SGD(0.1))
        grads = opt.get_gradients(loss, [w])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = sess.run(grads)
    gw, _ = expected(r, n, np.zeros(2), hvd.Average, local_b=False)
    np.testing.assert_allclose(got[0], gw, rtol=1e-6)


def test_from_config_copies_reduce_and_aggregate_too():
    r, n = hvd.rank(), hvd.size()
    opt = hvd_keras.DistributedOptimizer(tf_keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    copy = opt.__class__.from_config(opt.get_config())
    assert copy.get_config() == opt.get_config()
    assert copy._agg_helper is not None and copy._agg_helper is not opt._agg_helper
    w = tf.Variable(np.full(3, 0.5, np.float32))
    c, _ = coefficients(r)
    pairs = copy.compute_gradients(lambda: tf.reduce_sum(c * w), [w])
    np.testing.assert_allclose(pairs[0][0].numpy(), c)  # first pass: this rank's own sums
    pairs = copy.compute_gradients(lambda: tf.reduce_sum(c * w), [w])
    gw, _ = expected(r, n, np.zeros(2), hvd.Average, local_b=False)
    np.testing.assert_allclose(pairs[0][0].numpy(), 2 * gw, rtol=1e-6)


def test_v1_optimizer_local_variables():
    """tf.compat.v1 optimizers in a graph: shared gradients averaged, a registered local
    variable's gradient this rank's own divided by n (or left whole with
    scale_local_gradients=False)."""
    r, n = hvd.rank(), hvd.size()
    for scale in (True, False):
        with tf.Graph().as_default():
            w = tf.compat.v1.Variable(np.full(3, 0.5, np.float32))
            b = tf.compat.v1.Variable(np.array([1.0, 2.0], np.float32))
            loss = make_loss(w, b, r)()
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                           scale_local_gradients=scale)
            opt.register_local_var(b)
            pairs = opt.compute_gradients(loss, var_list=[w, b])
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                gw_got, gb_got = sess.run([g for g, _ in pairs])
        gw, gb = expected(r, n, np.array([1.0, 2.0]), hvd.Average, local_b=True)
        np.testing.assert_allclose(gw_got, gw, rtol=1e-6)
        np.testing.assert_allclose(gb_got, gb if scale else gb * n, rtol=1e-6)
