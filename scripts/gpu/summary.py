"""Joins ferrovod-bench gpu and torch_allreduce.py results (JSON lines) into the GPU tables, one
per np: busbw of ferrovod, raw NCCL (same process) and NCCL through PyTorch, and the ratios
(back to back, then one tensor at a time at 256 MiB); then the ResNet-50 set against one
allreduce, gossip against the allreduce, and the summary lines BENCHMARKS.md records."""
import json
import sys
from collections import defaultdict


def load(path):
    """Records by (kind, np, bytes); a record without bytes (gossip) is keyed by 0."""
    rows = defaultdict(dict)
    for line in open(path):
        line = line.strip()
        if line:
            r = json.loads(line)
            rows[(r["kind"], r["np"], r.get("bytes", 0))].update(r)
    return rows


def busbw(r, key):
    """GiB/s on the bus; at np 1, where nothing crosses one, the algorithm's bandwidth."""
    n = r["np"]
    bus = 2 * (n - 1) / n if n > 1 else 1.0
    return r["bytes"] / r[key] / 2**30 * bus if key in r else float("nan")


def report(rows):
    out, summary = [], []
    for np in sorted({np for (_, np, _) in rows}):
        out.append(f"# np={np}" + (" (no traffic: algorithm bandwidth, the host's part)" if np == 1 else ""))
        out.append(f"{'bytes':>11} {'ferrovod GiB/s':>15} {'NCCL GiB/s':>11} {'torch GiB/s':>12}"
                   f" {'fv/NCCL':>8} {'fv/torch':>9}")
        for (kind, n, nbytes), r in sorted(rows.items()):
            if kind != "sweep" or n != np:
                continue
            fv, raw, th = busbw(r, "ferrovod_s"), busbw(r, "nccl_s"), busbw(r, "torch_s")
            out.append(f"{nbytes:>11} {fv:>15.1f} {raw:>11.1f} {th:>12.1f} {fv / raw:>8.3f} {fv / th:>9.3f}")
            if nbytes == 256 << 20:
                summary.append(f"gpu np={np} 256MiB busbw ferrovod/torch = {fv / th:.3f}")
        for (kind, n, nbytes), r in sorted(rows.items()):
            if n != np:
                continue
            if kind == "single" and "ferrovod_s" in r:
                fv, raw, th = busbw(r, "ferrovod_s"), busbw(r, "nccl_s"), busbw(r, "torch_s")
                out.append(f"one tensor at a time, {nbytes} bytes: ferrovod {fv:.1f}, NCCL {raw:.1f},"
                           f" torch {th:.1f} GiB/s busbw (fv/NCCL {fv / raw:.3f}, fv/torch {fv / th:.3f})")
                summary.append(f"gpu np={np} 256MiB single-tensor busbw ferrovod/torch = {fv / th:.3f}")
            if kind == "resnet50" and "ferrovod_s" in r:
                out.append(
                    f"resnet50: {r.get('tensors', '?')} tensors, {nbytes} bytes: ferrovod {r['ferrovod_s'] * 1e6:.1f} us,"
                    f" one NCCL allreduce {r['nccl_s'] * 1e6:.1f} us,"
                    f" one torch allreduce {r.get('torch_s', float('nan')) * 1e6:.1f} us")
                summary.append(f"gpu np={np} resnet50 ferrovod/one-allreduce = {r['ferrovod_s'] / r['nccl_s']:.3f}")
            if kind == "resnet50_gossip":
                out.append(
                    f"resnet50 gossip: ferrovod {r['ferrovod_s'] * 1e6:.1f} us, NCCL send/recv"
                    f" {r['nccl_sendrecv_s'] * 1e6:.1f} us, ferrovod allreduce {r['ferrovod_allreduce_s'] * 1e6:.1f} us")
                summary.append(f"gpu np={np} resnet50 gossip/allreduce = "
                               f"{r['ferrovod_s'] / r['ferrovod_allreduce_s']:.3f}")
        out.append("")
    return "\n".join(out + summary)


if __name__ == "__main__":
    print(report(load(sys.argv[1])))
