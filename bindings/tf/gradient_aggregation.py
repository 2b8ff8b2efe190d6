"""Local gradient aggregation (Horovod's `backward_passes_per_step`): gradients are summed on
each rank over several backward passes and allreduced once, on the last of them, so the network
carries one allreduce per `backward_passes_per_step` steps."""

import tensorflow as tf


class LocalGradientAggregator:
    """Holds the running sums and the pass counter. Works eagerly, inside tf.function and in
    tf.compat.v1 graphs: every read is ordered after the writes it depends on, and the collective
    sits in the branch of a `tf.cond` that every rank takes on the same pass."""

    def __init__(self, backward_passes_per_step, average_aggregated_gradients, sparse_as_dense):
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.passes = backward_passes_per_step
        self.average = average_aggregated_gradients
        self.sparse_as_dense = sparse_as_dense
        self.counter = None
        self._sums = None

    def _dense(self, grad):
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > 1 "
                                 "and `sparse_as_dense` is False.")
            return tf.convert_to_tensor(grad)
        return grad

    def _variables_for(self, grads):
        if self._sums is not None:
            if len(self._sums) != len(grads) or any(
                    (s is None) != (g is None) for s, g in zip(self._sums, grads)):
                raise ValueError("backward_passes_per_step > 1 needs the same gradients on every pass")
            return
        for g in grads:
            if g is not None and not g.shape.is_fully_defined():
                raise ValueError("backward_passes_per_step > 1 needs gradients of static shape, got %s"
                                 % g.shape)
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="ferrovod_pass_counter")
            self._sums = [None if g is None else
                          tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False,
                                      name="ferrovod_aggregated_gradient")
                          for g in grads]

    def reduce(self, grads, allreduce_fn):
        """Adds `grads` to the sums. On the last pass returns `allreduce_fn(sums)` (divided by the
        pass count when averaging) and resets; on the others returns the local sums."""
        grads = [None if g is None else self._dense(g) for g in grads]
        self._variables_for(grads)
        updates = [s.assign_add(g) for s, g in zip(self._sums, grads) if g is not None]
        with tf.control_dependencies(updates):
            count = self.counter.assign_add(1)
        with tf.control_dependencies([count]):
            sums = [None if s is None else s.read_value() for s in self._sums]
        present = [i for i, s in enumerate(sums) if s is not None]

        def communicate():
            reduced = allreduce_fn(list(sums))
            reduced = [reduced[i] for i in present]
            if self.average:
                reduced = [r / self.passes for r in reduced]
            reduced = [tf.convert_to_tensor(r) for r in reduced]
            with tf.control_dependencies(reduced):
                resets = [self._sums[i].assign(tf.zeros_like(self._sums[i])) for i in present]
                resets.append(self.counter.assign(0))
            with tf.control_dependencies(resets):
                return [tf.identity(r) for r in reduced]

        def keep():
            return [tf.identity(sums[i]) for i in present]

        if tf.executing_eagerly():
            chosen = communicate() if int(count.numpy()) == self.passes else keep()
        else:
            chosen = tf.cond(tf.equal(count, self.passes), communicate, keep)
        out = [None] * len(grads)
        for i, value in zip(present, chosen):
            out[i] = value
        return out

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
