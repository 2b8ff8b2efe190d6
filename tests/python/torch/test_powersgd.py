"""PowerSGD through horovod.torch under mpirun (CPU tensors, and CUDA tensors where CUDA is,
or FERROVOD_TEST_GPU=1 asks for it): an allreduce of matrices of low rank comes back exact,
vectors and small matrices travel as they are, the wire counter moves by the factors' bytes,
and the digits MLP and a small CNN trained with `Compression.powersgd` reach the uncompressed
run's accuracy, and that of DDP under PyTorch's own PowerSGD hook at the same rank."""

import os

import numpy as np
import pytest
import torch

import horovod.torch as hvd
from digits_training import accuracy
from rendezvous import free_port_from_rank0


DEVICES = ["cpu"]
if torch.cuda.is_available() or os.environ.get("FERROVOD_TEST_GPU") == "1":
    DEVICES.append("cuda")


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvd.init()
    if "cuda" in DEVICES:
        assert torch.cuda.is_available(), "FERROVOD_TEST_GPU=1 but CUDA is not available"
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    yield


@pytest.mark.parametrize("device", DEVICES)
def test_an_average_of_low_rank_matrices_comes_back_exact(device):
    me, n = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(7)
    # every rank's matrix has rank 1, so the average has rank <= n <= 4 (the default rank):
    # one power iteration spans it exactly, whatever Q started from
    us = [torch.randn(48, 1, generator=g) for _ in range(n)]
    vs = [torch.randn(1, 20, generator=g) for _ in range(n)]
    mats = [u @ v for u, v in zip(us, vs)]
    want = sum(m.double() for m in mats) / n
    before = hvd.metrics()["wire_powersgd"]
    got = hvd.allreduce(mats[me].clone().to(device), name="psgd.lowrank." + device,
                        compression=hvd.Compression.powersgd)
    assert got.device.type == device
    np.testing.assert_allclose(got.double().cpu().numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
    # (48 + 20) x 4 values of f32 on the wire, not 48 x 20
    assert hvd.metrics()["wire_powersgd"] - before == (48 + 20) * 4 * 4
    # a vector and a small matrix travel as they are: exact sums
    for shape in ((30,), (3, 2)):
        x = torch.arange(np.prod(shape), dtype=torch.float32).reshape(shape) * (me + 1)
        got = hvd.allreduce(x.to(device), name="psgd.small.%d.%s" % (len(shape), device),
                            op=hvd.Sum, compression=hvd.Compression.powersgd)
        np.testing.assert_array_equal(got.cpu().numpy(),
                                      x.numpy() / (me + 1) * (n * (n + 1) // 2))
    assert hvd.metrics()["wire_powersgd"] - before == (48 + 20) * 4 * 4


@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("device", DEVICES)
def test_training_with_powersgd_reaches_the_uncompressed_accuracy(device, model):
    before = hvd.metrics()["wire_powersgd"]
    plain = accuracy(hvd.Compression.none, "none.%s.%s" % (model, device), device=device,
                     model=model)
    assert hvd.metrics()["wire_powersgd"] == before
    compressed = accuracy(hvd.Compression.powersgd, "powersgd.%s.%s" % (model, device),
                          device=device, model=model)
    # the weight matrices went as factors
    assert hvd.metrics()["wire_powersgd"] > before
    assert plain > 0.9
    print("digits %s accuracy on %s: none %.4f, powersgd %.4f" % (model, device, plain,
                                                                   compressed))
    assert compressed >= plain - 0.01, (compressed, plain)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_training_with_powersgd_is_as_accurate_as_torchs_powersgd_hook(model):
    """The benchmark's comparison (`bench_torch.py`, ferrovod's PowerSGD against DDP with
    `powerSGD_hook`, both of rank 4) at equal accuracy: the same model, data and steps."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    def torch_hook(ddp):
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                   start_powerSGD_iter=2)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)

    _gloo_group()
    try:
        theirs = accuracy(None, "torchhook." + model, model=model, ddp_hook=torch_hook)
    finally:
        dist.destroy_process_group()
    ours = accuracy(hvd.Compression.powersgd(rank=4), "powersgd4." + model, model=model)
    print("digits %s accuracy: torch's powerSGD_hook %.4f, ferrovod's powersgd %.4f" % (
        model, theirs, ours))
    assert theirs > 0.9
    assert ours >= theirs - 0.01, (ours, theirs)


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


def _gloo_group():
    """A gloo process group for DDP's construction (its parameter broadcast)."""
    import torch.distributed as dist

    port = free_port_from_rank0("psgd.ddp.port")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port,
                            rank=hvd.rank(), world_size=hvd.size())


def test_the_ddp_hook_reduces_each_parameter_in_its_shape():
    """DDP's bucket is flat; under powersgd the hook hands the core each gradient in its
    parameter's shape. One sample per rank makes each rank's weight gradient of rank 1, so the
    average (rank <= 4) comes back exact: the model follows one process on the whole batch,
    step after step (bucket rebuilds included), and the weight travels as its factors."""
    import copy

    import torch.distributed as dist

    me, n = hvd.rank(), hvd.size()
    _gloo_group()
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 48)
    ref = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(hvd.DDPHookState(compression=hvd.Compression.powersgd),
                           hvd.ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def sample(rank, step):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(1, 20, generator=g), torch.randn(1, 48, generator=g)

    try:
        for step in range(4):
            before = hvd.metrics()["wire_powersgd"]
            opt.zero_grad()
            x, y = sample(me, step)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            # the 48 x 20 weight as (48 + 20) x 4 values of f32; the bias as it is
            assert hvd.metrics()["wire_powersgd"] - before == (48 + 20) * 4 * 4
            ref_opt.zero_grad()
            xs, ys = zip(*[sample(q, step) for q in range(n)])
            torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
            ref_opt.step()
            for a, b in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-4, atol=1e-4)
    finally:
        dist.destroy_process_group()
