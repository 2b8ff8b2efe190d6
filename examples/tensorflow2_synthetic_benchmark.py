"""Synthetic-data training throughput with Horovod's TensorFlow 2 API (in the style of Horovod's
tensorflow2_synthetic_benchmark.py), with a convolutional model small enough for two CPU cores.

    horovodrun -np 2 python examples/tensorflow2_synthetic_benchmark.py
"""

import argparse
import timeit

import keras
import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

parser = argparse.ArgumentParser(description="TensorFlow synthetic benchmark (Horovod API)")
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--image-size", type=int, default=64)
parser.add_argument("--num-warmup-batches", type=int, default=5)
parser.add_argument("--num-batches-per-iter", type=int, default=5)
parser.add_argument("--num-iters", type=int, default=5)
args = parser.parse_args()

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)


def small_cnn(size, classes=100):
    inputs = keras.Input(shape=(size, size, 3))
    x = inputs
    for filters in (32, 64, 128):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(256, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(classes)(x))


model = small_cnn(args.image_size)
opt = keras.optimizers.SGD(0.01)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=99, dtype=tf.int64)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def benchmark_step(first_batch):
    with tf.GradientTape() as tape:
        loss = loss_fn(target, model(data, training=True))
    tape = hvd.DistributedGradientTape(tape, compression=compression)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    # every rank starts from rank 0's weights and optimizer state
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log("Model: small CNN (6 conv layers), %d parameters" % model.count_params())
log("Batch size: %d" % args.batch_size)
log("Number of CPUs: %d" % hvd.size())
log("Running warmup...")
benchmark_step(first_batch=True)
timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)

log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / t
    log("Iter #%d: %.1f img/sec per CPU" % (x, img_sec))
    img_secs.append(img_sec)

img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log("Img/sec per CPU: %.1f +-%.1f" % (img_sec_mean, img_sec_conf))
log("Total img/sec on %d CPU(s): %.1f +-%.1f" % (hvd.size(), hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))
