"""Run under `mpirun -np 2` (and 4): the horovod.common API and ferrovod's Python core on numpy
arrays, checked against values each rank computes itself."""

import numpy as np
import pytest

from ferrovod import _core
from ferrovod.exceptions import InvalidArgumentError, PreconditionError
from horovod.common import process_sets as ps
from horovod.common.basics import HorovodBasics
from horovod.common.util import gpu_available
from horovod.runner.common.util.env import get_env_rank_and_size

hvd = HorovodBasics()


@pytest.fixture(scope="module", autouse=True)
def initialized():
    hvd.init()
    yield
    _core.enqueue(_core.BARRIER, [], []).wait()


def test_topology_matches_launcher():
    rank, size = get_env_rank_and_size()
    assert (hvd.rank(), hvd.size()) == (rank, size)
    assert hvd.local_rank() == rank and hvd.local_size() == size
    assert hvd.cross_rank() == 0 and hvd.cross_size() == 1
    assert hvd.is_homogeneous() and hvd.mpi_threads_supported() and hvd.mpi_built()
    assert hvd.nccl_built() == 0 and not hvd.gloo_built()
    assert gpu_available("tensorflow") is False  # the TensorFlow ops run on host memory
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64])
def test_allreduce_sum_and_average(dtype):
    r, n = hvd.rank(), hvd.size()
    x = (np.arange(12) % 5 + r).astype(dtype).reshape(3, 4)
    want = sum((np.arange(12) % 5 + k) for k in range(n)).reshape(3, 4)
    (got,) = _core.enqueue(_core.ALLREDUCE, [x], ["sum.%s" % np.dtype(dtype).name]).wait()
    np.testing.assert_array_equal(got, want.astype(dtype))
    (avg,) = _core.enqueue(_core.ALLREDUCE, [x], ["avg.%s" % np.dtype(dtype).name], reduce_op=_core.AVERAGE).wait()
    np.testing.assert_allclose(avg.astype(np.float64), np.trunc(want / n) if np.dtype(dtype).kind in "iu" else want / n, rtol=1e-3)


def test_allgather_alltoall_broadcast_reducescatter():
    r, n = hvd.rank(), hvd.size()
    (g,) = _core.enqueue(_core.ALLGATHER, [np.full((r + 1, 2), r, np.int32)], ["ag"]).wait()
    np.testing.assert_array_equal(g, np.concatenate([np.full((k + 1, 2), k, np.int32) for k in range(n)]))
    x = np.arange(n * 2, dtype=np.float32) + 100 * r
    ((a, splits),) = _core.enqueue(_core.ALLTOALL, [x], ["a2a"]).wait()
    np.testing.assert_array_equal(splits, np.full(n, 2))
    np.testing.assert_array_equal(a, np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * k for k in range(n)]).astype(np.float32))
    (b,) = _core.enqueue(_core.BROADCAST, [np.full(3, r, np.int64)], ["bc"], root_rank=n - 1).wait()
    np.testing.assert_array_equal(b, np.full(3, n - 1))
    rows = 2 * n + 1
    (rs,) = _core.enqueue(_core.REDUCESCATTER, [np.ones((rows, 2), np.float64)], ["rs"]).wait()
    assert rs.shape == (rows // n + (1 if r < rows % n else 0), 2)
    np.testing.assert_array_equal(rs, np.full(rs.shape, n))


def test_errors_map_to_exception_types():
    r = hvd.rank()
    with pytest.raises(PreconditionError, match="Mismatched ALLREDUCE tensor shapes"):
        _core.enqueue(_core.ALLREDUCE, [np.ones(r + 1, np.float32)], ["mismatch"]).wait()
    # "dup<r>" cannot complete before every rank submits it, and the other ranks submit it
    # only after the barrier, which rank r reaches after its duplicate attempt: the first one
    # is surely still in flight then
    n = hvd.size()
    mine = _core.enqueue(_core.ALLREDUCE, [np.ones(1, np.float32)], ["dup%d" % r])
    with pytest.raises(InvalidArgumentError, match="same name as another tensor"):
        _core.enqueue(_core.ALLREDUCE, [np.ones(1, np.float32)], ["dup%d" % r])
    _core.enqueue(_core.BARRIER, [], []).wait()
    others = [_core.enqueue(_core.ALLREDUCE, [np.ones(1, np.float32)], ["dup%d" % k])
              for k in range(n) if k != r]
    for h in [mine] + others:
        (x,) = h.wait()
        np.testing.assert_array_equal(x, [float(n)])
    with pytest.raises(InvalidArgumentError, match="not supported"):
        _core.enqueue(_core.ALLREDUCE, [np.array(["a"])], ["str"])


def test_process_sets():
    r, n = hvd.rank(), hvd.size()
    assert ps.global_process_set.ranks == list(range(n))
    assert ps.global_process_set.size() == n and ps.global_process_set.included()
    lower = ps.add_process_set([0])
    assert lower.process_set_id is not None and lower.ranks == [0]
    assert lower.included() == (r == 0)
    assert lower.rank() == (0 if r == 0 else -1)
    with pytest.raises(ValueError):
        ps.add_process_set(lower)
    table = hvd._get_process_set_ids_and_ranks()
    assert table == {0: list(range(n)), lower.process_set_id: [0]}
    if r == 0:
        (x,) = _core.enqueue(_core.ALLREDUCE, [np.ones(2, np.float32)], ["solo"], process_set=lower.process_set_id).wait()
        np.testing.assert_array_equal(x, np.ones(2))
    assert ps.remove_process_set(lower)
    assert lower.process_set_id is None
    assert not ps.remove_process_set(ps.global_process_set)
    assert hvd._get_process_set_ids_and_ranks() == {0: list(range(n))}


def test_join_returns_last_rank():
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        (x,) = _core.enqueue(_core.ALLREDUCE, [np.full(3, 5.0, np.float32)], ["joinee"]).wait()
        np.testing.assert_array_equal(x, np.full(3, 5.0))  # the joined ranks added zeros
    h = _core.enqueue(_core.JOIN, [], [])
    h.wait()


def test_metrics_count_this_process_traffic():
    before = hvd.metrics()
    assert set(before) == {"cycles", "control_collectives", "control_bytes", "negotiation_ns",
                           "data_collectives", "data_bytes", "fused_batches", "tensors",
                           "graph_launches", "wire_uncompressed", "wire_fp16", "wire_bf16",
                           "wire_u8", "wire_powersgd", "wire_topk"}
    hs = [_core.enqueue(_core.ALLREDUCE, [np.ones(25, np.float32)], ["metrics.%d" % k])
          for k in range(3)]
    for h in hs:
        h.wait()
    after = hvd.metrics()
    assert after["tensors"] - before["tensors"] == 3
    assert after["data_bytes"] - before["data_bytes"] == 3 * 25 * 4
    assert after["control_collectives"] > before["control_collectives"]
    assert after["cycles"] > before["cycles"]
    assert after["graph_launches"] == before["graph_launches"]  # host batches have no graphs
    assert after["wire_uncompressed"] - before["wire_uncompressed"] == 3 * 25 * 4


def test_an_allreduce_asks_for_its_own_compression():
    """fv_op.compression: f32 values travel as fp16 or bf16 (half the wire bytes, counted per
    codec), sums and averages within the 16-bit type's rounding of an f64 reference; other
    dtypes and ops travel as they are; ranks asking differently get a mismatch error."""
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((n, 3000)).astype(np.float32) * 10  # every rank's values
    exact = xs.astype(np.float64).sum(axis=0)
    for codec, key, eps in ((_core.COMPRESSION_FP16, "wire_fp16", 2.0 ** -11),
                            (_core.COMPRESSION_BF16, "wire_bf16", 2.0 ** -8)):
        for op, want in ((_core.SUM, exact), (_core.AVERAGE, exact / n)):
            before = hvd.metrics()
            (got,) = _core.enqueue(_core.ALLREDUCE, [xs[r]], ["own.%d.%d" % (codec, op)],
                                   reduce_op=op, compression=codec).wait()
            after = hvd.metrics()
            assert got.dtype == np.float32
            # each value rounded once, each of the n - 1 partial sums once
            bound = eps * n * (np.abs(xs).sum(axis=0) / (n if op == _core.AVERAGE else 1))
            assert np.all(np.abs(got - want) <= bound + 1e-6)
            assert not np.array_equal(got, want.astype(np.float32))  # it did travel rounded
            assert after[key] - before[key] == 3000 * 2
            assert after["wire_uncompressed"] == before["wire_uncompressed"]
    # f64 and a max are not compressed, whatever is asked
    before = hvd.metrics()
    (m,) = _core.enqueue(_core.ALLREDUCE, [xs[r]], ["own.max"], reduce_op=_core.MAX,
                         compression=_core.COMPRESSION_FP16).wait()
    np.testing.assert_array_equal(m, xs.max(axis=0))
    (d,) = _core.enqueue(_core.ALLREDUCE, [xs[r].astype(np.float64)], ["own.f64"],
                         compression=_core.COMPRESSION_FP16).wait()
    np.testing.assert_allclose(d, exact, rtol=1e-12)
    after = hvd.metrics()
    assert after["wire_fp16"] == before["wire_fp16"]
    assert after["wire_uncompressed"] - before["wire_uncompressed"] == 3000 * 4 + 3000 * 8
    with pytest.raises(PreconditionError, match="Mismatched compression"):
        _core.enqueue(_core.ALLREDUCE, [xs[r]], ["own.mismatch"],
                      compression=_core.COMPRESSION_FP16 if r == 0 else _core.COMPRESSION_JOB).wait()
    with pytest.raises(InvalidArgumentError, match="unknown compression 9"):
        _core.enqueue(_core.ALLREDUCE, [xs[r]], ["own.bad"], compression=9)


def test_an_operations_own_timeout_is_checked_and_healthy_calls_complete():
    """`timeout` (seconds the op may wait for the other ranks): calls every rank makes within it
    complete with the right values; values that are no length of time are refused at the call."""
    r, n = hvd.rank(), hvd.size()
    for step in range(3):
        (s,) = _core.enqueue(_core.ALLREDUCE, [np.full(4, r + 1.0, np.float32)], ["own.timed"],
                             timeout=30.0).wait()
        np.testing.assert_array_equal(s, np.full(4, n * (n + 1) / 2))
    for bad in (-1.0, float("nan"), float("inf"), 1e30):
        with pytest.raises(InvalidArgumentError, match="timeout"):
            _core.enqueue(_core.ALLREDUCE, [np.ones(2, np.float32)], ["own.bad.timeout"],
                          timeout=bad)


def test_dropped_handle_keeps_its_buffers_until_completion():
    """A handle dropped before its operation completes must not free the arrays ferrovod still
    writes: the in-flight registry holds them, and a later enqueue frees them once done."""
    import gc
    import time
    import weakref

    r, n = hvd.rank(), hvd.size()
    before = _core.in_flight_count()
    x = np.full(1 << 16, float(r + 1), dtype=np.float32)
    if r == 0:
        h = _core.enqueue(_core.ALLREDUCE, [x], ["dropped.handle"])
        out = h._outputs[0]
        alive = weakref.ref(out)
        del h, out, x
        gc.collect()
        # the other ranks submit only after this; the output must still be there
        assert alive() is not None
        assert _core.in_flight_count() == before + 1
        _core.enqueue(_core.BARRIER, [], []).wait()
        # completes once the others submitted; then the next enqueue's sweep releases it
        deadline = time.time() + 30
        while alive() is not None and time.time() < deadline:
            _core._sweep_orphans()
            gc.collect()
            time.sleep(0.01)
        assert alive() is None
        assert _core.in_flight_count() == before
    else:
        _core.enqueue(_core.BARRIER, [], []).wait()
        (got,) = _core.enqueue(_core.ALLREDUCE, [x], ["dropped.handle"]).wait()
        np.testing.assert_array_equal(got, np.full(1 << 16, n * (n + 1) / 2, dtype=np.float32))
