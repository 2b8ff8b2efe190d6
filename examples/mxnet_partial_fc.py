"""InsightFace-style training with a model-parallel classifier (partial FC) and a data-parallel
backbone, on synthetic data:

    mpirun -np 4 .venv-mxnet/bin/python examples/mxnet_partial_fc.py [--classes 1000] [--steps 60]

The classifier's weight (classes x embedding) is sharded by class across the ranks
(`ferrovod.mxnet.partial_fc`): no rank holds all of it, the features are allgathered, the
softmax normaliser comes from collectives. The backbone (a small MLP producing the embedding)
is replicated and trained data-parallel (`DistributedTrainer`). Every rank draws its own batch
of samples around per-class centres; the loss falls as the model learns them."""

import argparse

import mxnet as mx
import numpy as np

import horovod.mxnet as hvd
from ferrovod.mxnet.partial_fc import PartialFCLoss, shard


def train(classes=1000, steps=60, batch=32, dim=32, embedding=16, lr=0.5, seed=0, log=print):
    """Trains and returns the mean loss of each step (the same on every rank)."""
    r, n = hvd.rank(), hvd.size()
    comm = hvd.GroupComm(range(n))  # the classifier's group: every rank
    centres = np.random.RandomState(seed).randn(classes, dim).astype(np.float32)
    data = np.random.RandomState(seed + 1 + r)

    mx.random.seed(seed)  # the same backbone on every rank (broadcast below anyway)
    backbone = mx.gluon.nn.HybridSequential()
    backbone.add(mx.gluon.nn.Dense(64, activation="relu", in_units=dim),
                 mx.gluon.nn.Dense(embedding, in_units=64))
    backbone.initialize(mx.init.Xavier())
    hvd.broadcast_parameters(backbone.collect_params(), root_rank=0, prefix="backbone.")
    trainer = hvd.DistributedTrainer(backbone.collect_params(), "sgd", {"learning_rate": lr},
                                     prefix="backbone.")

    c0, c1 = shard(classes, n, r)
    weight = mx.nd.array(np.random.RandomState(seed + 100 + r).randn(c1 - c0, embedding) * 0.01)
    weight.attach_grad()

    losses = []
    for step in range(steps):
        labels = data.randint(0, classes, batch)
        x = mx.nd.array(centres[labels] + 0.3 * data.randn(batch, dim).astype(np.float32))
        with mx.autograd.record():
            loss = PartialFCLoss(comm, c0)(backbone(x), weight, mx.nd.array(labels))
            # the mean over the group's whole batch: each rank's share of it
            total = loss.sum() / (batch * n)
        total.backward()
        trainer.step(1)  # the backbone: gradients averaged over the ranks, then applied
        weight[:] = weight - lr * n * weight.grad  # the shard: its gradient is complete here
        mean = hvd.allreduce(loss.mean(), op=hvd.Average, name="partial_fc.loss").asscalar()
        losses.append(mean)
        if r == 0 and (step % 10 == 0 or step == steps - 1):
            log("step %3d  loss %.4f" % (step, mean))
    return losses


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    hvd.init()
    losses = train(classes=args.classes, steps=args.steps)
    if hvd.rank() == 0:
        print("first loss %.4f, last loss %.4f" % (losses[0], losses[-1]))
