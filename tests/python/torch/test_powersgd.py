"""PowerSGD through horovod.torch under mpirun (CPU tensors): an allreduce of matrices of low
rank comes back exact, vectors and small matrices travel as they are, the wire counter moves
by the factors' bytes, and the digits MLP trained with `Compression.powersgd` reaches the
uncompressed run's accuracy."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horovod.torch as hvd


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvd.init()
    yield


def test_an_average_of_low_rank_matrices_comes_back_exact():
    me, n = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(7)
    # every rank's matrix has rank 1, so the average has rank <= n <= 4 (the default rank):
    # one power iteration spans it exactly, whatever Q started from
    us = [torch.randn(48, 1, generator=g) for _ in range(n)]
    vs = [torch.randn(1, 20, generator=g) for _ in range(n)]
    mats = [u @ v for u, v in zip(us, vs)]
    want = sum(m.double() for m in mats) / n
    before = hvd.metrics()["wire_powersgd"]
    got = hvd.allreduce(mats[me].clone(), name="psgd.lowrank",
                        compression=hvd.Compression.powersgd)
    np.testing.assert_allclose(got.double().numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
    # (48 + 20) x 4 values of f32 on the wire, not 48 x 20
    assert hvd.metrics()["wire_powersgd"] - before == (48 + 20) * 4 * 4
    # a vector and a small matrix travel as they are: exact sums
    for shape in ((30,), (3, 2)):
        x = torch.arange(np.prod(shape), dtype=torch.float32).reshape(shape) * (me + 1)
        got = hvd.allreduce(x, name="psgd.small.%d" % len(shape), op=hvd.Sum,
                            compression=hvd.Compression.powersgd)
        np.testing.assert_array_equal(got.numpy(), x.numpy() / (me + 1) * (n * (n + 1) // 2))
    assert hvd.metrics()["wire_powersgd"] - before == (48 + 20) * 4 * 4


def accuracy(compression, epochs=12, batch=16):
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    me, n = hvd.rank(), hvd.size()
    # as many steps on every rank: the smallest shard's batches
    steps = (len(x_train) // n) // batch
    x_train, y_train = x_train[me::n], y_train[me::n]
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(prefix=compression),
                                   compression=getattr(hvd.Compression, compression))
    rng = np.random.RandomState(me)
    for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for s in range(steps):
            idx = order[s * batch:(s + 1) * batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            opt.step()
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).double().mean().item()
    # every rank's model is the same: its weights are averaged alike
    w = model[0].weight.detach().clone()
    np.testing.assert_array_equal(hvd.broadcast(w, root_rank=0, name="psgd.w." + compression), w)
    return acc


def test_training_with_powersgd_reaches_the_uncompressed_accuracy():
    before = hvd.metrics()["wire_powersgd"]
    plain = accuracy("none")
    assert hvd.metrics()["wire_powersgd"] == before
    compressed = accuracy("powersgd")
    # both weight matrices went as factors
    assert hvd.metrics()["wire_powersgd"] > before
    assert plain > 0.9
    print("digits accuracy: none %.4f, powersgd %.4f" % (plain, compressed))
    assert compressed >= plain - 0.01, (compressed, plain)


def test_ranks_asking_for_other_codecs_fail_alike():
    from ferrovod import _core
    from ferrovod.exceptions import PreconditionError

    me = hvd.rank()
    x = np.ones((16, 12), np.float32)
    codec = _core.COMPRESSION_POWERSGD if me == 0 else _core.COMPRESSION_NONE
    with pytest.raises(PreconditionError, match="Mismatched compression: .*powersgd"):
        _core.enqueue(_core.ALLREDUCE, [x], ["psgd.mismatch"], compression=codec).wait()
    # the job goes on: the same tensor asked alike
    (out,) = _core.enqueue(_core.ALLREDUCE, [x * (me + 1)], ["psgd.mismatch"],
                           compression=_core.COMPRESSION_POWERSGD).wait()
    n = hvd.size()
    np.testing.assert_allclose(out, x * (n * (n + 1) // 2), rtol=1e-4)
