"""Gradient compression for allreduce (Horovod's `Compression.none` / `Compression.fp16`)."""

import tensorflow as tf


class Compressor:
    """Interface: `compress(tensor) -> (tensor, ctx)`, `decompress(tensor, ctx) -> tensor`."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 and are cast back; others pass through."""

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


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
