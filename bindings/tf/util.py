"""Helpers Horovod's code and tests import from `horovod.tensorflow.util`."""

import tensorflow as tf

from horovod.common.util import _cache  # noqa: F401


def _executing_eagerly():
    """Whether TensorFlow runs eagerly here (False inside tf.function and v1 graphs)."""
    return tf.executing_eagerly()


def _make_subgraph(f):
    """Eager callers get `f` compiled as a tf.function, as Horovod does for gradient reduction."""
    return tf.function(f)


def vars_to_refs(vars):
    return [v.ref() if hasattr(v, "ref") else v for v in vars]


def refs_to_vars(refs):
    return [r.deref() if hasattr(r, "deref") else r for r in refs]
