"""The MXNet binding's overhead: ResNet-50's gradient set (161 float32 tensors, 97.5 MiB)
allreduced in place through `horovod.mxnet` (engine operations, then `mx.nd.waitall()`)
against the same tensors through ferrovod's C API directly (`ferrovod._core.enqueue` on NumPy
arrays, then every handle waited for), alternating, in one job:

    mpirun -np 2 .venv-mxnet/bin/python scripts/bench_mxnet.py [--steps 20] [--data FILE]

Prints the median seconds per step of each and their ratio (rank 0)."""

import argparse
import os
import sys
import time

import mxnet as mx
import numpy as np

import horovod.mxnet as hvd
from ferrovod import _core

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradient_shapes  # noqa: E402 (scripts/gradient_shapes.py)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(os.environ.get("FERROVOD_DATA_DIR", os.path.join(here, "..", "..", "shared", "data")),
                           "resnet50_grads.tsv")
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--data", default=default)
    args = p.parse_args()
    hvd.init()
    grads = gradient_shapes.load(args.data)
    nds = [mx.nd.ones(s) for _, s in grads]
    arrays = [np.ones(s, np.float32) for _, s in grads]
    names = ["bench.%s" % name for name, _ in grads]

    def engine():
        hvd.barrier()
        t = time.perf_counter()
        for nd, name in zip(nds, names):
            hvd.allreduce_(nd, name="mx." + name)
        mx.nd.waitall()
        return time.perf_counter() - t

    def capi():
        hvd.barrier()
        t = time.perf_counter()
        handles = [_core.enqueue(_core.ALLREDUCE, [a], ["c." + name], reduce_op=_core.AVERAGE,
                                 inplace=True) for a, name in zip(arrays, names)]
        for h in handles:
            h.wait()
        return time.perf_counter() - t

    for _ in range(3):
        engine()
        capi()
    mx_times, c_times = [], []
    for _ in range(args.steps):
        mx_times.append(engine())
        c_times.append(capi())
    if hvd.rank() == 0:
        m, c = float(np.median(mx_times)), float(np.median(c_times))
        total = sum(a.nbytes for a in arrays)
        print("# resnet50 gradient set: %d tensors, %d bytes, np=%d" % (len(arrays), total, hvd.size()))
        print("mxnet engine ops %.2f ms, C API directly %.2f ms, ratio %.3f" % (m * 1e3, c * 1e3, m / c))


if __name__ == "__main__":
    main()
