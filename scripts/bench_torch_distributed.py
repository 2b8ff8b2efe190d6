"""torch.distributed's `ferrovod` backend against `gloo` (or `nccl` on GPUs), in one job under
mpirun, the backends alternating round by round in the same processes:

  calls     the time of one blocking `all_reduce`, `all_gather_into_tensor` and
            `reduce_scatter_tensor` (float32, SUM) by size: the per-call cost of a process group
            written in Python, against gloo's or NCCL's C++ one;
  ddp       a DDP step whose gradients have the shapes of a gradient set (ResNet-50 by default,
            FERROVOD_DATA_DIR/resnet50_grads.tsv): backward of a loss that touches every
            parameter once, so the step is DDP's bucketed allreduces and their wait;
  fsdp      (with --only fsdp) a training step of a GPT-2-small-sized transformer (12 layers,
            width 768, vocabulary 50,257, 124 M parameters) sharded by FSDP2's `fully_shard`
            per layer: its all_gather_into_tensor and reduce_scatter_tensor calls under compute.

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


def call_ops(device, n, world):
    """One blocking call of each kind on n bytes of float32 per rank, as FSDP and DDP issue
    them: all_reduce in place; all_gather_into_tensor and reduce_scatter_tensor between flat
    tensors, on a side stream on CUDA (FSDP's all-gather and reduce-scatter streams)."""
    x = torch.ones(n // 4, device=device)
    gathered = torch.empty(world * (n // 4), device=device)
    whole = torch.ones(world * (n // 4), device=device)
    part = torch.empty(n // 4, device=device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def on_side(f):
        if side is None:
            return f

        def call():
            with torch.cuda.stream(side):
                f()
        return call

    return {"all_reduce": lambda: dist.all_reduce(x),
            "all_gather_into_tensor": on_side(lambda: dist.all_gather_into_tensor(gathered, x)),
            "reduce_scatter_tensor": on_side(lambda: dist.reduce_scatter_tensor(part, whole))}


def time_calls(device, sizes, reps):
    """{(op, bytes): seconds per call}, the device done at the end."""
    out = {}
    for n in sizes:
        for op, call in call_ops(device, n, dist.get_world_size()).items():
            for _ in range(3):
                call()
            sync(device)
            dist.barrier()
            t = time.perf_counter()
            for _ in range(reps):
                call()
            sync(device)
            out[(op, n)] = (time.perf_counter() - t) / reps
    return out


def median_step(device, steps, step_fn, warmup=3):
    """The median time of `step_fn()` over `steps` steps after `warmup`, each started together
    on every rank (a barrier) and ended when the device is done."""
    times = []
    for step in range(steps + warmup):
        sync(device)
        dist.barrier()
        t = time.perf_counter()
        step_fn()
        sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_ddp(device, dims, steps, bucket_mb):
    torch.manual_seed(0)
    model = Grads(dims).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_mb)
    x = torch.ones(1, device=device)
    return median_step(device, steps, lambda: ddp(x).backward())


class Gpt(torch.nn.Module):
    """GPT-2 small's sizes (pre-norm causal transformer, tied embedding) from torch.nn alone."""

    def __init__(self, vocab=50257, width=768, layers=12, heads=12, seq=1024):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.zeros(seq, width))
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, ids):
        n = ids.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        h = self.embed(ids) + self.pos[:n]
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        logits = self.norm(h) @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def time_fsdp(device, steps, batch, seq, bf16):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Gpt().to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, 50257, (batch, seq), generator=g).to(device)

    def step():
        model(ids).backward()
        opt.step()
        opt.zero_grad()

    median = median_step(device, steps, step)
    del model, opt
    return median


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
    ap.add_argument("--only", choices=["calls", "ddp", "fsdp"], default=None)
    ap.add_argument("--batch", type=int, default=8, help="fsdp: sequences per rank")
    ap.add_argument("--seq", type=int, default=1024, help="fsdp: tokens per sequence")
    ap.add_argument("--bf16", action="store_true", help="fsdp: bf16 parameters, fp32 reduction")
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
    results = {b: {"calls": [], "ddp": [], "fsdp": []} for b in ("ferrovod", other)}
    for _ in range(a.rounds):
        for b in ("ferrovod", other):
            dist.init_process_group(b)
            if a.only in (None, "calls"):
                results[b]["calls"].append(time_calls(device, sizes, a.reps))
            if a.only in (None, "ddp"):
                results[b]["ddp"].append(time_ddp(device, dims, a.steps, a.bucket_mb))
            if a.only == "fsdp":
                results[b]["fsdp"].append(time_fsdp(device, a.steps, a.batch, a.seq, a.bf16))
            n = dist.get_world_size()
            dist.destroy_process_group()
    if rank != 0:
        return
    print("# torch.distributed, np=%d, %s: ferrovod against %s, median of %d rounds"
          % (n, a.device, other, a.rounds))
    for key in sorted(results["ferrovod"]["calls"][0]) if a.only in (None, "calls") else []:
        op, size = key
        f = statistics.median(r[key] for r in results["ferrovod"]["calls"])
        o = statistics.median(r[key] for r in results[other]["calls"])
        print("%-22s %9d B: ferrovod %9.1f us, %s %9.1f us, ratio %.3f" % (op, size, f * 1e6, other, o * 1e6, f / o))
        print("JSON " + json.dumps({"kind": "torch_dist_call", "op": op, "np": n, "device": a.device,
                                    "bytes": size, "ferrovod_s": f, "other": other, "other_s": o}))
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
    if a.only == "fsdp":
        f = statistics.median(results["ferrovod"]["fsdp"])
        o = statistics.median(results[other]["fsdp"])
        # a step's time, so the throughput ratio ferrovod/other is other's time / ferrovod's
        print("fsdp step (GPT-2 small, %d x %d tokens per rank, %s): ferrovod %.2f ms, %s %.2f ms"
              % (a.batch, a.seq, "bf16" if a.bf16 else "fp32", f * 1e3, other, o * 1e3))
        print("each round (ms): ferrovod %s, %s %s" % (
            " ".join("%.2f" % (t * 1e3) for t in results["ferrovod"]["fsdp"]), other,
            " ".join("%.2f" % (t * 1e3) for t in results[other]["fsdp"])))
        print("%s np=%d fsdp-train ferrovod/%s = %.3f%s (throughput)" % (
            "gpu" if a.device == "cuda" else "cpu", n, other, o / f, " (bf16)" if a.bf16 else ""))
        print("JSON " + json.dumps({"kind": "torch_dist_fsdp", "np": n, "device": a.device, "bf16": a.bf16,
                                    "ferrovod_s": f, "other": other, "other_s": o}))


if __name__ == "__main__":
    main()
