"""Local gradient aggregation (Horovod's `backward_passes_per_step`): gradients are summed on
each rank over several backward passes and allreduced once, on the last of them, so the network
carries one allreduce per `backward_passes_per_step` steps. The sums of allreduced gradients are
kept by ferrovod's core (a multistep allreduce: the same for every framework); only the
gradients of rank-local variables, which the core never sees, are summed here."""

import itertools

import tensorflow as tf

from ferrovod.tensorflow.gradient_tape import Multistep

# one tag per aggregator, in creation order (the same on every rank), to keep their core sums apart
_tags = itertools.count()


class LocalGradientAggregator:
    """Holds the pass counter (Horovod's `counter`: passes since the last allreduce) and the
    sums of local gradients. Works eagerly, inside tf.function and in tf.compat.v1 graphs:
    every read is ordered after the writes it depends on."""

    def __init__(self, backward_passes_per_step, average_aggregated_gradients, sparse_as_dense):
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.passes = backward_passes_per_step
        self.average = average_aggregated_gradients
        self.sparse_as_dense = sparse_as_dense
        self.multistep = Multistep(self.passes, self.average, next(_tags))
        self.counter = None
        self._present = None
        self._sums = {}

    def _dense(self, grad):
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > 1 "
                                 "and `sparse_as_dense` is False.")
            return tf.convert_to_tensor(grad)
        return grad

    def _check(self, grads):
        present = [g is not None for g in grads]
        if self._present is not None and present != self._present:
            raise ValueError("backward_passes_per_step > 1 needs the same gradients on every pass")
        for g in grads:
            if g is not None and not g.shape.is_fully_defined():
                raise ValueError("backward_passes_per_step > 1 needs gradients of static shape, got %s"
                                 % g.shape)
        self._present = present
        if self.counter is None:
            with tf.init_scope():
                self.counter = tf.Variable(0, dtype=tf.int32, trainable=False,
                                           name="ferrovod_pass_counter")

    def _sum(self, i, grad):
        if i not in self._sums:
            with tf.init_scope():
                self._sums[i] = tf.Variable(tf.zeros(grad.shape, grad.dtype), trainable=False,
                                            name="ferrovod_aggregated_gradient")
        return self._sums[i]

    def reduce(self, grads, reduce_fn):
        """`reduce_fn(grads, multistep)` hands the gradients to the core's multistep allreduce
        (see `reduce_gradients`). Returns, on the last pass, the allreduced sums (divided by the
        pass count when averaging) and resets; on the others the core's outputs (this pass's
        gradients) and the local sums."""
        grads = [None if g is None else self._dense(g) for g in grads]
        self._check(grads)
        out, communicated, shared = reduce_fn(grads, self.multistep)
        out = list(out)
        if communicated is None:  # nothing went to the core: count the passes here
            communicated = tf.equal(self.counter.read_value() + 1, self.passes)
        local = [i for i, g in enumerate(out) if g is not None and i not in shared]
        if local:
            updates = [self._sum(i, out[i]).assign_add(out[i]) for i in local]
            with tf.control_dependencies(updates):
                sums = [self._sums[i].read_value() for i in local]

            def final():
                done = [s / self.passes if self.average else s for s in sums]
                with tf.control_dependencies(done):
                    resets = [self._sums[i].assign(tf.zeros_like(s)) for i, s in zip(local, sums)]
                with tf.control_dependencies(resets):
                    return [tf.identity(d) for d in done]

            def keep():
                return [tf.identity(s) for s in sums]

            if tf.executing_eagerly():
                chosen = final() if bool(communicated) else keep()
            else:
                chosen = tf.cond(communicated, final, keep)
            for i, value in zip(local, chosen):
                out[i] = value
        count = self.counter.assign(
            tf.where(communicated, 0, self.counter.read_value() + 1))
        with tf.control_dependencies([count]):
            return [None if g is None else tf.identity(g) for g in out]

    def apply(self, grads, apply_fn, iterations=None):
        """Runs `apply_fn()` on the pass that communicated (the counter was reset); on the other
        passes only advances `iterations`, as a skipped optimizer step."""
        if tf.executing_eagerly():
            if int(self.counter.numpy()) == 0:
                return apply_fn()
            if iterations is not None:
                iterations.assign_add(1)
            return None
        with tf.control_dependencies([g for g in grads if g is not None]):
            is_step = tf.equal(self.counter.read_value(), 0)

        def step_branch():
            return _after(apply_fn(), True)

        def skip_branch():
            if iterations is None:
                return tf.constant(False)
            return _after(iterations.assign_add(1), False)

        return tf.cond(is_step, step_branch, skip_branch)


def _after(result, value):
    """A constant `value` that runs after the tensors or ops in `result` (in a tf.compat.v1 graph
    nothing else would order them)."""
    deps = []
    for x in tf.nest.flatten(result):
        if not isinstance(x, (tf.Tensor, tf.Operation)):
            x = getattr(x, "op", None)  # a variable's assign_add returns an unread variable
        if isinstance(x, (tf.Tensor, tf.Operation)):
            deps.append(x)
    with tf.control_dependencies(deps):
        return tf.constant(value)
