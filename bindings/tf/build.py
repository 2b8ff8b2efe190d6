"""The TensorFlow op library (mpi_ops.cc), compiled against the imported TensorFlow on first
use (ferrovod/_build.py)."""

import os

from ferrovod._build import op_library

HERE = os.path.dirname(os.path.abspath(__file__))


def op_library_path():
    """Path of the op library for the imported TensorFlow, building it if needed."""
    import tensorflow as tf

    flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
    return op_library("tf", tf.__version__, os.path.join(HERE, "mpi_ops.cc"), flags,
                      "ferrovod_tf_ops.so")
