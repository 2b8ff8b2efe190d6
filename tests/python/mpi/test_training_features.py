"""Training features beyond plain gradient averaging, under mpirun: local gradient aggregation
(backward_passes_per_step) for Keras 3, tf_keras and tf.compat.v1 optimizers, model-parallel
layers (PartialDistributedGradientTape / PartialDistributedOptimizer), SyncBatchNormalization
and the elastic state objects. Each is checked against values computed independently: one
process on the concatenated data, or the plain per-rank gradients gathered from every rank."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvd_keras  # noqa: E402
from horovod.common.exceptions import HorovodInternalError  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.barrier()


def regression_data(rows, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(rows, 5).astype(np.float32), rng.randn(rows, 1).astype(np.float32)


def passes_shard(a, r, n, b, passes):
    """Rank r's local batches when one global step covers `passes` local batches per rank: global
    batch j (n*b*passes rows) is split pass by pass, rank by rank."""
    per_step = n * b * passes
    out = []
    for j in range(len(a) // per_step):
        for p in range(passes):
            start = j * per_step + p * n * b + r * b
            out.append(a[start:start + b])
    return np.concatenate(out)


@pytest.mark.parametrize("flavour", ["keras3", "tf_keras", "tf_keras_legacy"])
def test_backward_passes_per_step_matches_larger_batches(flavour):
    """Two local passes averaged, then averaged over n ranks == one process on 2*n*b rows; the
    optimizer's iteration count still advances on every pass. (tf_keras's legacy optimizers
    reduce in `_compute_gradients`, the others in `apply`/`apply_gradients`.)"""
    r, n = hvd.rank(), hvd.size()
    b, passes, global_steps = 3, 2, 3
    x, y = regression_data(n * b * passes * global_steps)
    lib = keras if flavour == "keras3" else tf_keras
    sgd = tf_keras.optimizers.legacy.SGD if flavour == "tf_keras_legacy" else lib.optimizers.SGD

    def model():
        lib.utils.set_random_seed(11)
        return lib.Sequential([lib.Input(shape=(5,)), lib.layers.Dense(4, activation="tanh"),
                               lib.layers.Dense(1)])

    dist = model()
    opt = hvd_keras.DistributedOptimizer(sgd(0.1), backward_passes_per_step=passes,
                                         average_aggregated_gradients=True)
    dist.compile(optimizer=opt, loss="mse")
    dist.fit(passes_shard(x, r, n, b, passes), passes_shard(y, r, n, b, passes), batch_size=b,
             epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == passes * global_steps
    assert int(opt._agg_helper.counter.numpy()) == 0

    ref = model()
    ref.compile(optimizer=sgd(0.1), loss="mse")
    ref.fit(x, y, batch_size=n * b * passes, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(dist.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_backward_passes_per_step_in_a_v1_graph():
    """tf.compat.v1 optimizer in a graph: the variable moves only on every 4th run, by the
    aggregated, averaged gradient (rank r contributes r each pass); global_step counts every run."""
    r, n = hvd.rank(), hvd.size()
    passes = 4
    graph = tf.Graph()
    with graph.as_default():
        var = tf.compat.v1.Variable([0.0])
        grad = tf.constant([float(r)])

        class Fixed(tf.compat.v1.train.GradientDescentOptimizer):
            def compute_gradients(self, *args, **kwargs):
                return [(grad, var)]

        opt = hvd.DistributedOptimizer(Fixed(learning_rate=-1.0), backward_passes_per_step=passes,
                                       average_aggregated_gradients=True)
        step = tf.compat.v1.train.get_or_create_global_step()
        train = opt.apply_gradients(opt.compute_gradients(), global_step=step)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            seen = []
            for _ in range(10):
                sess.run(train)
                seen.append((float(sess.run(var)[0]), int(sess.run(step))))
    mean_rank = (n - 1) / 2
    want = [(mean_rank * ((k + 1) // passes), k + 1) for k in range(10)]
    np.testing.assert_allclose([v for v, _ in seen], [v for v, _ in want], rtol=1e-6)
    assert [s for _, s in seen] == [s for _, s in want]


def test_backward_passes_per_step_is_summed_by_the_core():
    """The passes are summed by ferrovod's core (a multistep allreduce): tensors reach the
    collectives on every `passes`-th pass only, the result is the average of the summed
    gradients of every rank, and the passes between return this pass's own gradient."""
    r, n = hvd.rank(), hvd.size()
    passes = 3
    w = tf.Variable(np.zeros(4, np.float32))
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=passes)
    before = hvd.metrics()["tensors"]
    got = []
    for k in range(2 * passes):
        grad = tf.constant(np.arange(4, dtype=np.float32) * (r + 1) + k)
        got.append(opt._compute_gradients(lambda: tf.reduce_sum(w * grad), [w])[0][0].numpy())
        sent = hvd.metrics()["tensors"] - before
        assert sent == (k + 1) // passes, "pass %d: %d tensors reduced" % (k, sent)
    for k in range(2 * passes):
        if (k + 1) % passes:
            want = np.arange(4) * (r + 1) + k
        else:  # the mean over ranks of each rank's sum over the cycle's passes
            ks = range(k + 1 - passes, k + 1)
            want = np.mean([sum(np.arange(4) * (q + 1) + j for j in ks) for q in range(n)], axis=0)
        np.testing.assert_allclose(got[k], want, rtol=1e-6, err_msg="pass %d" % k)


def test_mismatched_backward_passes_per_step_fails_on_every_rank():
    """Rank 0 aggregates 2 passes, the others 3: the allreduce of rank 0's 2nd pass meets the
    others' 3rd, and every rank gets the error Horovod's TF ops raise for mismatches
    (FailedPreconditionError) naming it, instead of a wrong sum or a hang."""
    r = hvd.rank()
    w = tf.Variable(np.zeros(2, np.float32))
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                         backward_passes_per_step=2 if r == 0 else 3)
    with pytest.raises(tf.errors.FailedPreconditionError, match="Mismatched multistep"):
        for _ in range(2 if r == 0 else 3):
            opt._compute_gradients(lambda: tf.reduce_sum(w * w), [w])
    hvd.barrier()


def test_backward_passes_per_step_rejects_sparse_without_dense():
    with pytest.raises(ValueError, match="sparse_as_dense"):
        from ferrovod.tensorflow.gradient_aggregation import LocalGradientAggregator

        LocalGradientAggregator(2, True, sparse_as_dense=False).reduce(
            [tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2]))], lambda g: g)
    with pytest.raises(ValueError):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)


def test_tf_keras_legacy_compute_gradients_returns_reduced_gradients():
    """As in Horovod, a wrapped legacy optimizer's `_compute_gradients` returns the averaged
    gradients (local layers: this rank's, divided by n), and `apply_gradients` does not reduce
    them again."""
    r, n = hvd.rank(), hvd.size()
    tf_keras.utils.set_random_seed(20 + r)
    model = tf_keras.Sequential([tf_keras.layers.Dense(2, input_shape=(3,)), tf_keras.layers.Dense(1)])
    x = np.full((2, 3), r + 1.0, np.float32)
    loss = lambda: tf.reduce_sum(model(x))  # noqa: E731
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        value = loss()
    plain = tape.gradient(value, variables)
    mean = gathered_mean(plain)
    opt = hvd_keras.PartialDistributedOptimizer(tf_keras.optimizers.legacy.SGD(1.0),
                                                local_layers=[model.layers[0]])
    with tf.GradientTape() as tape:
        value = loss()
    pairs = opt._compute_gradients(value, variables, tape=tape)
    local_ids = {id(v) for v in model.layers[0].trainable_weights}
    for (g, v), p, m in zip(pairs, plain, mean):
        want = p.numpy() / n if id(v) in local_ids else m
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-5, atol=1e-6)
    before = [v.numpy() for v in variables]
    opt.apply_gradients(pairs)
    for v, w0, (g, _) in zip(variables, before, pairs):
        np.testing.assert_allclose(v.numpy(), w0 - g.numpy(), rtol=1e-5, atol=1e-6)


def test_allreduce_on_an_unregistered_process_set_is_a_value_error():
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 1000
    with pytest.raises(ValueError):
        hvd.allreduce(tf.ones(2), process_set=fake)
    # a set never registered is refused by every op, never taken for the global set
    never = hvd.ProcessSet([0])
    for op in (lambda: hvd.allreduce(tf.ones(2), process_set=never),
               lambda: hvd.allgather(tf.ones(2), process_set=never),
               lambda: hvd.broadcast(tf.ones(2), 0, process_set=never),
               lambda: hvd.barrier(process_set=never)):
        with pytest.raises(ValueError, match="has not been registered"):
            op()


def gathered_mean(grads):
    """The mean over ranks of each rank's plain gradient, from allgather_object."""
    everyone = hvd.allgather_object([g.numpy() for g in grads], name="plain_grads")
    return [np.mean([e[k] for e in everyone], axis=0) for k in range(len(grads))]


def mp_model(seed_offset):
    keras.utils.set_random_seed(100 + seed_offset)
    return keras.Sequential([keras.Input(shape=(5,)), keras.layers.Dense(3, activation="tanh"),
                             keras.layers.Dense(1)])


def test_partial_distributed_gradient_tape():
    """The local layer's gradient is this rank's own, divided by n; the others are averaged."""
    r, n = hvd.rank(), hvd.size()
    x, y = regression_data(4 * n, seed=1)
    x, y = x[4 * r:4 * r + 4], y[4 * r:4 * r + 4]
    model = mp_model(r)  # weights differ per rank, as in model parallelism
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    plain = tape.gradient(loss, model.trainable_variables)
    local_layer = model.layers[0]
    dtape = hvd.PartialDistributedGradientTape(tape, local_layers=local_layer)
    got = dtape.gradient(loss, model.trainable_variables)
    mean = gathered_mean(plain)
    local_ids = {id(v) for v in local_layer.trainable_weights}
    for v, g, p, m in zip(model.trainable_variables, got, plain, mean):
        want = p.numpy() / n if id(v) in local_ids else m
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-5, atol=1e-6)
    local, shared = dtape.get_local_and_global_gradients(loss, model.trainable_variables)
    assert [id(v) for v, _ in local] == [id(v) for v in local_layer.trainable_weights]
    assert len(shared) == len(model.trainable_variables) - len(local)
    with pytest.raises(ValueError):
        hvd.PartialDistributedGradientTape(tape, local_layers=["not a layer"])


def test_partial_distributed_optimizer_one_step():
    """One SGD step through Keras fit: shared weights move by the averaged gradient, the local
    layer by this rank's gradient divided by n."""
    r, n = hvd.rank(), hvd.size()
    lr = 0.5
    x, y = regression_data(4 * n, seed=2)
    x, y = x[4 * r:4 * r + 4], y[4 * r:4 * r + 4]
    model = mp_model(r)
    before = [v.numpy() for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    plain = tape.gradient(loss, model.trainable_variables)
    mean = gathered_mean(plain)
    local_layer = model.layers[0]
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(lr), local_layers=[local_layer])
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    local_ids = {id(v) for v in local_layer.trainable_weights}
    for v, w0, p, m in zip(model.trainable_variables, before, plain, mean):
        step = p.numpy() / n if id(v) in local_ids else m
        np.testing.assert_allclose(v.numpy(), w0 - lr * step, rtol=1e-4, atol=1e-5)


def batch_norm_reference(x_all, w_all, layer_factory):
    """Plain BatchNormalization on the concatenated batch: outputs and input gradients."""
    bn = layer_factory()
    x = tf.constant(x_all)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = bn(x, training=True)
        loss = tf.reduce_sum(out * w_all)
    return out.numpy(), tape.gradient(loss, x).numpy(), bn


@pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])
def test_sync_batch_norm_matches_batch_norm_on_the_global_batch(flavour):
    """Ranks hold batches of different sizes (r + 1 rows); outputs, input gradients and the
    moving statistics equal those of one BatchNormalization over all rows."""
    from ferrovod.tensorflow.sync_batch_norm import _keras2_layer, _keras3_layer

    r, n = hvd.rank(), hvd.size()
    rows = [k + 1 for k in range(n)]
    rng = np.random.RandomState(5)
    x_all = (rng.randn(sum(rows), 3) * 2 + 1).astype(np.float32)
    w_all = rng.randn(sum(rows), 3).astype(np.float32)
    lo = sum(rows[:r])
    if flavour == "keras3":
        sync_cls, plain_cls = _keras3_layer(keras.layers.BatchNormalization), keras.layers.BatchNormalization
    else:
        sync_cls, plain_cls = _keras2_layer(tf_keras.layers.BatchNormalization), tf_keras.layers.BatchNormalization
    want_out, want_grad, ref_bn = batch_norm_reference(x_all, w_all, lambda: plain_cls(momentum=0.5))

    sync_bn = sync_cls(momentum=0.5)
    x = tf.constant(x_all[lo:lo + rows[r]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = sync_bn(x, training=True)
        loss = tf.reduce_sum(out * w_all[lo:lo + rows[r]])
    grad = tape.gradient(loss, x)
    np.testing.assert_allclose(out.numpy(), want_out[lo:lo + rows[r]], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grad.numpy(), want_grad[lo:lo + rows[r]], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(sync_bn.moving_mean.numpy(), ref_bn.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(sync_bn.moving_variance.numpy(), ref_bn.moving_variance.numpy(), rtol=1e-4)
    assert hvd.SyncBatchNormalization is not None
    with pytest.raises(ValueError):
        sync_cls(fused=True)


def test_elastic_state_sync_commit_restore_and_run():
    r = hvd.rank()
    v = tf.Variable(np.full((2,), float(r + 1)))
    state = hvd.elastic.TensorFlowState([v], batch=10 + r, epoch=r)
    state.sync()
    np.testing.assert_allclose(v.numpy(), [1.0, 1.0])
    assert (state.batch, state.epoch) == (10, 0)
    v.assign([5.0, 6.0])
    state.batch = 11
    state.restore()
    np.testing.assert_allclose(v.numpy(), [1.0, 1.0])
    assert state.batch == 10
    v.assign([5.0, 6.0])
    state.batch = 12
    state.commit()
    v.assign([7.0, 7.0])
    state.restore()
    np.testing.assert_allclose(v.numpy(), [5.0, 6.0])
    assert state.batch == 12

    calls = []

    @hvd.elastic.run
    def train(state, fail):
        calls.append(state.batch)
        if fail:
            v.assign([3.0, 3.0])
            state.batch = 55
            raise HorovodInternalError("a collective failed")
        v.assign([9.0, 9.0])
        state.batch = 99
        return "done"

    assert train(state, False) == "done"
    state.commit()
    with pytest.raises(HorovodInternalError, match="restored to its last commit"):
        train(state, True)
    # the failed run's changes are rolled back to the commit made after the first run
    assert state.batch == 99 and calls == [12, 99]
    np.testing.assert_allclose(v.numpy(), [9.0, 9.0])


def test_keras_elastic_state_and_callbacks():
    r = hvd.rank()
    model = mp_model(r)
    opt = keras.optimizers.SGD(0.1)
    model.compile(optimizer=opt, loss="mse")
    state = hvd_keras.elastic.KerasState(model, batch=0, epoch=0)
    state.sync()  # every rank now holds rank 0's weights
    for k, w in enumerate(model.get_weights()):
        everyone = hvd.allgather_object(w, name="elastic_w_%d" % k)
        for other in everyone:
            np.testing.assert_allclose(other, w)
    x, y = regression_data(8, seed=3)
    callbacks = [hvd_keras.elastic.UpdateBatchStateCallback(state),
                 hvd_keras.elastic.UpdateEpochStateCallback(state),
                 hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=2)]
    model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    assert (state.batch, state.epoch) == (0, 2)
    committed = [w.copy() for w in model.get_weights()]
    model.set_weights([w + 1 for w in committed])
    state.restore()
    for got, want in zip(model.get_weights(), committed):
        np.testing.assert_allclose(got, want)
