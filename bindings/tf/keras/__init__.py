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
from ferrovod.tensorflow.gradient_tape import _reduce_gradients, gradient_options
from ferrovod.tensorflow.keras import callbacks  # noqa: F401
from horovod.common.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)


def _wrap_optimizer_class(base, options, backward_passes_per_step, average_aggregated_gradients):
    """A subclass of the optimizer's own class whose gradients are allreduced before they are
    applied (Keras 3: `apply`; tf_keras: `apply_gradients`)."""

    def reduce(self, grads, variables):
        grads = list(grads)
        variables = list(variables)
        if size() <= 1:
            return grads
        return _reduce_gradients(grads, variables, use_generic_names=False,
                                 local_sources=self._ferrovod_local_vars, **options)

    namespace = {"_ferrovod_distributed": True}
    if hasattr(base, "stateless_apply"):  # Keras 3
        def apply(self, grads, trainable_variables=None):
            variables = trainable_variables if trainable_variables is not None else self._trainable_variables
            return super(cls, self).apply(reduce(self, grads, variables), trainable_variables)

        namespace["apply"] = apply
    else:
        def apply_gradients(self, grads_and_vars, *args, **kwargs):
            pairs = list(grads_and_vars)
            reduced = reduce(self, [g for g, _ in pairs], [v for _, v in pairs])
            return super(cls, self).apply_gradients(list(zip(reduced, [v for _, v in pairs])), *args, **kwargs)

        namespace["apply_gradients"] = apply_gradients

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
                               device_dense, device_sparse, backward_passes_per_step)
    if getattr(optimizer, "_ferrovod_distributed", False):
        return optimizer
    cls = _wrap_optimizer_class(optimizer.__class__, options, backward_passes_per_step,
                                average_aggregated_gradients)
    config = optimizer.get_config()
    wrapped = cls.from_config(config)
    wrapped._ferrovod_local_vars = []
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
