"""Gradient compression for allreduce: Horovod's `Compression.none` / `Compression.fp16`, and
ferrovod's `Compression.bf16` / `Compression.mixed` / `Compression.u8` (ferrovod.compression,
shared by the framework bindings, over TensorFlow's tensors).

A compressor with a `core` value (an fv_compression code) has f32 sums and averages compressed
by ferrovod's core: cast while packed into the fusion buffer and back while unpacked, with no
Python-side cast and no extra pass over the tensor. Its `compress`/`decompress` handle what the
core does not (other dtypes and ops), as Horovod's compressors do."""

import tensorflow as tf

from ferrovod import compression as _shared
from ferrovod.compression import Compressor  # noqa: F401 (Horovod's base class)

Compression = _shared.compression_for(_shared.Framework(
    is_floating=lambda t: t.dtype.is_floating,
    cast=lambda t, dtype: tf.cast(t, dtype=dtype),
    dtype=lambda t: t.dtype,
    float16=tf.float16,
))
NoneCompressor = Compression.none
FP16Compressor = Compression.fp16
BF16Compressor = Compression.bf16
MixedCompressor = Compression.mixed
U8Compressor = Compression.u8


def core_codec(compression, dtype, op):
    """The fv_compression value to hand the core for an allreduce of `dtype` with `op`, or None
    when `compression` must run in Python (a custom compressor, or what the core leaves)."""
    return _shared.core_codec(compression, dtype == tf.float32, op)
