"""A wait left to the device under lazy kernel loading (FERROVOD_TORCH_DEVICE_WAIT=force) with
rank 0's launch late (FERROVOD_TEST_FAULT=slow_gpu_launch:0): the first use of a kernel after
the call loads it with the device synchronised, which the waiting stream holds up, and the
launch waits behind that load. ferrovod's watch must end the process after the stall limit,
saying why; scripts/gpu/torch.sh checks the message and the exit status. Printing the last line
would mean the deadlock did not happen (the check then fails: it expects the abort)."""

import torch
import torch.distributed as dist

from test_device_wait import start  # this folder is the script's: first on sys.path

start()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    y = torch.full((1000,), 1.0, device="cuda")
    dist.all_reduce(y)
    z = torch.sin(y)  # a kernel not loaded before
s.synchronize()
print("no deadlock: sin(%d) = %f" % (dist.get_world_size(), z[0].item()), flush=True)
