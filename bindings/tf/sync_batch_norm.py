"""SyncBatchNormalization: batch normalization whose batch statistics cover the global batch
(every rank's samples), for models whose per-rank batch is too small for stable statistics."""

import tensorflow as tf

from ferrovod.tensorflow.mpi_ops import Sum, _allreduce, size
from horovod.common.process_sets import global_process_set


def global_moments(mean, variance, count, process_set=global_process_set):
    """Mean and variance over all ranks from each rank's `mean`, `variance` and sample `count`
    (a scalar or per-channel weight; ranks may hold different batch sizes). One allreduce
    carries the weighted sums of x and x², and the counts; it is differentiable, so gradients
    reach every rank's inputs."""
    dtype = mean.dtype
    count = tf.broadcast_to(tf.cast(count, dtype), tf.shape(mean))
    packed = tf.stack([mean * count, (variance + tf.square(mean)) * count, count])
    total = _allreduce(packed, op=Sum, process_set=process_set)
    g_mean = total[0] / total[2]
    g_variance = tf.maximum(total[1] / total[2] - tf.square(g_mean), tf.zeros([], dtype))
    return g_mean, g_variance


def _sample_count(inputs, axes, mask, mean):
    """How many values each channel's statistics were taken over on this rank."""
    if mask is None:
        return tf.reduce_prod(tf.gather(tf.shape(inputs), axes))
    weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
    return tf.reshape(tf.reduce_sum(weights, axes), tf.shape(mean))


def _keras3_layer(base):
    class SyncBatchNormalization(base):
        """Keras 3 BatchNormalization with global batch statistics while training."""

        def __init__(self, fused=False, **kwargs):
            if fused:
                raise ValueError("SyncBatchNormalization does not support fused=True.")
            super().__init__(**kwargs)

        def _moments(self, inputs, mask):
            mean, variance = super()._moments(inputs, mask)
            if size() <= 1:
                return mean, variance
            return global_moments(mean, variance,
                                  _sample_count(inputs, self._reduction_axes, mask, mean))

    return SyncBatchNormalization


def _keras2_layer(base):
    class SyncBatchNormalization(base):
        """tf_keras (Keras 2) BatchNormalization with global batch statistics while training."""

        def __init__(self, fused=False, **kwargs):
            if fused:
                raise ValueError("SyncBatchNormalization does not support fused=True.")
            super().__init__(fused=False, **kwargs)

        def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
            mean, variance = super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
            if size() <= 1:
                return mean, variance
            return global_moments(mean, variance, _sample_count(inputs, reduction_axes, mask, mean))

    return SyncBatchNormalization


def _layer_class():
    base = tf.keras.layers.BatchNormalization
    if hasattr(base, "_calculate_mean_and_var"):  # tf_keras (TF_USE_LEGACY_KERAS=1)
        return _keras2_layer(base)
    return _keras3_layer(base)


SyncBatchNormalization = _layer_class()
