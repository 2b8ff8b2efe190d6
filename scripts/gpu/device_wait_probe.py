"""Which CUDA calls wait for a stream that waits on the device (FERROVOD_TORCH_DEVICE_WAIT)? Each
probe: an all_reduce left to the device on a side stream (its launch 300 ms late by the test
fault), then one call on the host; a call that takes about 300 ms waited for the whole device,
so ferrovod's launching thread must not make it while such a wait is outstanding.

  FERROVOD_TEST_FAULT=slow_gpu_launch:0 FERROVOD_TORCH_DEVICE_WAIT=1 CUDA_MODULE_LOADING=EAGER \
    mpirun -np 1 --bind-to none -x NCCL_NVLS_ENABLE -x FERROVOD_TEST_FAULT \
    -x FERROVOD_TORCH_DEVICE_WAIT -x CUDA_MODULE_LOADING python3 scripts/gpu/device_wait_probe.py
"""
import time
import torch
import torch.distributed as dist
import ferrovod.torch as hvd

hvd.init()
torch.cuda.set_device(0)
dist.init_process_group("ferrovod")
x = torch.ones(4, device="cuda")
with torch.cuda.stream(torch.cuda.Stream()):
    dist.all_reduce(x)
torch.cuda.synchronize()
keep = []


def probe(name, fn):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = torch.ones(1000, device="cuda")
        t0 = time.perf_counter()
        dist.all_reduce(y)
        t1 = time.perf_counter()
        keep.append(fn())
        t2 = time.perf_counter()
    s.synchronize()
    assert y[0].item() == 1.0
    print("%-40s call %6.1f ms, then %6.1f ms" % (name, 1e3 * (t1 - t0), 1e3 * (t2 - t1)), flush=True)


probe("nothing", lambda: None)
probe("pinned host alloc (cudaHostAlloc)", lambda: torch.empty(3_000_017, dtype=torch.uint8, pin_memory=True))
probe("pinned host alloc again", lambda: torch.empty(5_000_011, dtype=torch.uint8, pin_memory=True))
probe("device alloc 1 GiB (cudaMalloc)", lambda: torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
keep.clear()
probe("empty_cache (cudaFree)", torch.cuda.empty_cache)
probe("stream create", lambda: torch.cuda.Stream())
probe("event create", lambda: torch.cuda.Event())
probe("event create, timing", lambda: torch.cuda.Event(enable_timing=True))
probe("mem_get_info", torch.cuda.mem_get_info)
buf = torch.empty(1 << 20, dtype=torch.uint8)
probe("host register", lambda: torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), 1 << 20, 0))
print("done", flush=True)
