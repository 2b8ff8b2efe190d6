"""Horovod's Keras API for TensorFlow (`horovod.tensorflow.keras`), for Keras 3 and for
tf_keras (Keras 2) optimizers."""

import tensorflow as tf

from ferrovod.tensorflow import (  # noqa: F401
    Adasum,
    Average,
    Compression,
    Sum,
    allgather,
    allgather_object,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_threads_supported,
    rank,
    reducescatter,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ferrovod.tensorflow import allreduce as _tf_allreduce
from ferrovod.tensorflow.gradient_aggregation import LocalGradientAggregator
from ferrovod.tensorflow.gradient_tape import (
    _reduce_gradients,
    gradient_options,
    local_layer_variables,
    scale_local_gradients,
)
from ferrovod.tensorflow.keras import callbacks, elastic  # noqa: F401
from horovod.common.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)


def _wrap_optimizer_class(base, options, scale_local):
    """A subclass of the optimizer's own class whose gradients are allreduced (after local
    aggregation, with backward_passes_per_step > 1) before they are applied (Keras 3: `apply`;
    tf_keras: `apply_gradients`)."""

    def reduce(self, grads, variables):
        if size() <= 1:
            return grads
        local = self._ferrovod_local_vars
        grads = _reduce_gradients(list(grads), variables, use_generic_names=False, local_sources=local,
                                  **options)
        if scale_local and local and options["op"] == Average:
            grads = scale_local_gradients(grads, variables, local, options["process_set"].size())
        return grads

    def reduced_grads(self, grads, variables):
        """Allreduced gradients, or with local aggregation the running sums until the last pass."""
        aggregator = self._agg_helper
        if aggregator is None:
            return reduce(self, grads, variables)
        return aggregator.reduce(list(grads), lambda gs: reduce(self, gs, variables))

    def apply_reduced(self, grads, apply_fn):
        aggregator = self._agg_helper
        if aggregator is None:
            return apply_fn(grads)
        return aggregator.apply(grads, lambda: apply_fn(grads), self.iterations)

    namespace = {"_ferrovod_distributed": True}
    if hasattr(base, "stateless_apply"):  # Keras 3
        def apply(self, grads, trainable_variables=None):
            variables = list(trainable_variables if trainable_variables is not None
                             else self._trainable_variables)
            if not self.built:
                # outside the tf.cond of local aggregation, which must not create variables
                with tf.init_scope():
                    self.build(variables)
            return apply_reduced(self, reduced_grads(self, grads, variables),
                                 lambda gs: super(cls, self).apply(gs, trainable_variables))

        namespace["apply"] = apply
    else:
        def apply_gradients(self, grads_and_vars, *args, **kwargs):
            pairs = list(grads_and_vars)
            grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
            if getattr(self, "_ferrovod_reduced", False):
                self._ferrovod_reduced = False  # _compute_gradients already reduced them
            else:
                grads = reduced_grads(self, grads, variables)
            return apply_reduced(
                self, grads,
                lambda gs: super(cls, self).apply_gradients(list(zip(gs, variables)), *args, **kwargs))

        namespace["apply_gradients"] = apply_gradients

    if hasattr(base, "_compute_gradients"):  # tf_keras legacy optimizers: reduce here, as Horovod
        def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
            pairs = super(cls, self)._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)
            grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
            self._ferrovod_reduced = True
            return list(zip(reduced_grads(self, grads, variables), variables))

        namespace["_compute_gradients"] = _compute_gradients

    def register_local_var(self, var):
        """`var`'s gradient stays local (model-parallel layers)."""
        self._ferrovod_local_vars.append(var)

    namespace["register_local_var"] = register_local_var
    cls = type(base.__name__, (base,), namespace)
    return cls


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wraps a Keras optimizer so that gradients are averaged over the ranks before they are
    applied. Works with Keras 3 optimizers and tf_keras (Keras 2) ones."""
    options = gradient_options("DistributedOptimizer", op, compression, sparse_as_dense,
                               gradient_predivide_factor, num_groups, groups, process_set,
                               device_dense, device_sparse)
    if getattr(optimizer, "_ferrovod_distributed", False):
        return optimizer
    cls = _wrap_optimizer_class(optimizer.__class__, options, scale_local_gradients)
    wrapped = cls.from_config(optimizer.get_config())
    wrapped._ferrovod_local_vars = []
    wrapped._agg_helper = None
    if backward_passes_per_step != 1:
        wrapped._agg_helper = LocalGradientAggregator(
            backward_passes_per_step, average_aggregated_gradients, sparse_as_dense)
    return wrapped


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                                average_aggregated_gradients=False, groups=None,
                                process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A DistributedOptimizer whose `local_layers` (model-parallel parts) keep their local
    gradients."""
    wrapped = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    for var in local_layer_variables(local_layers):
        wrapped.register_local_var(var)
    return wrapped


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none, process_set=global_process_set):
    """Allreduce of a tensor or value (Keras flavour: returns a tensor)."""
    return _tf_allreduce(tf.convert_to_tensor(value), name=name, average=average, op=op,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                         compression=compression, process_set=process_set)


def broadcast_global_variables(root_rank):
    """Keras 3 has no global variable collection: broadcast `model.variables` with
    `broadcast_variables` or use BroadcastGlobalVariablesCallback."""
    raise RuntimeError(
        "broadcast_global_variables() is not available with eager/Keras 3; use "
        "hvd.callbacks.BroadcastGlobalVariablesCallback or hvd.broadcast_variables(model.variables, root_rank)"
    )


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """Loads a Keras model and wraps its optimizer in DistributedOptimizer."""
    import keras

    objects = dict(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    if getattr(model, "optimizer", None) is not None:
        model.optimizer = DistributedOptimizer(model.optimizer, compression=compression)
    return model
