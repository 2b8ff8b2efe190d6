"""The digits MLP, or a small CNN, trained under horovod.torch with a compressor, for the codecs'
accuracy tests: its test accuracy (every rank's model checked equal)."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import horovod.torch as hvd


def _model(kind):
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 10))
    # two 3 x 3 convolutions over the 8 x 8 image (their weights travel as 16 x 9 and 32 x 144
    # matrices under PowerSGD), a 2 x 2 max pool and a linear layer
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 8, 8)),
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 10))


def accuracy(compression, prefix, epochs=12, batch=16, device="cpu", model="mlp", ddp_hook=None):
    """Test accuracy of the MLP (64-64-10) or the small CNN (`model="cnn"`), SGD with momentum,
    after `epochs` epochs, gradients averaged with `compression` (a `hvd.Compression` member,
    or an instance with its own parameter) under names starting with `prefix`, the model and
    data on `device`. With `ddp_hook` (a function given the DDP module, which registers a
    communication hook on it), DDP over torch.distributed's default group averages them
    instead."""
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32, device=device)
    y = torch.tensor(d.target, dtype=torch.int64, device=device)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    me, n = hvd.rank(), hvd.size()
    # as many steps on every rank: the smallest shard's batches
    steps = (len(x_train) // n) // batch
    x_train, y_train = x_train[me::n], y_train[me::n]
    torch.manual_seed(1234)
    model = _model(model).to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if ddp_hook is None:
        net = model
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(prefix=prefix),
                                       compression=compression)
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
        ddp_hook(net)
        opt = sgd
    rng = np.random.RandomState(me)
    for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for s in range(steps):
            idx = order[s * batch:(s + 1) * batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x_train[idx]), y_train[idx]).backward()
            opt.step()
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).double().mean().item()
    # every rank's model is the same: its weights are averaged alike
    w = next(model.parameters()).detach().clone()
    assert torch.equal(hvd.broadcast(w, root_rank=0, name="digits.w." + prefix), w)
    return acc
