"""Keras under mpirun: a model trained with hvd.DistributedOptimizer (and with
DistributedGradientTape) on N ranks reaches the weights of one process training on the
concatenated batches; callbacks average metrics and warm up the learning rate."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd_tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.barrier()


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input(shape=(6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3),
    ])


def data(n_rows):
    rng = np.random.RandomState(42)
    x = rng.randn(n_rows, 6).astype(np.float32)
    y = rng.randint(0, 3, size=n_rows)
    return x, y


def shard(a, r, n, b):
    """Rank r's rows of every global batch of n*b rows."""
    return np.concatenate([a[k * n * b + r * b: k * n * b + (r + 1) * b] for k in range(len(a) // (n * b))])


def fit_distributed(seed, x, y, b, callbacks=()):
    r, n = hvd.rank(), hvd.size()
    model = make_model(seed)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(shard(x, r, n, b), shard(y, r, n, b), batch_size=b, epochs=2, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return model


def test_distributed_optimizer_matches_single_process():
    n = hvd.size()
    b, steps = 4, 5
    x, y = data(n * b * steps)
    model = fit_distributed(1, x, y, b)
    ref = make_model(1)
    ref.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ref.fit(x, y, batch_size=n * b, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_broadcast_callback_aligns_ranks_that_start_apart():
    r, n = hvd.rank(), hvd.size()
    b = 4
    x, y = data(n * b * 3)
    model = fit_distributed(10 + r, x, y, b, [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    for k, w in enumerate(model.get_weights()):
        everyone = hvd.allgather_object(w, name="weights_%d" % k)
        for other in everyone:
            np.testing.assert_allclose(other, w, rtol=1e-6)


def test_distributed_gradient_tape_training_matches_single_process():
    r, n = hvd.rank(), hvd.size()
    b, steps = 4, 4
    x, y = data(n * b * steps)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, ref = make_model(3), make_model(3)
    opt, ref_opt = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    xs, ys = shard(x, r, n, b), shard(y, r, n, b)
    for k in range(steps):
        with tf.GradientTape() as tape:
            loss = loss_fn(ys[k * b:(k + 1) * b], model(xs[k * b:(k + 1) * b]))
        tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        with tf.GradientTape() as t2:
            l2 = loss_fn(y[k * n * b:(k + 1) * n * b], ref(x[k * n * b:(k + 1) * n * b]))
        ref_opt.apply_gradients(zip(t2.gradient(l2, ref.trainable_variables), ref.trainable_variables))
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_metric_average_and_lr_warmup_callbacks():
    r, n = hvd.rank(), hvd.size()
    logs = {"loss": float(r), "accuracy": 2.0 * r}
    cb = hvd.callbacks.MetricAverageCallback()
    cb.on_epoch_end(0, logs)
    assert logs == {"loss": (n - 1) / 2, "accuracy": float(n - 1)}

    model = make_model(5)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seen = []

    class Record(keras.callbacks.Callback):
        def on_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    warm = hvd.callbacks.LearningRateWarmupCallback(initial_lr=1.0, warmup_epochs=2, steps_per_epoch=2,
                                                    momentum_correction=False)
    x, y = data(4 * n)
    model.fit(x[:4], y[:4], batch_size=2, epochs=2, shuffle=False, verbose=0, callbacks=[warm, Record()])
    # lr = 1/n * (epoch * (n - 1) / 2 + 1) at fractional epochs 0, 0.5, 1, 1.5
    want = [1.0 / n * (e * (n - 1) / 2 + 1) for e in (0.0, 0.5, 1.0, 1.5)]
    np.testing.assert_allclose(seen, want, rtol=1e-6)
