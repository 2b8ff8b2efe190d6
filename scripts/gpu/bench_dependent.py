"""Collectives that depend on each other, on GPUs: the time per iteration of two allreduces
where the second's input is computed from the first's result (under different names, on new
tensors each time, through horovod.torch's API), of the same through torch.distributed (one
name), and of DDP's step on a one-weight model followed by `dist.all_reduce` of its gradient, on
the default stream and on a side stream. 20 timed iterations after 12 warm-up ones.

    mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE python3 scripts/gpu/bench_dependent.py
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn

import ferrovod.torch as hvd

hvd.init()
torch.cuda.set_device(hvd.local_rank())
dist.init_process_group("ferrovod")
r = dist.get_rank()
d = torch.device("cuda", torch.cuda.current_device())


def timed(label, fn, n=20):
    for _ in range(12):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    if r == 0:
        print("%-40s %10.1f us" % (label, (time.perf_counter() - t) / n * 1e6), flush=True)


net = nn.parallel.DistributedDataParallel(nn.Linear(1, 1, bias=False).to(d), device_ids=[d.index])


def ddp_then_all_reduce():
    net(torch.tensor([float(r)], device=d)).sum().backward()
    a = net.module.weight.grad.clone()
    dist.all_reduce(a)


def two_dist():
    a = torch.ones(3, device=d)
    dist.all_reduce(a)
    dist.all_reduce(a * 2)


def two_hvd():
    a = torch.ones(3, device=d)
    hvd.allreduce_(a, name="first")
    hvd.allreduce_(a * 2, name="second")


timed("default: ddp step + all_reduce", ddp_then_all_reduce)
timed("default: two dependent all_reduces", two_dist)
timed("default: two dependent hvd (moving)", two_hvd)
with torch.cuda.stream(torch.cuda.Stream(d)):
    timed("side: ddp step + all_reduce", ddp_then_all_reduce)
dist.destroy_process_group()
