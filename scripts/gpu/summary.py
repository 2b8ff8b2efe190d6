"""Joins ferrovod-bench gpu and torch_allreduce.py results (JSON lines) into the GPU table:
busbw of ferrovod, raw NCCL (same process) and NCCL through PyTorch, and the ratios, then the
ResNet-50 set against one allreduce, and the summary lines BENCHMARKS.md records."""
import json, sys
from collections import defaultdict

rows = defaultdict(dict)
for line in open(sys.argv[1]):
    line = line.strip()
    if line:
        r = json.loads(line)
        rows[(r["kind"], r["np"], r["bytes"])].update(r)


def busbw(r, key):
    n = r["np"]
    return r["bytes"] / r[key] / 2**30 * 2 * (n - 1) / n if key in r else float("nan")


print(f"{'np':>3} {'bytes':>11} {'ferrovod GiB/s':>15} {'NCCL GiB/s':>11} {'torch GiB/s':>12} {'fv/NCCL':>8} {'fv/torch':>9}")
for (kind, np, nbytes), r in sorted(rows.items()):
    if kind != "sweep":
        continue
    fv, raw, th = busbw(r, "ferrovod_s"), busbw(r, "nccl_s"), busbw(r, "torch_s")
    print(f"{np:>3} {nbytes:>11} {fv:>15.1f} {raw:>11.1f} {th:>12.1f} {fv / raw:>8.3f} {fv / th:>9.3f}")
print()
summary = []
for (kind, np, nbytes), r in sorted(rows.items()):
    if kind == "sweep" and nbytes == 256 << 20:
        summary.append(f"gpu np={np} 256MiB busbw ferrovod/torch = {busbw(r, 'ferrovod_s') / busbw(r, 'torch_s'):.3f}")
    if kind == "resnet50":
        print(
            f"resnet50 np={np}: {r.get('tensors', '?')} tensors, {nbytes} bytes: ferrovod {r['ferrovod_s'] * 1e6:.1f} us,"
            f" one NCCL allreduce {r['nccl_s'] * 1e6:.1f} us, one torch allreduce {r.get('torch_s', float('nan')) * 1e6:.1f} us"
        )
        summary.append(f"gpu np={np} resnet50 ferrovod/one-allreduce = {r['ferrovod_s'] / r['nccl_s']:.3f}")
print()
print("\n".join(summary))
