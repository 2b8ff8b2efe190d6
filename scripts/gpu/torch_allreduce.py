"""NCCL through PyTorch, the reference for ferrovod's GPU benchmark: in-place f32 sums of one
buffer, `iters` back to back then one synchronize (the same counts ferrovod-bench gpu uses),
1 MiB - 1 GiB (or the sizes given after the set's file), at 256 MiB also one at a time (each synchronized before the next); and one allreduce of the ResNet-50 gradient set's bytes (averaged). Medians of
repetitions; rank 0 prints one JSON object per line. Run under mpirun, one process per GPU."""
import json, os, statistics, sys, time

import torch
import torch.distributed as dist

rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
torch.cuda.set_device(local % torch.cuda.device_count())
dist.init_process_group("nccl", rank=rank, world_size=size, device_id=torch.device("cuda", local % torch.cuda.device_count()))
REPS = 5


def iters_for(nbytes):
    return max(10, min(50, -(-(1 << 30) // nbytes)))


def timed(t, iters, op=dist.ReduceOp.SUM, one_at_a_time=False):
    """Seconds for `iters` allreduces back to back, or one at a time (each synchronized
    before the next)."""
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, op=op)
        if one_at_a_time:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return time.perf_counter() - start


# the size whose one-at-a-time figure ferrovod-bench gpu adds too
SINGLE_BYTES = 256 << 20
# the sweep's sizes: 1 MiB - 1 GiB, or the two given after the gradient set's file
lo, hi = (int(a) for a in sys.argv[2:4]) if len(sys.argv) > 3 else (1 << 20, 1 << 30)
buf = torch.zeros(hi // 4, dtype=torch.float32, device="cuda")
nbytes = lo
while nbytes <= hi:
    t = buf[: nbytes // 4]
    iters = iters_for(nbytes)
    timed(t, iters)
    s = statistics.median(timed(t, iters) / iters for _ in range(REPS))
    if rank == 0:
        print("JSON " + json.dumps({"kind": "sweep", "np": size, "bytes": nbytes, "torch_s": s}))
    if nbytes == SINGLE_BYTES:
        timed(t, iters, one_at_a_time=True)
        s = statistics.median(timed(t, iters, one_at_a_time=True) / iters for _ in range(REPS))
        if rank == 0:
            print("JSON " + json.dumps({"kind": "single", "np": size, "bytes": nbytes, "torch_s": s}))
    nbytes *= 2
del buf

total = 0
for line in open(sys.argv[1]):
    if line.startswith("#") or not line.strip():
        continue
    n = 1
    for d in line.split("\t")[1].strip().split("x"):
        n *= int(d)
    total += n
flat = torch.zeros(total, dtype=torch.float32, device="cuda")
avg = dist.ReduceOp.AVG
for _ in range(5):
    timed(flat, 1, avg)
s = statistics.median(timed(flat, 1, avg) for _ in range(max(REPS, 10)))
if rank == 0:
    print("JSON " + json.dumps({"kind": "resnet50", "np": size, "bytes": total * 4, "torch_s": s}))
dist.destroy_process_group()
