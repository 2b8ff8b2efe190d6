"""TensorFlow 1 style training (tf.compat.v1): DistributedOptimizer for
tf.compat.v1.train.Optimizer, broadcast_global_variables and BroadcastGlobalVariablesHook."""

import tensorflow as tf

from ferrovod.tensorflow.compression import Compression
from ferrovod.tensorflow.functions import broadcast_variables
from ferrovod.tensorflow.gradient_aggregation import LocalGradientAggregator
from ferrovod.tensorflow.gradient_tape import gradient_options, reduce_gradients
from ferrovod.tensorflow.mpi_ops import Average
from horovod.common.process_sets import global_process_set


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Delegates to the wrapped optimizer; `compute_gradients` averages the gradients over the
    ranks first."""

    def __init__(self, optimizer, name, use_locking, options, aggregator, scale_local):
        self._optimizer = optimizer
        self._options = options
        self._aggregator = aggregator
        self._scale_local = scale_local
        self._local_vars = []
        super().__init__(name=name or "Distributed" + type(optimizer).__name__, use_locking=use_locking)

    def register_local_var(self, var):
        """`var`'s gradient stays this rank's own (model-parallel parts), divided by the process
        set's size unless `scale_local_gradients=False`."""
        self._local_vars.append(var)

    def compute_gradients(self, *args, **kwargs):
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = zip(*pairs) if pairs else ((), ())

        def allreduce(grads, multistep=None):
            return reduce_gradients(grads, list(variables), self._options, self._local_vars,
                                    self._scale_local, multistep=multistep)

        if self._aggregator is not None:
            reduced = self._aggregator.reduce(list(grads), allreduce)
        else:
            reduced = allreduce(list(grads))
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        if self._aggregator is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step, name)
        pairs = list(grads_and_vars)
        return self._aggregator.apply(
            [g for g, _ in pairs], lambda: self._optimizer.apply_gradients(pairs, global_step, name),
            iterations=global_step)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True):
    """Horovod's DistributedOptimizer: a tf.compat.v1 optimizer is wrapped here; a Keras
    optimizer is handed to `horovod.tensorflow.keras.DistributedOptimizer`."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        options = gradient_options("DistributedOptimizer", op, compression, sparse_as_dense,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   device_dense, device_sparse)
        aggregator = None
        if backward_passes_per_step != 1:
            aggregator = LocalGradientAggregator(backward_passes_per_step, average_aggregated_gradients,
                                                 sparse_as_dense)
        return _DistributedOptimizer(optimizer, name, use_locking, options, aggregator,
                                     scale_local_gradients)
    from ferrovod.tensorflow.keras import DistributedOptimizer as KerasDistributedOptimizer

    return KerasDistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


def broadcast_global_variables(root_rank):
    """Graph mode: an op that assigns `root_rank`'s values to all global variables."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts the global variables from `root_rank` once the session is created
    (tf.compat.v1.train.MonitoredTrainingSession)."""

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self):
        if not self.bcast_op or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
