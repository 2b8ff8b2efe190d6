"""tf_keras (Keras 2) scripts, as older Horovod users wrote them: DistributedOptimizer around a
tf_keras optimizer matches one process training on the concatenated batches."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402


def make_model():
    tf_keras.utils.set_random_seed(7)
    return tf_keras.Sequential([
        tf_keras.layers.Dense(8, activation="tanh", input_shape=(5,)),
        tf_keras.layers.Dense(1),
    ])


def test_tf_keras_distributed_optimizer_matches_single_process():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    b, steps = 4, 4
    rng = np.random.RandomState(3)
    x = rng.randn(n * b * steps, 5).astype(np.float32)
    y = rng.randn(n * b * steps, 1).astype(np.float32)
    xs = np.concatenate([x[k * n * b + r * b: k * n * b + (r + 1) * b] for k in range(steps)])
    ys = np.concatenate([y[k * n * b + r * b: k * n * b + (r + 1) * b] for k in range(steps)])
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(tf_keras.optimizers.SGD(0.05)), loss="mse")
    model.fit(xs, ys, batch_size=b, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    ref = make_model()
    ref.compile(optimizer=tf_keras.optimizers.SGD(0.05), loss="mse")
    ref.fit(x, y, batch_size=n * b, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    hvd.barrier()
