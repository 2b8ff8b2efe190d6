"""Gluon training with Horovod's MXNet API, as Horovod's documentation shows it
(https://horovod.readthedocs.io/en/stable/mxnet.html), on scikit-learn's digits dataset:

    .venv-mxnet/bin/horovodrun -np 4 .venv-mxnet/bin/python examples/mxnet_digits.py

Each rank trains on its shard of the training set; DistributedTrainer averages the gradients,
so the model follows one process training on the whole set with the global batch."""

import argparse

import mxnet as mx
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horovod.mxnet as hvd


def data():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.float32)
    return train_test_split(x, y, test_size=0.25, random_state=0)


def model(seed=1234):
    mx.random.seed(seed)
    net = mx.gluon.nn.Sequential()
    net.add(mx.gluon.nn.Dense(128, activation="relu", in_units=64),
            mx.gluon.nn.Dense(64, activation="relu", in_units=128),
            mx.gluon.nn.Dense(10, in_units=64))
    net.initialize(mx.init.Xavier())
    return net


def train(epochs=12, batch_size=32, lr=0.05, distributed=True):
    """Trains and returns the test accuracy. `distributed=False`: one process on the whole
    training set with the same global batch (the reference)."""
    x_train, x_test, y_train, y_test = data()
    r, n = (hvd.rank(), hvd.size()) if distributed else (0, 1)
    net = model()
    params = net.collect_params()
    if distributed:
        # Horovod: the same initial weights everywhere, gradients averaged over the ranks
        hvd.broadcast_parameters(params, root_rank=0)
        trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": lr * n, "momentum": 0.9})
    else:
        trainer = mx.gluon.Trainer(params, "sgd", {"learning_rate": lr * hvd.size(), "momentum": 0.9},
                                   kvstore=None)
    global_batch = batch_size * hvd.size()
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    steps = len(x_train) // global_batch
    for _ in range(epochs):
        for s in range(steps):
            rows = slice(s * global_batch, (s + 1) * global_batch)
            xb, yb = x_train[rows], y_train[rows]
            if distributed:  # this rank's part of the global batch
                xb, yb = xb[r::n], yb[r::n]
            with mx.autograd.record():
                loss = loss_fn(net(mx.nd.array(xb)), mx.nd.array(yb))
            loss.backward()
            trainer.step(len(xb))
    predicted = net(mx.nd.array(x_test)).argmax(axis=1).asnumpy()
    return float((predicted == y_test).mean())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Gluon digits example (Horovod API)")
    p.add_argument("--epochs", type=int, default=12)
    args = p.parse_args()
    hvd.init()
    accuracy = train(epochs=args.epochs)
    if hvd.rank() == 0:
        print("test accuracy %.4f (%d ranks)" % (accuracy, hvd.size()))
