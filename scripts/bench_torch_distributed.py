"""torch.distributed's `ferrovod` backend against `gloo` (or `nccl` on GPUs), in one job under
mpirun, the backends alternating round by round in the same processes:

  calls     the time of one `all_reduce` (SUM, float32) by size, blocking: the per-call cost of
            a process group written in Python, against gloo's C++ one;
  ddp       a DDP step whose gradients have the shapes of a gradient set (ResNet-50 by default,
            FERROVOD_DATA_DIR/resnet50_grads.tsv): backward of a loss that touches every
            parameter once, so the step is DDP's bucketed allreduces and their wait.

Prints `JSON {...}` lines and, on rank 0, the ratios ferrovod/<other>. Run with
  mpirun -np 2 python scripts/bench_torch_distributed.py [--device cuda] [--rounds 3]
(the store is bootstrapped over MPI for both backends: no MASTER_ADDR needed)."""

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

import ferrovod.torch  # noqa: F401 (registers the backend)


def shapes(path):
    out = []
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        name, dims = line.split("\t")
        out.append((name, [int(d) for d in dims.strip().split("x")]))
    return out


class Grads(torch.nn.Module):
    """Parameters of the given shapes; forward returns a scalar that reaches each once."""

    def __init__(self, dims):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(d)) for d in dims)

    def forward(self, x):
        return sum((p.reshape(-1)[:1] * x).sum() for p in self.ps)


def gloo_interface():
    """Gloo binds to the address the host name resolves to; on emulated hosts (network
    namespaces, scripts/hosts) that is loopback, so name the first interface with another IPv4
    address unless GLOO_SOCKET_IFNAME says."""
    import fcntl
    import socket
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        if not socket.inet_ntoa(packed[20:24]).startswith("127."):
            return name
    return None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(device, sizes, reps):
    out = {}
    for n in sizes:
        x = torch.ones(n // 4, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        sync(device)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        sync(device)
        out[n] = (time.perf_counter() - t) / reps
    return out


def time_ddp(device, dims, steps, bucket_mb):
    torch.manual_seed(0)
    model = Grads(dims).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_mb)
    x = torch.ones(1, device=device)
    times = []
    for step in range(steps + 3):
        sync(device)
        dist.barrier()
        t = time.perf_counter()
        ddp(x).backward()
        sync(device)
        if step >= 3:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--other", default=None, help="gloo (CPU) or nccl (CUDA)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--grads", default=os.path.join(os.environ.get("FERROVOD_DATA_DIR", "../shared/data"),
                                                   "resnet50_grads.tsv"))
    ap.add_argument("--only", choices=["calls", "ddp"], default=None)
    a = ap.parse_args()
    other = a.other or ("nccl" if a.device == "cuda" else "gloo")
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    device = torch.device("cpu")
    if a.device == "cuda":
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    if other == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and gloo_interface():
        os.environ["GLOO_SOCKET_IFNAME"] = gloo_interface()
    dims = [d for _, d in shapes(a.grads)]
    nbytes = sum(4 * math.prod(d) for d in dims)
    sizes = [4, 4 << 10, 1 << 20, 16 << 20]
    results = {b: {"calls": [], "ddp": []} for b in ("ferrovod", other)}
    for _ in range(a.rounds):
        for b in ("ferrovod", other):
            dist.init_process_group(b)
            if a.only in (None, "calls"):
                results[b]["calls"].append(time_calls(device, sizes, a.reps))
            if a.only in (None, "ddp"):
                results[b]["ddp"].append(time_ddp(device, dims, a.steps, a.bucket_mb))
            n = dist.get_world_size()
            dist.destroy_process_group()
    if rank != 0:
        return
    print("# torch.distributed, np=%d, %s: ferrovod against %s, median of %d rounds"
          % (n, a.device, other, a.rounds))
    for size in sizes if a.only in (None, "calls") else []:
        f = statistics.median(r[size] for r in results["ferrovod"]["calls"])
        o = statistics.median(r[size] for r in results[other]["calls"])
        print("all_reduce %9d B: ferrovod %9.1f us, %s %9.1f us, ratio %.3f" % (size, f * 1e6, other, o * 1e6, f / o))
        print("JSON " + json.dumps({"kind": "torch_dist_call", "np": n, "device": a.device, "bytes": size,
                                    "ferrovod_s": f, "other": other, "other_s": o}))
    if a.only in (None, "ddp"):
        f = statistics.median(results["ferrovod"]["ddp"])
        o = statistics.median(results[other]["ddp"])
        print("ddp step (%d tensors, %d bytes, %.0f MB buckets): ferrovod %.2f ms, %s %.2f ms, ratio %.3f"
              % (len(dims), nbytes, a.bucket_mb, f * 1e3, other, o * 1e3, f / o))
        print("each round (ms): ferrovod %s, %s %s" % (
            " ".join("%.2f" % (t * 1e3) for t in results["ferrovod"]["ddp"]), other,
            " ".join("%.2f" % (t * 1e3) for t in results[other]["ddp"])))
        print("JSON " + json.dumps({"kind": "torch_dist_ddp", "np": n, "device": a.device, "bytes": nbytes,
                                    "ferrovod_s": f, "other": other, "other_s": o}))


if __name__ == "__main__":
    main()
