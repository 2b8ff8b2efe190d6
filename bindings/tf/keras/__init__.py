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
    gradient_options,
    local_layer_variables,
    reduce_gradients,
)
from ferrovod.tensorflow.keras import callbacks, elastic  # noqa: F401
from horovod.common.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)


def _tape_gradients(loss, var_list, grad_loss, tape):
    """This rank's (gradient, variable) pairs of `loss`, for optimizers with no gradient method of
    their own (Keras 3), as tf_keras's `compute_gradients` computes them."""
    if not callable(loss) and tape is None:
        raise ValueError("`tape` is required when a `Tensor` loss is passed. Received: loss=%s, "
                         "tape=None." % (loss,))
    tape = tf.GradientTape() if tape is None else tape
    if callable(loss):
        with tape:
            if not callable(var_list):
                tape.watch([_watchable(v) for v in var_list])
            loss = loss()
    if callable(var_list):
        var_list = var_list()
    var_list = list(var_list)
    return list(zip(tape.gradient(loss, var_list, output_gradients=grad_loss), var_list))


def _watchable(var):
    """What a tape can watch for `var`: a Keras 3 variable's tf.Variable."""
    if isinstance(var, tf.Variable):
        return var
    inner = getattr(var, "value", None)
    return inner if isinstance(inner, tf.Variable) else var


def _wrap_optimizer_class(base, options, scale_local, aggregation):
    """A subclass of the optimizer's own class whose gradients are allreduced (after local
    aggregation, with backward_passes_per_step > 1): by `compute_gradients`/`_compute_gradients`
    (and `get_gradients` where the class has it) as in Horovod, or else when they are applied
    (Keras 3: `apply`; tf_keras: `apply_gradients`), so that a loop computing its own gradients
    still trains data-parallel. Gradients returned reduced are not reduced again when applied."""

    def reduced_grads(self, grads, variables):
        """Allreduced gradients; with local aggregation, those of the last pass only (the core sums
        the passes)."""

        def reduce(gs, multistep=None):
            return reduce_gradients(gs, variables, options, self._ferrovod.local_vars, scale_local,
                                    multistep=multistep)

        aggregator = self._agg_helper
        grads = list(grads)
        reduced = reduce(grads) if aggregator is None else aggregator.reduce(grads, reduce)
        self._ferrovod.reduced = reduced
        return reduced

    def reduced_once(self, grads, variables):
        """`grads` reduced, unless they are the ones this optimizer last returned reduced."""
        last, self._ferrovod.reduced = self._ferrovod.reduced, None
        if last is not None and len(last) == len(grads) and all(a is b for a, b in zip(last, grads)):
            return grads
        return reduced_grads(self, grads, variables)

    def apply_reduced(self, grads, apply_fn):
        self._ferrovod.reduced = None
        aggregator = self._agg_helper
        if aggregator is None:
            return apply_fn(grads)
        return aggregator.apply(grads, lambda: apply_fn(grads), self.iterations)

    def __init__(self, *args, **kwargs):
        super(cls, self).__init__(*args, **kwargs)
        self._ferrovod = _WrapState()
        # Horovod's name, which its tests read (counter: passes since the last allreduce)
        self._agg_helper = None if aggregation is None else LocalGradientAggregator(*aggregation)

    namespace = {"_ferrovod_distributed": True, "__init__": __init__}
    if hasattr(base, "stateless_apply"):  # Keras 3
        def apply(self, grads, trainable_variables=None):
            variables = list(trainable_variables if trainable_variables is not None
                             else self._trainable_variables)
            if not self.built:
                # outside the tf.cond of local aggregation, which must not create variables
                with tf.init_scope():
                    self.build(variables)
            grads = reduced_once(self, list(grads), variables)
            return apply_reduced(self, grads, lambda gs: super(cls, self).apply(gs, trainable_variables))

        namespace["apply"] = apply
    else:
        def apply_gradients(self, grads_and_vars, *args, **kwargs):
            pairs = list(grads_and_vars)
            grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
            grads = reduced_once(self, grads, variables)
            return apply_reduced(
                self, grads,
                lambda gs: super(cls, self).apply_gradients(list(zip(gs, variables)), *args, **kwargs))

        namespace["apply_gradients"] = apply_gradients

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """This rank's gradients as the wrapped optimizer computes them, allreduced."""
        parent = super(cls, self)
        if hasattr(base, "_compute_gradients"):  # tf_keras legacy
            pairs = parent._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)
        elif hasattr(base, "compute_gradients") and grad_loss is None:  # tf_keras
            pairs = parent.compute_gradients(loss, var_list, tape=tape)
        else:  # Keras 3, or a grad_loss tf_keras's method does not take
            pairs = _tape_gradients(loss, var_list, grad_loss, tape)
        pairs = list(pairs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        return list(zip(reduced_grads(self, grads, variables), variables))

    def compute_gradients(self, loss, var_list, tape=None):
        """Horovod's: `_compute_gradients` without `grad_loss`."""
        return self._compute_gradients(loss, var_list, tape=tape)

    namespace["_compute_gradients"] = _compute_gradients
    namespace["compute_gradients"] = compute_gradients

    if hasattr(base, "get_gradients"):  # tf_keras legacy, graph mode
        def get_gradients(self, loss, params):
            grads = super(cls, self).get_gradients(loss, params)
            return reduced_grads(self, grads, list(params))

        namespace["get_gradients"] = get_gradients

    def register_local_var(self, var):
        """`var`'s gradient stays local (model-parallel layers)."""
        self._ferrovod.local_vars.append(var)

    namespace["register_local_var"] = register_local_var
    cls = type(base.__name__, (base,), namespace)
    return cls


class _WrapState:
    """What the wrapper keeps per optimizer, out of reach of Keras's attribute tracking."""

    def __init__(self):
        self.local_vars = []
        self.reduced = None


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
    aggregation = None
    if backward_passes_per_step != 1:
        # the wrapped class's __init__ (through from_config, below) makes the aggregator and
        # checks these arguments
        aggregation = (backward_passes_per_step, average_aggregated_gradients, sparse_as_dense)
    cls = _wrap_optimizer_class(optimizer.__class__, options, scale_local_gradients, aggregation)
    return cls.from_config(optimizer.get_config())


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
