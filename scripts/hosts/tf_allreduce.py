"""A Horovod-style TensorFlow step that allreduces the ResNet-50 gradient set, for comparing
engines on emulated hosts: the same file runs on Horovod (its own environment) and on ferrovod's
drop-in (the project's .venv), both imported as `horovod.tensorflow`.

    bash scripts/hosts/run.sh 2 1 1gbit -x PATH python3 scripts/hosts/tf_allreduce.py \
        [--data ../shared/data/resnet50_grads.tsv] [--steps 8] [--warmup 2]

Each step averages every gradient with `hvd.allreduce` inside one `tf.function`, in backward
order, as Horovod's DistributedOptimizer does; rank 0 prints the engine, the step times and the
link's limit for the bytes, and checks the averages against the ranks' known inputs.
"""

import argparse
import importlib.util
import os
import sys
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gradient_shapes  # noqa: E402 (scripts/gradient_shapes.py)


def main():
    p = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--data", default=os.path.join(here, "../../../shared/data/resnet50_grads.tsv"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rate-gbit", type=float, default=1.0, help="the link's rate, for the limit")
    a = p.parse_args()
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    # every element of rank r is r + 1 (+ a per-tensor offset): the average is known exactly
    grads = [
        tf.constant(np.full(s, r + 1 + (i % 3), dtype=np.float32), name=name.replace(".", "_"))
        for i, (name, s) in enumerate(gradient_shapes.load(a.data))
    ]
    nbytes = sum(int(np.prod(g.shape)) * 4 for g in grads)

    @tf.function
    def step(gs):
        return [hvd.allreduce(g, op=hvd.Average, name=f"grad.{i}") for i, g in enumerate(gs)]

    times = []
    for k in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        out = step(grads)
        out = [o.numpy() for o in out]  # the step ends when every average is on the host
        dt = time.perf_counter() - t0
        if k >= a.warmup:
            times.append(dt)
    want_base = (n + 1) / 2
    for i, o in enumerate(out):
        want = want_base + (i % 3)
        got = o.ravel()
        if not np.allclose(got, want, rtol=1e-6):
            raise SystemExit(f"rank {r}: tensor {i} averaged to {got[:4]}, want {want}")
    if r == 0:
        limit = 2 * (n - 1) / n * nbytes * 8 / (a.rate_gbit * 1e9)
        # ferrovod's drop-in lives beside the ferrovod package; Horovod's environment has none
        engine = "ferrovod" if importlib.util.find_spec("ferrovod") else "horovod"
        mean = sum(times) / len(times)
        print(
            f"tf_allreduce: engine {engine}, np={n}, {len(grads)} tensors, "
            f"{nbytes / 2**20:.1f} MiB per step; step mean {mean:.3f} s, min {min(times):.3f} s, "
            f"link limit {limit:.3f} s at {a.rate_gbit:g} Gbit/s; mean/limit {mean / limit:.3f}"
        )
        print("tf_allreduce steps (s): " + " ".join(f"{t:.3f}" for t in times))


if __name__ == "__main__":
    main()
