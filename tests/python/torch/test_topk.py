"""Top-k through horovod.torch under mpirun (CPU tensors): an allreduce sums every rank's
largest values (1 % by default) and keeps the rest for the next call, against a NumPy
reference; the wire counter moves by the pairs' bytes."""

import numpy as np
import pytest
import torch

import horovod.torch as hvd


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvd.init()
    yield


def test_the_largest_values_are_summed_and_the_rest_kept_for_the_next_call():
    me, n = hvd.rank(), hvd.size()
    length, k = 1000, 10
    grads = [np.random.RandomState(100 * s + r).standard_normal(length).astype(np.float32)
             for s in range(3) for r in range(n)]
    residual = [np.zeros(length, np.float64) for _ in range(n)]
    for step in range(3):
        before = hvd.metrics()["wire_topk"]
        got = hvd.allreduce(torch.from_numpy(grads[step * n + me].copy()), name="topk.v",
                            op=hvd.Sum, compression=hvd.Compression.topk)
        want = np.zeros(length)
        for r in range(n):
            acc = grads[step * n + r].astype(np.float64) + residual[r]
            # the k largest magnitudes, ties to the lower index
            sent = sorted(range(length), key=lambda i: (-abs(acc[i]), i))[:k]
            want[sent] += acc[sent]
            acc[sent] = 0.0
            residual[r] = acc
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
        assert hvd.metrics()["wire_topk"] - before == k * 8

