"""Median ResNet-50 ratio (and step / one-allreduce time) per variant of scripts/gpu/ab.sh."""
import collections
import re
import statistics
import sys

ratios = collections.defaultdict(list)
times = collections.defaultdict(lambda: ([], []))
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) < 3 or parts[1] != "ratio":
        continue
    ratios[parts[0]].append(float(parts[2]))
    fv = re.search(r"ferrovod ([0-9.]+) us", line)
    one = re.search(r"one NCCL allreduce ([0-9.]+) us", line)
    if fv and one:
        times[parts[0]][0].append(float(fv.group(1)))
        times[parts[0]][1].append(float(one.group(1)))
for name, rs in ratios.items():
    fv, one = times[name]
    extra = f" | step {statistics.median(fv):.0f} us, one allreduce {statistics.median(one):.0f} us" if fv else ""
    print(f"{name:45s} median {statistics.median(rs):.3f}{extra}  runs {' '.join(f'{r:.3f}' for r in rs)}")
