"""Partial FC (InsightFace's model-parallel classifier): the weight of a softmax classifier
over very many classes is sharded by class across the ranks of a group, so that no rank holds
(or computes) all of it. Features are allgathered in the group; the softmax normaliser comes
from an allreduce of each sample's maximum logit and of its sum of exponentials; the loss and
the gradients flow back through the same collectives. Equal to one process's full softmax
cross-entropy over the group's whole batch (tests/python/mxnet)."""

import mxnet as mx


def shard(num_classes, size, rank):
    """The classes [start, stop) rank `rank` of `size` holds (the remainder to the lowest
    ranks)."""
    base, extra = divmod(num_classes, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class PartialFCLoss(mx.autograd.Function):
    """Softmax cross-entropy of this rank's samples against all classes, with the class
    weights sharded over `comm` (a GroupComm): `loss = PartialFCLoss(comm, start)(features,
    weight, labels)` where `weight` is this rank's shard (its classes from `start`), `features`
    (b × D) and `labels` (b, class ids) this rank's samples. Returns each of this rank's
    samples' loss (b). Gradients flow to `features` (each rank its rows) and to `weight` (each
    rank its shard, from every sample of the group)."""

    _calls = 0

    def __init__(self, comm, start):
        super().__init__()
        self._comm, self._start = comm, start
        PartialFCLoss._calls += 1
        self._name = "partial_fc.%d" % PartialFCLoss._calls

    # the labels come last: MXNet 1.9's Function drops the gradient of an input that follows
    # one without a gradient
    def forward(self, features, weight, labels):
        from ferrovod.mxnet import Max, Sum

        comm, name = self._comm, self._name
        feats = comm.allgather(features, name=name + ".features")
        all_labels = comm.allgather(labels.reshape((-1, 1)), name=name + ".labels").reshape((-1,))
        logits = mx.nd.dot(feats, weight, transpose_b=True)  # B x C_r
        top = comm.allreduce(logits.max(axis=1), op=Max, name=name + ".max")
        e = mx.nd.exp(logits - top.reshape((-1, 1)))
        total = comm.allreduce(e.sum(axis=1), op=Sum, name=name + ".sum")
        prob = e / total.reshape((-1, 1))
        local = all_labels - self._start
        mine = (local >= 0) * (local < weight.shape[0])
        onehot = mx.nd.one_hot(mx.nd.where(mine, local, mx.nd.zeros_like(local)), weight.shape[0])
        onehot = onehot * mine.reshape((-1, 1))
        # -log p(label): on the rank holding the label's class, summed so every rank has it
        picked = (prob * onehot).sum(axis=1) + (1 - mine)
        loss_all = comm.allreduce(-mx.nd.log(picked) * mine, op=Sum, name=name + ".loss")
        # this rank's rows of the group's batch
        sizes = comm.allgather(mx.nd.array([features.shape[0]]), name=name + ".rows").asnumpy()
        begin = int(sizes[:comm.rank()].sum())
        self._rows = (begin, begin + features.shape[0])
        # a copy of the weight: the backward pass runs inside an engine operation, and reading
        # the caller's weight there would queue behind the optimizer's update of it, which
        # waits for this backward pass
        self.save_for_backward(feats, prob, onehot, weight.copy())
        return loss_all[begin:begin + features.shape[0]]

    def backward(self, dloss):
        from ferrovod.mxnet import Sum

        comm, name = self._comm, self._name
        feats, prob, onehot, weight = self.saved_tensors
        dloss_all = comm.allgather(dloss.reshape((-1, 1)), name=name + ".dloss")
        dlogits = (prob - onehot) * dloss_all  # B x C_r
        dweight = mx.nd.dot(dlogits, feats, transpose_a=True)  # this shard, every sample
        dfeats = comm.allreduce(mx.nd.dot(dlogits, weight), op=Sum, name=name + ".dfeatures")
        begin, end = self._rows
        return dfeats[begin:end], dweight, mx.nd.zeros((end - begin,))
