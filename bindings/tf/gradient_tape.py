"""DistributedGradientTape: a tf.GradientTape whose gradients are averaged over the ranks."""

import tensorflow as tf

from ferrovod.tensorflow.compression import Compression
from ferrovod.tensorflow.mpi_ops import Average, Sum, _normalize_name, size
from ferrovod.tensorflow.reduction import allreduce, grouped_allreduce, multistep_reduce
from horovod.common.process_sets import global_process_set
from horovod.common.util import split_list


def gradient_options(what, op, compression, sparse_as_dense, gradient_predivide_factor, num_groups,
                     groups, process_set, device_dense, device_sparse):
    """Checks the arguments shared by DistributedGradientTape and the DistributedOptimizers and
    returns them as keyword arguments for `_reduce_gradients`."""
    if op not in (Average, Sum):
        raise NotImplementedError("ferrovod supports op=Average or op=Sum for %s" % what)
    if groups is not None and not isinstance(groups, (int, list)):
        raise ValueError("groups should be an int or a list of lists of variables")
    if isinstance(groups, int):
        num_groups, groups = groups, None
    return dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                groups=groups, process_set=process_set, device_dense=device_dense,
                device_sparse=device_sparse)


class Multistep:
    """Local gradient aggregation done by the core (Horovod's backward_passes_per_step):
    `passes` per allreduce, the sums divided by `passes` when `average`; `tag` keeps one
    aggregator's core sums apart from another's (the same on every rank: aggregators are
    created in the same order everywhere)."""

    def __init__(self, passes, average, tag):
        self.passes, self.average, self.tag = passes, average, tag


def _parts(work, sources, num_groups, groups):
    """`work` split into the groups reduced together, or None when every gradient goes alone."""
    if groups is not None:
        ids = {id(v): k for k, grp in enumerate(groups) for v in grp}
        buckets = {}
        for item in work:
            buckets.setdefault(ids.get(id(sources[item[0]]), -1 - item[0]), []).append(item)
        return list(buckets.values())
    if num_groups > 0:
        return [p for p in split_list(work, num_groups) if p]
    return None


def _reduce_gradients(grads, sources, op, compression, sparse_as_dense, gradient_predivide_factor,
                      num_groups, groups, process_set, device_dense, device_sparse,
                      use_generic_names, local_sources=(), multistep=None):
    """Allreduces `grads` (None entries and local sources are left alone), in groups if asked.
    With `multistep`, the core sums them over the passes instead: returns (gradients,
    communicated or None where no gradient went to the core, indices of those that did)."""
    if op == Average and gradient_predivide_factor != 1.0:
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    elif gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    else:
        prescale = postscale = 1.0
    if process_set.included() is False:
        return grads if multistep is None else (grads, None, set())
    local_ids = {id(s) for s in local_sources}
    work = []
    for i, (g, s) in enumerate(zip(grads, sources)):
        if g is None or id(s) in local_ids:
            continue
        if sparse_as_dense and isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        # the index keeps names unique (Keras 3 variable names such as "kernel" repeat)
        path = getattr(s, "path", None) or getattr(s, "name", None)
        label = "grad_%d" % i if use_generic_names or path is None else "%d_%s" % (i, _normalize_name(path))
        work.append((i, g, "DistributedGradientTape_Allreduce_%s" % label))
    out = list(grads)
    parts = _parts(work, sources, num_groups, groups)
    if multistep is not None:
        if multistep.average:
            postscale /= multistep.passes
        communicated = None
        for part in parts if parts is not None else [[item] for item in work]:
            name = "DistributedOptimizer_Multistep_%d_%s" % (multistep.tag, part[0][2])
            with tf.device(device_dense):
                reduced, flag = multistep_reduce(
                    [x[1] for x in part], multistep.passes,
                    name + "_group" if len(part) > 1 else name, op=op, prescale_factor=prescale,
                    postscale_factor=postscale, compression=compression, process_set=process_set)
            for (i, _, _), r in zip(part, reduced):
                out[i] = r
            communicated = flag if communicated is None else communicated
        return out, communicated, {i for i, _, _ in work}
    if parts is not None:
        for part in parts:
            dense = [x for x in part if not isinstance(x[1], tf.IndexedSlices)]
            if dense:
                reduced = grouped_allreduce([x[1] for x in dense], op=op, compression=compression,
                                            prescale_factor=prescale, postscale_factor=postscale,
                                            process_set=process_set, device_dense=device_dense,
                                            name=dense[0][2] + "_group")
                for (i, _, _), r in zip(dense, reduced):
                    out[i] = r
            for i, g, name in (x for x in part if isinstance(x[1], tf.IndexedSlices)):
                out[i] = allreduce(g, op=op, compression=compression, process_set=process_set,
                                   device_sparse=device_sparse, name=name)
        return out
    for i, g, name in work:
        out[i] = allreduce(g, op=op, compression=compression, name=name, prescale_factor=prescale,
                           postscale_factor=postscale, process_set=process_set,
                           device_dense=device_dense, device_sparse=device_sparse)
    return out


class _DistributedGradientTape(tf.GradientTape):
    def __init__(self, tape, options, scale_local_gradients, persistent=False):
        if hasattr(tape, "_watch_accessed_variables"):
            super().__init__(persistent, tape._watch_accessed_variables)
        else:
            super().__init__(persistent)
        self._tape = tape._tape
        self._recording = tape._recording
        self._persistent = tape._persistent
        self._options = options
        self._scale_local_gradients = scale_local_gradients
        self._local_sources = []

    def register_local_source(self, source):
        """`source`'s gradient stays local (not allreduced)."""
        self._local_sources.append(source)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False):
        grads = super().gradient(target, sources, output_gradients)
        flat_grads = reduce_gradients(tf.nest.flatten(grads), tf.nest.flatten(sources), self._options,
                                      self._local_sources, self._scale_local_gradients,
                                      use_generic_names)
        return tf.nest.pack_sequence_as(grads, flat_grads)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """`gradient()` split into ([(local source, gradient)], [(other source, gradient)])."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local_ids = {id(s) for s in self._local_sources}
        local, shared = [], []
        for s, g in zip(tf.nest.flatten(sources), tf.nest.flatten(grads)):
            (local if id(s) in local_ids else shared).append((s, g))
        return local, shared


def reduce_gradients(grads, sources, options, local_sources=(), scale_local=True,
                     use_generic_names=False, multistep=None):
    """`grads` averaged (or summed) over the process set; the gradients of `local_sources` stay
    this rank's own, divided by the set's size when `scale_local` (Horovod's
    scale_local_gradients, which applies to either op). With `multistep` (a Multistep), returns
    (gradients, communicated, indices summed by the core) as `_reduce_gradients` does."""
    grads = list(grads)
    summed = None
    if multistep is not None:  # the core sums the passes, also on one rank
        grads, communicated, shared = _reduce_gradients(
            grads, sources, use_generic_names=use_generic_names, local_sources=local_sources,
            multistep=multistep, **options)
        summed = (communicated, shared)
    elif size() > 1:
        grads = _reduce_gradients(grads, sources, use_generic_names=use_generic_names,
                                  local_sources=local_sources, **options)
    if scale_local and local_sources:
        grads = scale_local_gradients(grads, sources, local_sources, options["process_set"].size())
    return grads if summed is None else (grads, *summed)


def scale_local_gradients(grads, sources, local_sources, factor):
    """Divides the gradients of rank-local sources by `factor`, so that a model-parallel layer's
    update matches the averaged data-parallel ones (Horovod's scale_local_gradients)."""
    local_ids = {id(s) for s in local_sources}
    out = []
    for g, s in zip(grads, sources):
        if g is not None and id(s) in local_ids:
            if isinstance(g, tf.IndexedSlices):
                g = tf.IndexedSlices(g.values / factor, g.indices, g.dense_shape)
            else:
                g = g / factor
        out.append(g)
    return out


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=global_process_set,
                            scale_local_gradients=True):
    """Wraps a tf.GradientTape so that `gradient()` returns gradients averaged (or summed, with
    `op=Sum`) over the ranks of `process_set`."""
    options = gradient_options("DistributedGradientTape", op, compression, sparse_as_dense,
                               gradient_predivide_factor, num_groups, groups, process_set,
                               device_dense, device_sparse)
    return _DistributedGradientTape(gradtape, options, scale_local_gradients)


def local_layer_variables(local_layers):
    """The trainable variables of `local_layers` (one Keras layer, a list of them, or None)."""
    if local_layers is None:
        return []
    if not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    if not all(hasattr(layer, "trainable_weights") for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return [v for layer in local_layers for v in layer.trainable_weights]


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False, op=Average,
                                   gradient_predivide_factor=1.0, num_groups=0, groups=None,
                                   process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """A DistributedGradientTape whose `local_layers` (model-parallel parts) keep their local
    gradients."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for var in local_layer_variables(local_layers):
        tape.register_local_source(var)
    return tape
