"""Gradient compression for allreduce: Horovod's `Compression.none` / `Compression.fp16`, and
ferrovod's `Compression.bf16` / `Compression.mixed` / `Compression.u8`.

A compressor with a `core` value (an fv_compression code) has f32 sums and averages compressed
by ferrovod's core: cast while packed into the fusion buffer and back while unpacked, with no
Python-side cast and no extra pass over the tensor. Its `compress`/`decompress` handle what the
core does not (other dtypes and ops), as Horovod's compressors do."""

import tensorflow as tf

from ferrovod import _core


class Compressor:
    """Interface: `compress(tensor) -> (tensor, ctx)`, `decompress(tensor, ctx) -> tensor`."""

    core = None

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Nothing compressed here (the job's FERROVOD_COMPRESSION still applies in the core)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """f32 sums and averages travel as IEEE half precision in the core; other floating tensors
    (and other ops) are cast to float16 here and back, as Horovod does."""

    core = _core.COMPRESSION_FP16

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating:
            return tf.cast(tensor, dtype=tf.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and ctx.is_floating and tensor.dtype != ctx:
            return tf.cast(tensor, dtype=ctx)
        return tensor


class _CoreOnly(NoneCompressor):
    """Compressed in the core only; what the core does not compress travels as it is."""


class BF16Compressor(_CoreOnly):
    """ferrovod extension: f32 sums and averages travel as bfloat16 (f32's range, 8 bits of
    mantissa)."""

    core = _core.COMPRESSION_BF16


class MixedCompressor(_CoreOnly):
    """ferrovod extension: f32 sums and averages below FERROVOD_COMPRESSION_MIN_BYTES travel as
    f32, larger ones as IEEE half precision (AIACC's mixed precision)."""

    core = _core.COMPRESSION_MIXED


def core_codec(compression, dtype, op):
    """The fv_compression value to hand the core for an allreduce of `dtype` with `op`, or None
    when `compression` must run in Python (a custom compressor, or what the core leaves)."""
    core = getattr(compression, "core", None)
    if core is None or dtype != tf.float32 or op not in (_core.SUM, _core.AVERAGE):
        return None
    return core


class U8Compressor(_CoreOnly):
    """ferrovod extension: f32 sums and averages travel as 8-bit min-max blocks with error
    feedback (what rounding loses is added to the tensor's next allreduce, kept per tensor
    name), summed in f32."""

    core = _core.COMPRESSION_U8


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    mixed = MixedCompressor
    u8 = U8Compressor
