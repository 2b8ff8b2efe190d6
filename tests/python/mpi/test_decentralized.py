"""Multistep, local SGD and gossip from TensorFlow (ferrovod extensions, carried by the core),
under mpirun: the ops against references each rank computes itself, then training of an MLP on
scikit-learn's digits with each mode against plain allreduce training (same seeds, epochs)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import ferrovod.tensorflow as fv  # noqa: E402
from ferrovod import _core  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def initialized():
    fv.init()
    yield
    fv.barrier()


def values(r, k, n=37):
    return np.array([((i * 31 + r * 17 + k * 13) % 97) / 7.0 - 6.0 for i in range(n)], np.float32)


def test_gossip_averages_with_the_hypercube_or_tournament_peer():
    me, n = fv.rank(), fv.size()
    # round 0 of a fresh name: the first hypercube dimension on powers of two
    peer = me ^ 1 if n & (n - 1) == 0 else None
    a = tf.constant(values(me, 0))
    b = tf.constant(values(me, 1, 5).astype(np.float64))
    # one dtype per grouped op, as Horovod's grouped ops
    out = fv.gossip([a], name="t.gossip") + fv.gossip([b], name="t.gossip64")
    if peer is not None:
        np.testing.assert_array_equal(out[0].numpy(), (values(me, 0) + values(peer, 0)) * np.float32(0.5))
        np.testing.assert_array_equal(
            out[1].numpy(), (values(me, 1, 5).astype(np.float64) + values(peer, 1, 5)) * 0.5)
    # the sum over the ranks is kept whatever the schedule
    total = fv.allreduce(out[0], op=fv.Sum, name="t.gossip.sum").numpy()
    np.testing.assert_allclose(total, sum(values(r, 0) for r in range(n)), rtol=1e-5, atol=1e-5)


def test_gossip_of_integers_is_refused():
    # the TensorFlow op admits floating types only; the core refuses integers from C too
    with pytest.raises((TypeError, ValueError, tf.errors.InvalidArgumentError)):
        fv.gossip([tf.constant([1, 2], tf.int64)], name="t.gossip.int")
    with pytest.raises(_core.InvalidArgumentError, match="floating-point tensors only"):
        _core.enqueue(_core.GOSSIP, [np.array([1, 2], np.int64)], ["t.gossip.int"])


def test_multistep_accumulates_and_says_when_it_communicated():
    me, n = fv.rank(), fv.size()
    sums = np.zeros(37, np.float32)
    for call in range(6):
        x = values(me, call)
        sums = x if call % 3 == 0 else sums + x
        out, sent = fv.multistep_allreduce([tf.constant(x)], every=3, name="t.ms", op=fv.Sum)
        assert bool(sent) == (call % 3 == 2), call
        if not sent:
            np.testing.assert_array_equal(out[0].numpy(), x)
            continue
        # bit for bit a plain allreduce of this rank's f32 sum of the three calls
        ref = fv.allreduce(tf.constant(sums), op=fv.Sum, name="t.ms.ref").numpy()
        np.testing.assert_array_equal(out[0].numpy(), ref)
        exact = sum(sum(values(r, c) for c in range(call - 2, call + 1)).astype(np.float64)
                    for r in range(n))
        np.testing.assert_allclose(out[0].numpy(), exact, rtol=1e-5, atol=1e-5)


def test_core_multistep_out_of_place():
    # the numpy core: a call that does not communicate hands back its input
    me, n = fv.rank(), fv.size()
    a = values(me, 0)
    h = _core.enqueue(_core.ALLREDUCE, [a], ["t.core.ms"], reduce_op=_core.SUM, multistep=2)
    out = h.wait()[0]
    assert h.communicated is False
    np.testing.assert_array_equal(out, a)
    h = _core.enqueue(_core.ALLREDUCE, [a], ["t.core.ms"], reduce_op=_core.SUM, multistep=2)
    out = h.wait()[0]
    assert h.communicated is True
    np.testing.assert_allclose(out, 2 * sum(values(r, 0) for r in range(n)), rtol=1e-5, atol=1e-5)


def test_local_sgd_averages_every_kth_call_after_its_warmup():
    me, n = fv.rank(), fv.size()
    v = tf.Variable(values(me, 0))
    local = fv.LocalSGD(every=3, warmup=1, name="t.local")
    averaged = []
    for call in range(5):
        v.assign(values(me, call))
        averaged.append(bool(local([v])))
        want = np.mean([values(r, call) for r in range(n)], axis=0) if averaged[-1] else values(me, call)
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-6, atol=1e-6)
    assert averaged == [True, False, False, True, False]


# ---------------------------------------------------------------------------------------------
# training

EPOCHS, BATCH, LR = 40, 16, 0.05


def digits_shard():
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    me, n = fv.rank(), fv.size()
    # as many steps on every rank: the smallest shard's batches
    steps = (len(x_train) // n) // BATCH
    return x_train[me::n], y_train[me::n], x_test, y_test, steps


def train(mode):
    """Test accuracy averaged over the ranks, each evaluating its own model, and how far the
    ranks' models are apart (the largest distance of a weight from its mean over the ranks)."""
    x, y, x_test, y_test, steps = digits_shard()
    keras.utils.set_random_seed(1234)
    model = keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    opt = keras.optimizers.SGD(learning_rate=LR, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    fv.broadcast_variables(variables, root_rank=0)
    local_sgd = fv.LocalSGD(every=4, name="train.%s" % mode)
    gossip = fv.GossipAveraging(compression="fp16" if mode == "gossip-fp16" else "none",
                                name="train.%s" % mode)
    # the model's arithmetic traced once (eager Keras spent most of the time per step on
    # Python); ferrovod's calls stay eager, as a training loop around a compiled step makes them
    @tf.function
    def gradients(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        return tape.gradient(loss, variables)

    @tf.function
    def apply(grads):
        opt.apply_gradients(zip(grads, variables))

    rng = np.random.RandomState(fv.rank())
    for epoch in range(EPOCHS):
        order = rng.permutation(len(x))
        for s in range(steps):
            idx = order[s * BATCH:(s + 1) * BATCH]
            grads = gradients(x[idx], y[idx])
            if mode == "allreduce":
                grads = fv.grouped_allreduce(grads, op=fv.Average, name="train.grads")
                apply(grads)
            elif mode == "multistep4":
                grads, sent = fv.multistep_allreduce(grads, every=4, name="train.ms", op=fv.Average)
                if bool(sent):
                    apply([g / 4.0 for g in grads])
            else:
                apply(grads)
                if mode == "localsgd4":
                    local_sgd(variables)
                elif mode != "local":
                    gossip(variables)
    logits = model(x_test, training=False)
    acc = float(np.mean(np.argmax(logits.numpy(), axis=1) == y_test))
    acc = float(fv.allreduce(tf.constant(acc), op=fv.Average, name="train.acc.%s" % mode))
    means = fv.grouped_allreduce(list(variables), op=fv.Average, name="train.mean.%s" % mode)
    apart = max(float(tf.reduce_max(tf.abs(v - m))) for v, m in zip(variables, means))
    apart = float(fv.allreduce(tf.constant(apart), op=fv.Max, name="train.apart.%s" % mode))
    return acc, apart


def test_every_mode_trains_within_two_percent_of_allreduce():
    if fv.size() != 4:
        pytest.skip("the training comparison runs at np 4, the setting its bound is stated for")
    plain, _ = train("allreduce")
    assert plain > 0.9, plain
    # without any communication the ranks' models end far apart: the modes must not
    _, alone = train("local")
    for mode in ("multistep4", "localsgd4", "gossip", "gossip-fp16"):
        acc, apart = train(mode)
        print("rank %d: %s %.4f (allreduce %.4f), models apart %.2e (alone %.2e)"
              % (fv.rank(), mode, acc, plain, apart, alone))
        assert abs(acc - plain) <= 0.02, (mode, acc, plain)
        assert apart < alone / 4, (mode, apart, alone)
