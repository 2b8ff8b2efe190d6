"""Keras training with Horovod's API, exactly as Horovod's documentation shows it
(https://horovod.readthedocs.io/en/stable/keras.html), on scikit-learn's digits dataset.

    horovodrun -np 4 python examples/keras_digits.py
"""

import argparse
import sys
import time

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horovod.tensorflow.keras as hvd

parser = argparse.ArgumentParser(description="Keras digits example (Horovod API)")
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate for one worker")
parser.add_argument("--compression", default="none", choices=["none", "fp16", "bf16", "mixed", "u8"],
                    help="how gradients travel (bf16 and mixed are ferrovod extensions)")
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

# Horovod: the same split everywhere, then each rank trains on its own shard.
digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)
y = digits.target.astype(np.int64)
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
x_shard, y_shard = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

keras.utils.set_random_seed(1234)
model = keras.Sequential([
    keras.Input(shape=(64,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dropout(0.2),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])

# Horovod: adjust learning rate based on number of workers.
scaled_lr = args.lr * hvd.size()
opt = keras.optimizers.SGD(learning_rate=scaled_lr, momentum=0.9)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(opt, compression=getattr(hvd.Compression, args.compression))

model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"])

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),
    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
    # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
    # the first three epochs.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
]

# Horovod: write logs on worker 0 only.
verbose = 2 if hvd.rank() == 0 else 0

start = time.time()
model.fit(x_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
          verbose=verbose)
elapsed = time.time() - start

# every rank evaluates its part of the test set; the results are averaged over the ranks
loss, acc = model.evaluate(x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()], verbose=0)
acc = float(hvd.allreduce(tf.constant(acc), name="test_accuracy"))
samples = len(x_train) * args.epochs
if hvd.rank() == 0:
    # one write per line: unbuffered output (as under horovodrun) would split text and newline
    for line in ("ranks: %d, epochs: %d, global batch: %d" % (hvd.size(), args.epochs, args.batch_size * hvd.size()),
                 "final test accuracy: %.4f" % acc,
                 "training throughput: %.0f samples/s (%d samples in %.1f s)" % (samples / elapsed, samples, elapsed)):
        sys.stdout.write(line + "\n")
    sys.stdout.flush()
