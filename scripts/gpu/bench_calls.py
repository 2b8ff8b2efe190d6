"""The host time of one blocking torch.distributed call on the `ferrovod` backend, against
`hvd.allreduce_` of the same tensor in the same process: a loop of calls on the current CUDA
stream, as a training step issues them, after a warm-up, timed between two device
synchronisations. At np 1 there is no traffic: what is measured is the calls' host part.

  mpirun -np 1 --bind-to none -x NCCL_NVLS_ENABLE python3 scripts/gpu/bench_calls.py [--calls N]

`--device cpu` times the same calls on host tensors (no CUDA needed); `--side-stream` makes the
calls on a stream of their own (a non-blocking one, where FERROVOD_TORCH_DEVICE_WAIT=1 leaves
the waiting to the device; the default stream always waits on the host).
"""
import argparse
import contextlib
import time

import torch
import torch.distributed as dist

import ferrovod.torch as hvd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--side-stream", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("ferrovod")
    on_gpu = args.device == "cuda"
    dev = torch.device("cuda", hvd.local_rank()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    x = torch.ones(args.bytes // 4, device=dev)
    out = torch.empty(x.numel() * dist.get_world_size(), device=dev)
    calls = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(x, out),
        "hvd.allreduce_": lambda: hvd.allreduce_(x, name="bench_calls.x"),
    }
    side = torch.cuda.stream(torch.cuda.Stream()) if args.side_stream else contextlib.nullcontext()
    for name, call in calls.items():
        with side:
            for _ in range(args.calls // 10):
                call()
            sync()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            sync()
        us = (time.perf_counter() - start) / args.calls * 1e6
        if dist.get_rank() == 0:
            print("%-24s %8.1f us per call" % (name, us), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
